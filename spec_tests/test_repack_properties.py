"""Properties of the repack planner and executor (vToken I1, I4; waste F and threshold theta).

Each case is a table built from plain values (block size, append chunks, one fate per token,
a seed), so a failing case prints as a constructor call that rebuilds it. Tokens are appended
chunk by chunk and each chunk's evictions happen before the next chunk, so later appends refill
released slots and the live tokens end up scattered over the blocks, as in a serving run; the
pool's free list is shuffled first, so block ids are not in order either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, event, example, given
from hypothesis import strategies as st

from kvstack import ops
from kvstack.errors import InvalidArgumentError
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.repack import (
    DEFAULT_WASTE_THRESHOLD,
    execute_repack,
    plan_repack,
)
from kvstack.reference.token_table import TokenTable

NUM_KV_HEADS = 2
HEAD_DIM = 4
# Every copy_slots that takes CPU tensors, the reference first: the C++ one too where it
# builds (and it must, given a compiler: spec_tests/test_cpp_kernels.py).
COPY_BACKENDS = ops.operations()["copy_slots"].backends("cpu")[::-1]

LIVE, EVICT, NAIVE = "L", "E", "N"  # a token's fate: stays live, evicted, Naive-Evicted


@dataclass(frozen=True)
class RepackCase:
    block_size: int
    chunks: tuple[int, ...]  # tokens per append
    fates: str  # one of L / E / N per token, in logical order
    seed: int

    def build(self) -> tuple[BlockPool, TokenTable]:
        bs = self.block_size
        # Enough blocks for every append even if no slot were ever reused, plus one spare.
        num_blocks = sum(math.ceil(n / bs) for n in self.chunks) + 1
        pool = BlockPool(num_blocks, bs, NUM_KV_HEADS, HEAD_DIM)
        generator = torch.Generator().manual_seed(self.seed)
        order = torch.randperm(num_blocks, generator=generator).tolist()
        taken = pool.allocate(num_blocks)
        pool.free([taken[i] for i in order])  # shuffle the free list
        table = TokenTable(bs)
        start = 0
        for n in self.chunks:
            key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator)
            value = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator)
            table.append(pool, key, value)
            chunk = range(start, start + n)
            table.evict([i for i in chunk if self.fates[i] == EVICT], release=True)
            table.evict([i for i in chunk if self.fates[i] == NAIVE], release=False)
            start += n
        return pool, table

    @property
    def num_live(self) -> int:
        return self.fates.count(LIVE)


@st.composite
def repack_cases(draw, max_chunk: int = 96) -> RepackCase:
    block_size = draw(st.integers(1, 64))
    chunks = draw(st.lists(st.integers(1, max_chunk), min_size=0, max_size=4))
    # Bias towards many evictions now and then, so that whole blocks can be freed.
    evict_weight = draw(st.sampled_from([0, 1, 3, 9]))
    fate = st.sampled_from(
        [LIVE] * 3 + [EVICT] * evict_weight + [NAIVE] * max(1, evict_weight // 3)
    )
    fates = draw(st.lists(fate, min_size=sum(chunks), max_size=sum(chunks)))
    return RepackCase(block_size, tuple(chunks), "".join(fates), draw(st.integers(0, 2**31 - 1)))


def table_state(table: TokenTable) -> tuple:
    return (
        table.slots.clone(),
        table.alive.clone(),
        table.positions.clone(),
        list(table.blocks),
        list(table.free_slots),
        table.version,
    )


def assert_table_state(table: TokenTable, state: tuple) -> None:
    slots, alive, positions, blocks, free_slots, version = state
    assert torch.equal(table.slots, slots)
    assert torch.equal(table.alive, alive)
    assert torch.equal(table.positions, positions)
    assert table.blocks == blocks
    assert table.free_slots == free_slots
    assert table.version == version


def live_per_block(table: TokenTable) -> dict[int, int]:
    counts = {block: 0 for block in table.blocks}
    for slot in table.live_slots().tolist():
        counts[slot // table.block_size] += 1
    return counts


# Every token dead (some Naive-Evicted): the plan keeps no block at all.
ALL_DEAD = RepackCase(block_size=4, chunks=(5, 3), fates="EENEENNE", seed=0)
# Naive-Evicted tokens in a kept block: their slots become destinations.
NAIVE_IN_KEPT = RepackCase(block_size=3, chunks=(6, 3), fates="LNLENLEEL", seed=1)


# ----------------------------------------------------------------------------- the planner
@given(case=repack_cases())
@example(case=ALL_DEAD)
@example(case=NAIVE_IN_KEPT)
def test_plan_moves_only_live_tokens_into_free_slots_of_kept_blocks(case: RepackCase) -> None:
    pool, table = case.build()
    bs = table.block_size
    before = table_state(table)
    plan = plan_repack(table, force=True)
    assert_table_state(table, before)  # planning reads one snapshot and changes nothing

    needed = math.ceil(case.num_live / bs)
    assert table.num_live == case.num_live
    if needed >= len(table.blocks):
        assert plan is None, "a plan must strictly reduce the block count (I4)"
        event("no whole block can be freed")
        return
    event("plan frees all blocks" if needed == 0 else "plan keeps some blocks")
    assert plan is not None
    assert plan.table_version == table.version

    kept, freed = list(plan.kept_blocks), list(plan.freed_blocks)
    assert sorted(kept + freed) == sorted(table.blocks), "kept and freed must partition the blocks"
    assert len(kept) == needed, "live tokens end in exactly ceil(live / block_size) blocks (I4)"
    # Keeping the fullest blocks is what makes the number of moves minimal.
    counts = live_per_block(table)
    if kept and freed:
        assert min(counts[b] for b in kept) >= max(counts[b] for b in freed)

    moved = plan.moved_tokens.tolist()
    src, dst = plan.src_slots.tolist(), plan.dst_slots.tolist()
    assert len(moved) == len(src) == len(dst)
    live_slots = dict(zip(table.live_indices().tolist(), table.live_slots().tolist(), strict=True))
    in_freed = {i for i, slot in live_slots.items() if slot // bs in set(freed)}
    assert set(moved) == in_freed, "exactly the live tokens of freed blocks move"
    assert len(set(moved)) == len(moved)
    assert all(table.alive[i] for i in moved), "only live tokens move"
    assert src == [live_slots[i] for i in moved], "sources are where the tokens are now"
    assert all(s // bs in set(freed) for s in src), "sources lie only in freed blocks"
    assert len(set(dst)) == len(dst), "destinations are pairwise distinct"
    assert all(d // bs in set(kept) for d in dst), "destinations lie in kept blocks"
    assert not set(dst) & set(live_slots.values()), "a destination holds no live token"
    assert not set(src) & set(dst), "no slot is both read and written (I4)"


@given(case=repack_cases())
def test_waste_is_one_minus_mean_live_fraction_per_block(case: RepackCase) -> None:
    _, table = case.build()
    if not table.blocks:
        assert table.waste() == 0.0
        return
    counts = live_per_block(table)
    mean_live_fraction = sum(c / table.block_size for c in counts.values()) / len(counts)
    assert table.waste() == pytest.approx(1.0 - mean_live_fraction, abs=1e-12)
    assert table.waste() == 1.0 - case.num_live / (len(table.blocks) * table.block_size)


@given(case=repack_cases(), threshold=st.floats(0.0, 1.0, exclude_max=True))
def test_threshold_gates_the_plan_unless_forced(case: RepackCase, threshold: float) -> None:
    _, table = case.build()
    freeable = math.ceil(table.num_live / table.block_size) < len(table.blocks)
    gated = plan_repack(table, threshold=threshold)
    assert (gated is not None) == (freeable and table.waste() > threshold)
    assert (plan_repack(table, threshold=threshold, force=True) is not None) == freeable
    default = plan_repack(table)
    assert (default is not None) == (freeable and table.waste() > DEFAULT_WASTE_THRESHOLD)
    if gated is not None:  # the threshold decides whether to plan, never what the plan is
        forced = plan_repack(table, threshold=threshold, force=True)
        assert gated.kept_blocks == forced.kept_blocks
        assert torch.equal(gated.dst_slots, forced.dst_slots)


def test_waste_exactly_at_threshold_does_not_repack() -> None:
    # block_size 1, four blocks, three live: F = 0.25 exactly, and one block could be freed.
    pool = BlockPool(4, 1, NUM_KV_HEADS, HEAD_DIM)
    table = TokenTable(1)
    rows = torch.zeros(4, NUM_KV_HEADS, HEAD_DIM)
    table.append(pool, rows, rows)
    table.evict([1])
    assert table.waste() == DEFAULT_WASTE_THRESHOLD
    assert plan_repack(table) is None, "repack only when F > theta, not F == theta"
    assert plan_repack(table, force=True) is not None


@pytest.mark.parametrize("threshold", [-0.1, 1.0, 1.5, float("nan")])
def test_threshold_outside_unit_interval_is_refused(threshold: float) -> None:
    pool = BlockPool(2, 2, NUM_KV_HEADS, HEAD_DIM)
    table = TokenTable(2)
    table.append(
        pool, torch.zeros(3, NUM_KV_HEADS, HEAD_DIM), torch.zeros(3, NUM_KV_HEADS, HEAD_DIM)
    )
    before = table_state(table)
    with pytest.raises(InvalidArgumentError, match="threshold"):
        plan_repack(table, threshold=threshold)
    assert_table_state(table, before)


# ----------------------------------------------------------------------------- the executor
@given(case=repack_cases(), backend=st.sampled_from(COPY_BACKENDS))
@example(case=ALL_DEAD, backend="reference")
@example(case=NAIVE_IN_KEPT, backend="compiled")
def test_execute_keeps_order_positions_and_bytes(case: RepackCase, backend: str) -> None:
    pool, table = case.build()
    plan = plan_repack(table, force=True)
    assume(plan is not None)  # force=True plans whenever a block can be freed
    event(f"executed with {backend}")
    indices, positions = table.live_indices().clone(), table.live_positions().clone()
    key, value = pool.read(table.live_slots())
    key_before, value_before = pool.key.clone(), pool.value.clone()
    blocks_before, version_before = len(table.blocks), table.version
    naive_dead = int(((~table.alive) & (table.slots >= 0)).sum())

    execute_repack(table, pool, plan, copy=ops.get("copy_slots", backend))

    # I1: same live tokens, same logical order, same positions, same K/V bytes.
    assert torch.equal(table.live_indices(), indices)
    assert torch.equal(table.live_positions(), positions)
    key_after, value_after = pool.read(table.live_slots())
    assert torch.equal(key_after, key) and torch.equal(value_after, value)
    # The copy wrote only the destinations.
    untouched = torch.ones(pool.num_slots, dtype=torch.bool)
    untouched[plan.dst_slots] = False
    rows = (pool.num_slots, NUM_KV_HEADS, HEAD_DIM)
    assert torch.equal(pool.key.view(rows)[untouched], key_before.view(rows)[untouched])
    assert torch.equal(pool.value.view(rows)[untouched], value_before.view(rows)[untouched])
    # I4: exactly ceil(live / block_size) blocks remain, strictly fewer; the rest are free.
    assert sorted(table.blocks) == sorted(plan.kept_blocks)
    assert len(table.blocks) == math.ceil(case.num_live / case.block_size) < blocks_before
    assert all(pool.ref_counts[b] == 0 and b in pool.free_blocks for b in plan.freed_blocks)
    assert all(pool.ref_counts[b] == 1 for b in table.blocks)
    # Dead tokens no longer hold slots (Naive-Evict memory is reclaimed by the repack).
    assert bool((table.slots[~table.alive] == -1).all()), f"{naive_dead} Naive-Evicted slots kept"
    assert len(table.free_slots) == len(table.blocks) * case.block_size - case.num_live
    table.check_invariants()
    assert table.version > version_before
