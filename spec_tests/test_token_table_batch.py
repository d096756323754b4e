"""``TokenTableBatch`` (compiled/) is N reference ``TokenTable``s (reference/), exactly.

Both are driven through the same random operation sequence — appends of a few tokens to every
table, per-table evictions with and without release, a repack of one table (the batch's own
``repack``, or the reference's through ``table``/``set_table``) — each against its own pool that starts from the same shuffled free
list. After every operation the batch must hold what the reference tables hold: the same slot
for every logical token, the same liveness, blocks and sorted free slots, the same K/V bytes at
every live slot, the same pool free list, and an attention view that lists each table's live
slots in logical order.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from kvstack.compiled.token_tables import TokenTableBatch
from kvstack.errors import DeadTokenError, DoubleFreeError, InvalidArgumentError, PoolExhausted
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.repack import execute_repack, plan_repack
from kvstack.reference.token_table import TokenTable

HEADS, DIM = 2, 3


def make_pool(num_blocks: int, block_size: int, order: list[int]) -> BlockPool:
    pool = BlockPool(num_blocks, block_size, HEADS, DIM)
    pool.free_blocks.clear()
    pool.free_blocks.extend(order)  # the same shuffled free list for both pools
    return pool


def assert_same(batch: TokenTableBatch, batch_pool, tables, table_pool) -> None:
    assert list(batch_pool.free_blocks) == list(table_pool.free_blocks)
    for index, table in enumerate(tables):
        mine = batch.table(index)
        assert torch.equal(mine.slots, table.slots), index
        assert torch.equal(mine.alive, table.alive), index
        assert mine.blocks == table.blocks and mine.free_slots == table.free_slots, index
        assert batch.num_live[index] == table.num_live
        key, value = batch_pool.read(table.live_slots())
        ref_key, ref_value = table_pool.read(table.live_slots())
        assert torch.equal(key, ref_key) and torch.equal(value, ref_value)
        mine.check_invariants()
    indices, slots = batch.live_view()
    for index, table in enumerate(tables):
        live = table.num_live
        assert indices[index, :live].tolist() == table.live_indices().tolist()
        assert slots[index, :live].tolist() == table.live_slots().tolist()
        assert (slots[index, live:] == -1).all()


@given(data=st.data())
def test_batch_follows_the_reference_tables_through_random_operations(data):
    num_tables = data.draw(st.integers(1, 4), label="num_tables")
    block_size = data.draw(st.sampled_from([1, 2, 4, 8]), label="block_size")
    num_blocks = data.draw(st.sampled_from([8, 64]), label="num_blocks")  # 8: appends run out
    order = data.draw(st.permutations(range(num_blocks)), label="free_list")
    batch_pool, table_pool = (
        make_pool(num_blocks, block_size, order),
        make_pool(num_blocks, block_size, order),
    )
    batch = TokenTableBatch(num_tables, block_size)
    tables = [TokenTable(block_size) for _ in range(num_tables)]
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))

    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        op = data.draw(
            st.sampled_from(
                ["append", "append", "evict", "evict_one_each", "repack", "repack_table"]
            ),
            label="op",
        )
        if op == "append":
            n = data.draw(st.integers(0, 5), label="n")
            key = torch.randn(num_tables, n, HEADS, DIM, generator=gen)
            value = torch.randn(num_tables, n, HEADS, DIM, generator=gen)
            # The reference's need: each table fills its released slots first, then new blocks.
            needed = sum(math.ceil(max(0, n - len(t.free_slots)) / block_size) for t in tables)
            assert batch.blocks_needed(n) == needed
            if table_pool.can_allocate(needed):
                for index, table in enumerate(tables):
                    table.append(table_pool, key[index], value[index])
                batch.append(batch_pool, key, value)
            else:  # all tables or none: refused, and assert_same below sees the batch unchanged
                with pytest.raises(PoolExhausted):
                    batch.append(batch_pool, key, value)
                event("append refused: pool exhausted")
        elif op == "evict":
            release = data.draw(st.booleans(), label="release")
            victims = torch.zeros(num_tables, batch.num_tokens, dtype=torch.bool)
            for index, table in enumerate(tables):
                live = table.live_indices().tolist()
                chosen = sorted(
                    data.draw(st.sets(st.sampled_from(live)) if live else st.just(set()))
                )
                victims[index, chosen] = True
                table.evict(chosen, release=release)
            batch.evict(victims, release=release)
        elif op == "evict_one_each":  # a decode step's eviction: one token from every table
            release = data.draw(st.booleans(), label="release")
            if min(table.num_live for table in tables) > 0:
                chosen = [data.draw(st.sampled_from(t.live_indices().tolist())) for t in tables]
                for table, index in zip(tables, chosen, strict=True):
                    table.evict([index], release=release)
                batch.evict_one_each(torch.tensor(chosen), release=release)
            else:  # a table with no live token: refused, and assert_same sees nothing changed
                any_index = st.integers(0, max(0, batch.num_tokens - 1))
                chosen = [
                    data.draw(
                        st.sampled_from(t.live_indices().tolist()) if t.num_live else any_index
                    )
                    for t in tables
                ]
                # Index 0 of no token is out of range; any index of a table with none live is dead.
                error = DeadTokenError if batch.num_tokens else InvalidArgumentError
                with pytest.raises(error):
                    batch.evict_one_each(torch.tensor(chosen), release=release)
                event(f"evict_one_each refused: {error.__name__}")
        elif op == "repack":  # the batch's own repack against the reference plan and execution
            index = data.draw(st.integers(0, num_tables - 1), label="table")
            threshold = data.draw(st.sampled_from([0.0, 0.25, 0.9]), label="threshold")
            force = data.draw(st.booleans(), label="force")
            plan = plan_repack(tables[index], threshold=threshold, force=force)
            if plan is not None:
                execute_repack(tables[index], table_pool, plan)
            repacked = batch.repack(index, batch_pool, threshold=threshold, force=force)
            assert repacked == (plan is not None)
            event(f"repack: {'done' if repacked else 'declined'}")
        else:  # through a reference table and back (table / set_table)
            index = data.draw(st.integers(0, num_tables - 1), label="table")
            plan = plan_repack(tables[index], force=True)
            if plan is not None:
                execute_repack(tables[index], table_pool, plan)
                mine = batch.table(index)
                execute_repack(mine, batch_pool, plan_repack(mine, force=True))
                batch.set_table(index, mine)
        assert_same(batch, batch_pool, tables, table_pool)


def test_bad_input_names_the_argument_and_changes_nothing():
    pool = BlockPool(4, 2, HEADS, DIM)
    batch = TokenTableBatch(2, 2)
    batch.append(pool, torch.zeros(2, 3, HEADS, DIM), torch.zeros(2, 3, HEADS, DIM))
    before = (batch.slots.clone(), batch.alive.clone(), list(pool.free_blocks))

    with pytest.raises(InvalidArgumentError, match="key"):
        batch.append(pool, torch.zeros(3, 1, HEADS, DIM), torch.zeros(3, 1, HEADS, DIM))
    with pytest.raises(PoolExhausted):  # 2 tables x 2 new blocks, but 0 free
        batch.append(pool, torch.zeros(2, 4, HEADS, DIM), torch.zeros(2, 4, HEADS, DIM))
    with pytest.raises(InvalidArgumentError, match="victims"):
        batch.evict(torch.zeros(2, 2, dtype=torch.bool))
    victims = torch.zeros(2, 3, dtype=torch.bool)
    victims[0, 1] = True
    batch.evict(victims)
    with pytest.raises(DeadTokenError, match=r"\(0, 1\)"):
        batch.evict(victims)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        batch.append(
            BlockPool(4, 4, HEADS, DIM),
            torch.zeros(2, 1, HEADS, DIM),
            torch.zeros(2, 1, HEADS, DIM),
        )

    after_evict = before[1].clone()
    after_evict[0, 1] = False
    assert torch.equal(batch.alive, after_evict)
    assert list(pool.free_blocks) == before[2]

    # Table 0 holds 2 live tokens in 2 blocks of 2: a forced repack could free one.
    slots, free_slots = batch.slots.clone(), [list(free) for free in batch.free_slots]
    with pytest.raises(InvalidArgumentError, match="index"):
        batch.repack(2, pool, force=True)
    with pytest.raises(InvalidArgumentError, match="threshold"):
        batch.repack(0, pool, threshold=1.0, force=True)
    with pytest.raises(DoubleFreeError, match="the table's blocks"):
        batch.repack(0, BlockPool(4, 2, HEADS, DIM), force=True)  # its blocks are not this pool's
    assert torch.equal(batch.slots, slots) and batch.free_slots == free_slots
    assert torch.equal(batch.alive, after_evict) and list(pool.free_blocks) == before[2]
    assert batch.repack(0, pool, force=True) and len(pool.free_blocks) == len(before[2]) + 1


# first_release=False then release=True is the case hypothesis found: a Naive-Evict leaves the
# dead token its slot, and a releasing eviction of it must still be refused.
@pytest.mark.parametrize("first_release", [True, False])
@pytest.mark.parametrize("release", [True, False])
def test_evict_one_each_refuses_dead_or_missing_tokens_and_changes_nothing(first_release, release):
    pool = BlockPool(8, 2, HEADS, DIM)
    batch = TokenTableBatch(2, 2)
    batch.append(pool, torch.zeros(2, 3, HEADS, DIM), torch.zeros(2, 3, HEADS, DIM))
    batch.evict_one_each(torch.tensor([1, 2]), release=first_release)
    before = (batch.slots.clone(), batch.alive.clone(), batch.num_live.copy())
    before += ([list(free) for free in batch.free_slots],)
    with pytest.raises(DeadTokenError, match=r"tables \[0\]"):
        batch.evict_one_each(torch.tensor([1, 0]), release=release)  # table 0's token 1 is dead
    with pytest.raises(InvalidArgumentError, match=r"indices must be logical indices in \[0, 3\)"):
        batch.evict_one_each(torch.tensor([0, 3]), release=release)
    with pytest.raises(InvalidArgumentError, match="indices"):
        batch.evict_one_each(torch.tensor([0]), release=release)  # one index per table
    after = (batch.slots, batch.alive, batch.num_live, [list(free) for free in batch.free_slots])
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1])
    assert after[2:] == before[2:]
