"""BlockPool.grow: more free blocks; existing block ids, bytes and owners unchanged."""

from __future__ import annotations

import pytest
import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.token_table import TokenTable


def test_grow_keeps_ids_bytes_and_owners():
    pool = BlockPool(2, 4, 2, 8)
    table = TokenTable(4)
    key, value = torch.randn(7, 2, 8), torch.randn(7, 2, 8)
    table.append(pool, key, value)
    assert pool.num_free_blocks == 0
    pool.grow(3)
    assert pool.num_blocks == 5 and pool.num_free_blocks == 3
    assert pool.ref_counts == [1, 1, 0, 0, 0]
    got_key, got_value = pool.read(table.live_slots())
    assert torch.equal(got_key, key) and torch.equal(got_value, value)
    table.append(pool, torch.randn(9, 2, 8), torch.randn(9, 2, 8))  # now fits
    table.check_invariants()
    assert sorted(table.blocks) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_grow_refuses_a_bad_count(bad):
    pool = BlockPool(2, 4, 2, 8)
    with pytest.raises(InvalidArgumentError, match="num_new_blocks"):
        pool.grow(bad)
    assert pool.num_blocks == 2 and pool.key.shape[0] == 2
