"""Stateful test: one real ``BlockPool`` and several ``TokenTable``s against a plain Python model.

The model knows, per sequence, only what a user can see: the ordered list of live tokens
(logical index, position, exact K and V rows), how many blocks the sequence should own, how
many dead tokens still hold a slot (Naive-Evict), and how many mutations it has seen. Every rule
drives the real objects and the model the same way; the invariants check after every step that
the real objects agree with the model:

  I1  every live token reads back (``pool.read``) its exact K/V, in logical order, with its
      original position;
  I2  ``TokenTable.check_invariants()`` (one live token per slot, one slot per live token);
  P1  no block is leaked or owned twice: the tables' blocks and the pool's free list partition
      ``range(num_blocks)``, reference count 1 for an owned block and 0 for a free one;
  P2  an append the pool cannot hold raises ``PoolExhausted`` and changes nothing;
  I4  a repack leaves exactly ceil(live / block_size) blocks (strictly fewer than before), and a
      plan built before a later mutation is refused with ``InvalidArgumentError``, changing
      nothing.

Following hypothesis's stateful-testing guide, every argument of a step is a plain value
(K/V rows come from a seed), so a shrunk failure prints as a program that replays it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import assume, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvstack import ops
from kvstack.errors import (
    DeadTokenError,
    DoubleFreeError,
    InvalidArgumentError,
    PoolExhausted,
    SlotOutOfRangeError,
)
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.repack import (
    DEFAULT_WASTE_THRESHOLD,
    RepackPlan,
    execute_repack,
    plan_repack,
)
from kvstack.reference.token_table import TokenTable

NUM_BLOCKS = 24
NUM_KV_HEADS = 2
HEAD_DIM = 4
MAX_SEQUENCES = 4
# Every copy_slots that takes CPU tensors, the reference first: the C++ one too where it
# builds (and it must, given a compiler: spec_tests/test_cpp_kernels.py).
COPY_BACKENDS = ops.operations()["copy_slots"].backends("cpu")[::-1]


# ----------------------------------------------------------------------------- the model
@dataclass
class ModelToken:
    index: int  # logical index: the how-many-th token the sequence appended
    position: int
    key: torch.Tensor  # [H_kv, D]
    value: torch.Tensor


@dataclass
class ModelSequence:
    live: list[ModelToken] = field(default_factory=list)  # in logical order
    appended: int = 0  # logical tokens ever appended (live or dead)
    next_position: int = 0
    blocks: int = 0  # blocks the sequence owns
    held: int = 0  # dead tokens that keep their slot (Naive-Evict) until a repack
    mutations: int = 0  # successful mutations; a plan is valid only for the count it saw

    def free_slots(self, block_size: int) -> int:
        return self.blocks * block_size - len(self.live) - self.held


@dataclass(frozen=True)
class PendingPlan:
    """A plan kept for later, with the number of mutations its sequence had when it was built."""

    sequence: int
    plan: RepackPlan
    mutations: int

    def __repr__(self) -> str:
        return f"PendingPlan(sequence={self.sequence}, mutations={self.mutations})"


def kv_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n random K and V rows [n, H_kv, D], reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    key = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=generator)
    return key, value


def snapshot(pool: BlockPool, tables: list[TokenTable]) -> tuple:
    """Everything a rejected call must leave unchanged."""
    return (
        pool.key.clone(),
        pool.value.clone(),
        list(pool.free_blocks),
        list(pool.ref_counts),
        [
            (
                t.slots.clone(),
                t.alive.clone(),
                t.positions.clone(),
                list(t.blocks),
                list(t.free_slots),
                t.version,
            )
            for t in tables
        ],
    )


def assert_same_snapshot(before: tuple, after: tuple) -> None:
    key, value, free, refs, tables = before
    key2, value2, free2, refs2, tables2 = after
    assert torch.equal(key, key2), "pool.key changed"
    assert torch.equal(value, value2), "pool.value changed"
    assert free == free2, "pool free list changed"
    assert refs == refs2, "pool reference counts changed"
    assert len(tables) == len(tables2)
    for i, (a, b) in enumerate(zip(tables, tables2, strict=True)):
        for name, x, y in zip(
            ("slots", "alive", "positions", "blocks", "free_slots", "version"), a, b, strict=True
        ):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"table {i}: {name} changed from {x} to {y}"


# ----------------------------------------------------------------------------- the machine
class PoolMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")
    plans = Bundle("plans")

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.tables: list[TokenTable] = []
        self.model: list[ModelSequence] = []

    @initialize(
        target=sequences,
        block_size=st.integers(1, 8),
        prompts=st.lists(st.integers(0, 40), min_size=1, max_size=2),
        seed=st.integers(0, 2**16),
    )
    def make_pool(self, block_size: int, prompts: list[int], seed: int):
        """The pool, and one sequence per prompt length, prefilled with that many tokens, so
        that eviction and repacking have something to work on from the first step."""
        self.block_size = block_size
        self.pool = BlockPool(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_DIM)
        sequences = [self.create_sequence() for _ in prompts]
        for sequence, n in zip(sequences, prompts, strict=True):
            if n:
                self.append(sequence, n, seed + sequence, None)
        return multiple(*sequences)

    def _snapshot(self) -> tuple:
        return snapshot(self.pool, self.tables)

    def _model_free_blocks(self) -> int:
        return NUM_BLOCKS - sum(m.blocks for m in self.model)

    # ------------------------------------------------------------------------- rules
    @precondition(lambda self: len(self.tables) < MAX_SEQUENCES)
    @rule(target=sequences)
    def create_sequence(self) -> int:
        self.tables.append(TokenTable(self.block_size))
        self.model.append(ModelSequence())
        return len(self.tables) - 1

    @rule(
        sequence=sequences,
        n=st.integers(1, 20),
        seed=st.integers(0, 2**16),
        start=st.none() | st.integers(0, 100),
    )
    def append(self, sequence: int, n: int, seed: int, start: int | None) -> None:
        """Append n tokens; ``start`` None means default positions, else explicit ones."""
        table, m = self.tables[sequence], self.model[sequence]
        key, value = kv_rows(n, seed)
        first = m.next_position if start is None else start
        positions = None if start is None else torch.arange(start, start + n)
        new_blocks = math.ceil(max(0, n - m.free_slots(self.block_size)) / self.block_size)

        if new_blocks > self._model_free_blocks():
            before = self._snapshot()
            try:
                table.append(self.pool, key, value, positions)
            except PoolExhausted as error:
                assert f"asked for {new_blocks} blocks" in str(error), str(error)
            else:
                raise AssertionError(
                    f"append of {n} tokens needing {new_blocks} blocks did not raise"
                )
            assert_same_snapshot(before, self._snapshot())  # P2
            event("append: pool exhausted")
            return

        slots = table.append(self.pool, key, value, positions)
        assert slots.shape == (n,)
        for i in range(n):
            m.live.append(ModelToken(m.appended + i, first + i, key[i], value[i]))
        m.appended += n
        m.next_position = first + n
        m.blocks += new_blocks
        m.mutations += 1
        event(
            "append: reused free slots"
            if n > new_blocks * self.block_size
            else "append: fresh blocks only"
        )

    def _choose_live(self, m: ModelSequence, picks: list[int]) -> list[int]:
        chosen: list[int] = []
        for pick in picks:
            index = m.live[pick % len(m.live)].index
            if index not in chosen:
                chosen.append(index)
        return chosen

    def _evict(self, sequence: int, picks: list[int], release: bool) -> None:
        table, m = self.tables[sequence], self.model[sequence]
        if not m.live:
            return  # nothing to evict; bad eviction requests have their own rule
        chosen = self._choose_live(m, picks)
        table.evict(chosen, release=release)
        m.live = [t for t in m.live if t.index not in chosen]
        if not release:
            m.held += len(chosen)
        m.mutations += 1

    @rule(
        sequence=sequences,
        picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=16),
        then_repack=st.sampled_from([None, *COPY_BACKENDS]),
    )
    def evict(self, sequence: int, picks: list[int], then_repack: str | None) -> None:
        """Evict and release: the slots go back to the table's free slots. With ``then_repack``
        the step ends as vToken's does: repack (with that copy backend) if F > theta."""
        self._evict(sequence, picks, release=True)
        if then_repack is not None:
            self._repack(sequence, force=False, backend=then_repack)

    @rule(sequence=sequences, picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=16))
    def naive_evict(self, sequence: int, picks: list[int]) -> None:
        """Naive-Evict: the tokens stop being read but keep their slots until a repack."""
        self._evict(sequence, picks, release=False)

    @rule(
        sequence=sequences,
        kind=st.sampled_from(["dead", "unknown", "negative", "duplicate"]),
        pick=st.integers(0, 10_000),
        release=st.booleans(),
    )
    def evict_bad_index(self, sequence: int, kind: str, pick: int, release: bool) -> None:
        """Naming a dead, unknown or repeated token is refused and changes nothing."""
        table, m = self.tables[sequence], self.model[sequence]
        live = {t.index for t in m.live}
        if kind == "dead":
            dead = sorted(set(range(m.appended)) - live)
            assume(dead)  # a step with no dead token to name is not this rule's case
            indices, error = [dead[pick % len(dead)]], DeadTokenError
        elif kind == "unknown":
            indices, error = [m.appended + pick % 3], SlotOutOfRangeError
        elif kind == "negative":
            indices, error = [-1 - pick % 3], SlotOutOfRangeError
        else:
            assume(m.live)
            index = m.live[pick % len(m.live)].index
            indices, error = [index, index], InvalidArgumentError
        before = self._snapshot()
        try:
            table.evict(indices, release=release)
        except error as raised:
            assert "indices" in str(raised), str(raised)
        else:
            raise AssertionError(f"evict({indices}) did not raise {error.__name__}")
        assert_same_snapshot(before, self._snapshot())
        event(f"evict refused: {kind}")

    def _execute(self, sequence: int, plan: RepackPlan, backend: str) -> None:
        table, m = self.tables[sequence], self.model[sequence]
        blocks_before = len(table.blocks)
        copy = ops.get("copy_slots", backend)
        execute_repack(table, self.pool, plan, copy=copy)
        # The repack itself is a mutation: the same plan a second time is stale (I4).
        before = self._snapshot()
        try:
            execute_repack(table, self.pool, plan, copy=copy)
        except InvalidArgumentError as error:
            assert "version" in str(error), str(error)
        else:
            raise AssertionError("a plan was executed twice")
        assert_same_snapshot(before, self._snapshot())
        needed = math.ceil(len(m.live) / self.block_size)
        # I4: live tokens end in exactly ceil(live / block_size) blocks, strictly fewer than before.
        shrunk = f"{blocks_before} -> {len(table.blocks)} blocks for {len(m.live)} live tokens"
        assert len(table.blocks) == needed < blocks_before, shrunk
        m.blocks = needed
        event(f"repack executed ({backend}, {'with' if m.held else 'no'} Naive-Evicted slots)")
        m.held = 0  # a repack reclaims the slots of Naive-Evicted tokens too
        m.mutations += 1

    @rule(
        sequence=sequences,
        force=st.booleans(),
        backend=st.sampled_from(COPY_BACKENDS),
    )
    def repack(self, sequence: int, force: bool, backend: str) -> None:
        self._repack(sequence, force, backend)

    def _repack(self, sequence: int, force: bool, backend: str) -> None:
        table, m = self.tables[sequence], self.model[sequence]
        needed = math.ceil(len(m.live) / self.block_size)
        waste = 1.0 - len(m.live) / (m.blocks * self.block_size) if m.blocks else 0.0
        expect_plan = needed < m.blocks and (force or waste > DEFAULT_WASTE_THRESHOLD)
        plan = plan_repack(table, force=force)
        assert (plan is not None) == expect_plan, (plan, needed, m.blocks, waste, force)
        if plan is not None:
            self._execute(sequence, plan, backend)
        else:
            event("repack: no plan")

    @rule(target=plans, sequence=sequences)
    def build_plan(self, sequence: int):
        """Build a plan now and keep it; a later rule executes it, fresh or stale."""
        before = self._snapshot()
        plan = plan_repack(self.tables[sequence], force=True)
        assert_same_snapshot(before, self._snapshot())  # planning never mutates
        if plan is None:
            return multiple()
        return PendingPlan(sequence, plan, self.model[sequence].mutations)

    @rule(pending=consumes(plans), backend=st.sampled_from(COPY_BACKENDS))
    def execute_plan(self, pending: PendingPlan, backend: str) -> None:
        m = self.model[pending.sequence]
        if pending.mutations == m.mutations:
            self._execute(pending.sequence, pending.plan, backend)
            return
        # I4: the table changed since the plan's snapshot, so the plan must be refused.
        before = self._snapshot()
        try:
            execute_repack(
                self.tables[pending.sequence],
                self.pool,
                pending.plan,
                copy=ops.get("copy_slots", backend),
            )
        except InvalidArgumentError as error:
            assert "version" in str(error), str(error)
        else:
            raise AssertionError("a stale plan was executed")
        assert_same_snapshot(before, self._snapshot())
        event("stale plan refused")

    @precondition(lambda self: len(self.tables) < MAX_SEQUENCES)
    @rule(target=sequences, source=sequences)
    def fork(self, source: int):
        """fork: a new sequence with the source's logical tokens, its live rows copied into new
        blocks (beam search); PoolExhausted when they do not fit, and then nothing changed."""
        m = self.model[source]
        needed = math.ceil(len(m.live) / self.block_size)
        if needed > self.pool.num_free_blocks:
            before = self._snapshot()
            try:
                self.tables[source].fork(self.pool)
            except PoolExhausted:
                pass
            else:
                raise AssertionError("fork past the pool's capacity did not raise PoolExhausted")
            assert_same_snapshot(before, self._snapshot())
            return multiple()
        self.tables.append(self.tables[source].fork(self.pool))
        event("fork")
        self.model.append(
            ModelSequence(
                live=list(m.live), appended=m.appended, next_position=m.next_position, blocks=needed
            )
        )
        return len(self.tables) - 1

    # Hypothesis draws rules with few arguments most often (this one came first by far); gate it
    # so that it does not keep emptying the pool before evictions and repacks get a turn.
    @precondition(lambda self: self.pool.num_free_blocks < NUM_BLOCKS // 2)
    @rule(sequence=sequences)
    def free_sequence(self, sequence: int) -> None:
        """release_all: every block back to the pool; the empty table stays usable."""
        self.tables[sequence].release_all(self.pool)
        old = self.model[sequence]
        self.model[sequence] = ModelSequence(mutations=old.mutations + 1)

    @rule(
        kind=st.sampled_from(["exhaust", "double_free", "out_of_range"]),
        pick=st.integers(0, 10_000),
    )
    def bad_pool_call(self, kind: str, pick: int) -> None:
        """P2/P3 at the pool itself: asking for one block too many, freeing a free block, or
        naming a block outside the pool raises and changes nothing."""
        if kind == "exhaust":
            call, error = (
                lambda: self.pool.allocate(self.pool.num_free_blocks + 1 + pick % 3),
                PoolExhausted,
            )
        elif kind == "double_free":
            assume(self.pool.free_blocks)
            block = self.pool.free_blocks[pick % self.pool.num_free_blocks]
            call, error = lambda: self.pool.free([block]), DoubleFreeError
        else:
            block = NUM_BLOCKS + pick % 3 if pick % 2 else -1 - pick % 3
            call, error = lambda: self.pool.free([block]), SlotOutOfRangeError
        before = self._snapshot()
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"{kind} did not raise {error.__name__}")
        assert_same_snapshot(before, self._snapshot())
        event(f"pool refused: {kind}")

    @rule(sequence=sequences, pick=st.integers(0, 10_000))
    def share_then_free(self, sequence: int, pick: int) -> None:
        """A second owner (prefix sharing) raises the count; its free returns it, and the block
        stays with the table."""
        blocks = self.tables[sequence].blocks
        assume(blocks)
        block = blocks[pick % len(blocks)]
        self.pool.share(block)
        assert self.pool.ref_counts[block] == 2
        self.pool.free([block])
        assert self.pool.ref_counts[block] == 1 and block not in self.pool.free_blocks
        # Naming it twice now (one owner) is a double free, refused before anything changes.
        before = self._snapshot()
        try:
            self.pool.free([block, block])
        except DoubleFreeError:
            pass
        else:
            raise AssertionError(f"block {block} freed twice with one owner")
        assert_same_snapshot(before, self._snapshot())

    # ------------------------------------------------------------------------- invariants
    @invariant()
    def live_tokens_read_back(self) -> None:
        """I1: live K/V, logical order and positions are exactly the model's."""
        for i, (table, m) in enumerate(zip(self.tables, self.model, strict=True)):
            assert table.live_indices().tolist() == [t.index for t in m.live], f"sequence {i}"
            assert table.live_positions().tolist() == [t.position for t in m.live], f"sequence {i}"
            assert table.num_tokens == m.appended
            key, value = self.pool.read(table.live_slots())
            rows = (0, NUM_KV_HEADS, HEAD_DIM)
            want_key = torch.stack([t.key for t in m.live]) if m.live else torch.empty(rows)
            want_value = torch.stack([t.value for t in m.live]) if m.live else torch.empty(rows)
            assert torch.equal(key, want_key), f"sequence {i}: K rows differ"
            assert torch.equal(value, want_value), f"sequence {i}: V rows differ"

    @invariant()
    def tables_consistent(self) -> None:
        """I2, and each table owns and occupies what the model says."""
        for i, (table, m) in enumerate(zip(self.tables, self.model, strict=True)):
            table.check_invariants()
            assert len(table.blocks) == m.blocks, f"sequence {i}: {table.blocks} vs {m.blocks}"
            assert int((table.slots >= 0).sum()) == len(m.live) + m.held, f"sequence {i}"
            assert len(table.free_slots) == m.free_slots(self.block_size), f"sequence {i}"

    @invariant()
    def blocks_accounted_for(self) -> None:
        """P1: owned blocks and the free list partition the pool; reference counts match."""
        owned = [b for table in self.tables for b in table.blocks]
        free = list(self.pool.free_blocks)
        assert sorted(owned + free) == list(range(NUM_BLOCKS)), (owned, free)
        assert all(self.pool.ref_counts[b] == 1 for b in owned), self.pool.ref_counts
        assert all(self.pool.ref_counts[b] == 0 for b in free), self.pool.ref_counts
        assert self.pool.num_free_blocks == self._model_free_blocks()


# The active hypothesis profile (ci / dev / thorough) supplies max_examples and the rest.
PoolMachine.TestCase.settings = settings(stateful_step_count=30)
TestPoolStateMachine = PoolMachine.TestCase
