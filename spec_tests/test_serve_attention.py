"""The engine's split decode: ragged rows cut into pieces of keys, attended in one call and
merged by log-sum-exp, equal attention over each row's keys in one piece.

Both sides run the same registered ``paged_attention`` backend (the reference here, and the
compiled one in ``test_split_decode_on_the_compiled_backend``); only the order of the sums
differs, so they agree to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack import ops
from kvstack.serve import attention as serve_attention

H_KV, GROUP, HEAD_DIM, BLOCK, BLOCKS = 2, 2, 8, 4, 64


def pool(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, BLOCK, H_KV, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def layer_rows(widths: list[list[int]], seed: int, holes: bool):
    """Per layer, its rows' slots [n, w] (distinct slots, -1 holes at random when ``holes``) and
    key positions [n, w] (0, 1, ...); and every row's query [N, 1, H', D] and newest position."""
    gen = torch.Generator().manual_seed(seed)
    slot_rows, position_rows, newest = [], [], []
    for layer in widths:
        width = max(layer)
        slots = torch.full((len(layer), width), -1, dtype=torch.int64)
        for row, live in enumerate(layer):
            slots[row, :live] = torch.randperm(BLOCKS * BLOCK, generator=gen)[:live]
            if holes and live > 1:  # a released entry inside the row (not its newest)
                slots[row, int(torch.randint(0, live - 1, (1,), generator=gen))] = -1
            newest.append(live - 1)
        slot_rows.append(slots)
        position_rows.append(torch.arange(width).expand(len(layer), width).contiguous())
    rows = sum(len(layer) for layer in widths)
    query = torch.randn(rows, 1, H_KV * GROUP, HEAD_DIM, generator=gen)
    return slot_rows, position_rows, query, torch.tensor(newest)[:, None]


def whole_rows(attention, query, key_cache, value_cache, slot_rows, position_rows, newest):
    """Each row attended over all its keys at once (padded to the widest): the specification."""
    width = max(rows.shape[1] for rows in slot_rows)
    pad = serve_attention._pad
    return attention(
        query,
        key_cache,
        value_cache,
        torch.cat([pad(rows, width, -1) for rows in slot_rows]),
        torch.cat([pad(rows, width, 0) for rows in position_rows]),
        newest,
        scale=0.3,
    )


@settings(max_examples=60, deadline=None)
@given(
    widths=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=4),
    piece=st.sampled_from([1, 3, 4, 8, 64]),
    holes=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_attention_in_pieces_equals_attention_over_whole_rows(widths, piece, holes, seed):
    attention = ops.get("paged_attention", "reference")
    key_cache, value_cache = pool(seed)
    slot_rows, position_rows, query, newest = layer_rows(widths, seed, holes)
    expected = whole_rows(
        attention, query, key_cache, value_cache, slot_rows, position_rows, newest
    ).out
    got = serve_attention.attend_in_pieces(
        attention, query, key_cache, value_cache, slot_rows, position_rows, newest, 0.3, piece
    )
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_split_decode_on_the_compiled_backend():
    # The engine's default backend and piece size: rows of 1 to 300 keys, 128 keys a piece.
    attention = ops.get("paged_attention", "compiled")
    key_cache, value_cache = pool(7)
    slot_rows, position_rows, query, newest = layer_rows([[1, 130, 256], [200]], 7, holes=True)
    expected = whole_rows(
        attention, query, key_cache, value_cache, slot_rows, position_rows, newest
    ).out
    got = serve_attention.attend_in_pieces(
        attention, query, key_cache, value_cache, slot_rows, position_rows, newest, 0.3, 128
    )
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_merging_pieces_follows_the_merge_rule_and_leaves_empty_rows_zero():
    # Row 0: two pieces, one of them empty (lse -inf, out 0); row 1: a single piece; row 2:
    # every piece empty, which merges to out 0 (the identity of kvstack.reference.merge).
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(5, 1, 3, 4, generator=gen)
    lse = torch.randn(5, 1, 3, generator=gen)
    lse[1] = -math.inf
    out[1] = 0.0
    lse[3:] = -math.inf
    out[3:] = 0.0
    owner = torch.tensor([0, 0, 1, 2, 2])
    merged = serve_attention.merge_pieces(out, lse, owner, 3)
    merge = ops.get("merge_attention_states", "reference")
    first, _ = merge([out[0], out[1]], [lse[0], lse[1]])
    torch.testing.assert_close(merged[0], first)
    torch.testing.assert_close(merged[1], out[2])
    assert torch.equal(merged[2], torch.zeros_like(merged[2]))


@pytest.mark.parametrize(
    ("widths", "split"),
    [
        ([[100], [100], [100]], False),  # alike: one piece each would compute as many keys
        ([[20], [300], [30], [40]], True),  # ragged: 4 pieces, not 4 rows of 300 keys
        ([[128, 128]], False),  # one layer's tables, equal widths
    ],
)
def test_rows_are_split_only_when_that_saves_a_quarter_of_the_keys(widths, split):
    slot_rows = [torch.zeros(len(layer), max(layer), dtype=torch.int64) for layer in widths]
    padded_kernel = ops.get("paged_attention", "compiled")
    assert serve_attention._pieces_save(slot_rows, 128, padded_kernel) is split

    # A kernel whose cost follows the visible keys (the cpp backend's decode) is never cut.
    def skipping(*args, **kwargs):
        return padded_kernel(*args, **kwargs)

    skipping.skips_padding = True
    assert serve_attention._pieces_save(slot_rows, 128, skipping) is False
