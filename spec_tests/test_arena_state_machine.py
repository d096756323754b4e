"""Stateful test: several caches on ONE ``KVArena`` against a plain Python model.

A *cache* here is what ``kvstack.hf.paged`` builds: one or more KV layers, each an
``ArenaBlockPool`` of its own geometry with a ``TokenTableBatch`` that follows the pool's block
renames (``pool.listeners.append(batch.rename_blocks)``), plus hybrid *state owners* that take
``count`` contiguous "state" pages straight from the arena and implement ``pages_moved``. All
of them draw on the same arena, so one cache's allocation may compact the arena and move every
other cache's pages.

The model knows only what a user can see: per cache, per layer, per table, logical token ->
exact K and V rows and how many blocks the table owns; per state owner, its exact contents. The
invariants check after every step that

  A1/A2/A5  ``arena.check_invariants()``; bytes used per kind are the model's count, and every
            page of the arena belongs to a pool or state owner the model knows (nothing leaks);
  I1/I2     every table's ``check_invariants`` (materialised by ``batch.tables()``), and every
            live token read through its table is the model's K/V, byte for byte;
  A4        state contents are the model's and stay contiguous; owners hear of a move only after
            the bytes moved (the owners check it inside ``pages_moved``);
  A3        a request for more than the arena holds raises ``ArenaExhausted`` naming the bytes
            needed and the bytes free, and changes nothing (compared exactly, and against the
            model);
and, on a private arena (``KVArena.private``), that ``trim()`` keeps no whole segment of real
bytes (``arena.capacity_bytes``, the buffer's storage) above the compacted pages and the
reservations, and that real bytes fall after frees. Teardown releases everything: the arena is then empty.

Every argument of a step is a plain value (K/V rows come from a seed), so a shrunk failure
prints as a program that replays it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvstack import ops
from kvstack.arena import ArenaBlockPool, ArenaExhausted, KVArena
from kvstack.compiled.token_tables import TokenTableBatch
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD, execute_repack, plan_repack

HEAD_DIM = 4
# name -> (block_size, num_kv_heads): 32 and 384 elements per block (K and V), so the wide
# geometry's alignment leaves gaps the small one can fill, and compaction has work to do.
GEOMETRIES = {"narrow": (4, 1), "wide": (16, 3)}
FIXED_CAPACITY = 12_500  # bytes: 3125 float32 elements, not a multiple of any block size
SEGMENT_BYTES = 4096  # a private arena's growth step (1024 elements)
MAX_CACHES = 3
MAX_STATE_OWNERS = 4
PICK = st.integers(0, 10_000)


# ----------------------------------------------------------------------------- the model
@dataclass
class Layer:
    """One KV layer of a cache: the real pool and tables, and the model of what they hold."""

    name: str
    pool: ArenaBlockPool
    batch: TokenTableBatch
    live: list[dict[int, tuple[torch.Tensor, torch.Tensor]]]  # per table: index -> (K, V) [H, D]
    blocks: list[int]  # per table: blocks the model says it owns
    num_tokens: int = 0  # logical tokens per table

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def free_slots(self, table: int) -> int:
        return self.blocks[table] * self.block_size - len(self.live[table])

    def blocks_needed(self, n: int) -> int:
        return sum(
            math.ceil(max(0, n - self.free_slots(t)) / self.block_size)
            for t in range(len(self.live))
        )

    def check_reads_model(self) -> None:
        """I1/I2 for this layer: tables consistent, every live token's K/V exactly the model's,
        and the pool holds exactly the tables' blocks (one owner each)."""
        tables = self.batch.tables()
        owned = []
        for index, (table, live) in enumerate(zip(tables, self.live, strict=True)):
            table.check_invariants()
            where = f"{self.name} table {index}"
            assert table.num_tokens == self.num_tokens, where
            assert len(table.blocks) == self.blocks[index], (where, table.blocks, self.blocks)
            assert table.live_indices().tolist() == sorted(live), where
            key, value = self.pool.read(table.live_slots())
            empty = torch.empty(0, self.pool.num_kv_heads, HEAD_DIM)
            rows = [live[i] for i in sorted(live)]
            assert torch.equal(key, torch.stack([k for k, _ in rows]) if rows else empty), where
            assert torch.equal(value, torch.stack([v for _, v in rows]) if rows else empty), where
            owned += table.blocks
        assert sorted(owned) == sorted(self.pool.pages), (self.name, owned, self.pool.pages)
        assert all(count == 1 for count in self.pool.ref_counts.values()), self.pool.ref_counts
        # What attention reads: the batch's live view lists the same slots.
        _, slots = self.batch.live_view()
        for index, table in enumerate(tables):
            assert slots[index, : table.num_live].tolist() == table.live_slots().tolist()

    def after_rename(self, renamed: dict[int, int]) -> None:
        """A second listener, after ``batch.rename_blocks``: by the time the pool tells its
        tables, the bytes have moved (A4), so every live token already reads back."""
        assert renamed and set(renamed.values()) <= set(self.pool.pages), renamed
        self.check_reads_model()


class StateOwner:
    """A hybrid layer's state for one sequence: ``count`` contiguous pages of ``size`` elements,
    whose exact contents the model keeps."""

    def __init__(self, arena: KVArena, name: str) -> None:
        self.arena, self.name = arena, name
        self.pages: list = []
        self.offsets: list[int] = []  # where this owner last saw its pages
        self.content = torch.empty(0)  # the model: what its pages hold

    def __repr__(self) -> str:
        return f"StateOwner({self.name!r})"

    def take(self, size: int, count: int, content: torch.Tensor) -> None:
        self.pages = self.arena.allocate(self, "state", size, count, contiguous=True)
        self.offsets = [page.offset for page in self.pages]
        self.view().copy_(content)
        self.content = content

    def view(self) -> torch.Tensor:
        start = self.pages[0].offset
        return self.arena.buffer[start : start + sum(page.size for page in self.pages)]

    def check(self) -> None:
        for a, b in zip(self.pages, self.pages[1:], strict=False):
            assert b.offset == a.end, f"{self.name}: contiguous pages split {a} {b}"
        assert all(page in self.arena.pages for page in self.pages), self.name
        assert torch.equal(self.view(), self.content), f"{self.name}: state contents changed"

    def pages_moved(self, moves: dict) -> None:
        if moves:  # only its own pages, from where it last saw them
            mine = {id(page): i for i, page in enumerate(self.pages)}
            for page, old in moves.items():
                assert id(page) in mine, f"{self.name} told of a page it does not own"
                assert old == self.offsets[mine[id(page)]], (self.name, old, self.offsets)
        self.offsets = [page.offset for page in self.pages]
        self.check()  # A4: the bytes moved before the owner hears


@dataclass
class Cache:
    name: str
    layers: list[Layer]
    states: list[StateOwner] = field(default_factory=list)


def kv_rows(tables: int, n: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    key = torch.randn(tables, n, heads, HEAD_DIM, generator=generator)
    value = torch.randn(tables, n, heads, HEAD_DIM, generator=generator)
    return key, value  # [N, n, H, D] each


def state_values(numel: int, seed: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def assert_compacted(arena: KVArena, two_ended: bool) -> None:
    """A4's layout after ``compact``: no page can slide further toward its end. Two-ended: KV
    pages packed down from 0, state pages packed up to the top (unless the two ends would
    collide, when everything is packed down)."""
    pages = sorted(arena.pages, key=lambda page: page.offset)

    def packed_down(run) -> bool:
        cursor = 0
        for page in run:
            if page.offset != math.ceil(cursor / page.align) * page.align:
                return False
            cursor = page.end
        return True

    def packed_up(run) -> bool:
        top = arena.capacity
        for page in reversed(run):
            if page.offset != (top - page.size) // page.align * page.align:
                return False
            top = page.offset
        return True

    if two_ended:
        kv = [page for page in pages if page.kind == "kv"]
        state = [page for page in pages if page.kind == "state"]
        kinds = [page.kind for page in pages]
        if kinds == sorted(kinds) and packed_down(kv) and packed_up(state):
            return
        # Otherwise the ends must have collided: then the arena packs everything down.
        cursor = 0
        for page in kv:
            cursor = math.ceil(cursor / page.align) * page.align + page.size
        assert cursor > arena.capacity - sum(page.size for page in state), "not two-ended"
    assert packed_down(pages), [(p.kind, p.offset, p.end) for p in pages]


def arena_snapshot(arena: KVArena, caches: list[Cache]) -> tuple:
    """Everything a refused request must leave exactly as it was."""
    pages = sorted((p.offset, p.size, p.kind, id(p.owner), p.align) for p in arena.pages)
    layers = [
        (
            sorted(layer.pool.pages),
            dict(layer.pool.ref_counts),
            layer.batch.slots.clone(),
            layer.batch.alive.clone(),
            [list(blocks) for blocks in layer.batch.blocks],
            [list(free) for free in layer.batch.free_slots],
            list(layer.batch.num_live),
            layer.batch.num_tokens,
        )
        for cache in caches
        for layer in cache.layers
    ]
    owners = [list(owner.offsets) for cache in caches for owner in cache.states]
    state = (arena.capacity, list(arena.free_extents), pages, dict(arena.used), arena.generation)
    return arena.buffer.clone(), state, layers, owners


def assert_same_snapshot(before: tuple, after: tuple) -> None:
    assert torch.equal(before[0], after[0]), "arena bytes changed"
    assert before[1] == after[1], f"arena pages or free space changed: {before[1]} -> {after[1]}"
    for index, (a, b) in enumerate(zip(before[2], after[2], strict=True)):
        for x, y in zip(a, b, strict=True):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"layer {index} changed: {x} -> {y}"
    assert before[3] == after[3], "state pages moved"


def assert_names_bytes(error: ArenaExhausted, needed_bytes: int, arena: KVArena) -> None:
    message = str(error)
    assert f"need {needed_bytes} bytes" in message, message
    assert f"{arena.bytes_free} bytes free" in message, message


# ----------------------------------------------------------------------------- the machine
class ArenaMachine(RuleBasedStateMachine):
    private = False

    def __init__(self) -> None:
        super().__init__()
        self.caches: list[Cache] = []
        self.made = 0
        self.compact_calls = 0

    @initialize(
        move=st.sampled_from(["reference", "compiled"]),
        first=st.lists(st.sampled_from(sorted(GEOMETRIES)), min_size=1, max_size=2),
        second=st.lists(st.sampled_from(sorted(GEOMETRIES)), min_size=1, max_size=2),
        prompts=st.tuples(st.integers(0, 24), st.integers(0, 24)),
        seed=st.integers(0, 2**16),
    )
    def make_arena(self, move: str, first, second, prompts, seed: int) -> None:
        """The arena (its compactions copy with that ``move_pages`` backend) and two caches,
        prefilled, so eviction, repacking and compaction have work from the first step."""
        backend = ops.get("move_pages", move)
        if self.private:
            self.arena = KVArena.private(segment_bytes=SEGMENT_BYTES, move=backend)
        else:
            self.arena = KVArena(FIXED_CAPACITY, move=backend)
        for geometries, n in zip((first, second), prompts, strict=True):
            self.create_cache(geometries, 2, n, seed)

    # ------------------------------------------------------------------------- helpers
    def layers(self):
        return [layer for cache in self.caches for layer in cache.layers]

    def owners(self):
        return [owner for cache in self.caches for owner in cache.states]

    def free_elements(self) -> int:
        return self.arena.capacity - sum(self.arena.used.values())

    def snapshot(self) -> tuple:
        return arena_snapshot(self.arena, self.caches)

    def pick_layer(self, cache: int, layer: int) -> Layer:
        layers = self.caches[cache % len(self.caches)].layers
        return layers[layer % len(layers)]

    # ------------------------------------------------------------------------- rules
    @precondition(lambda self: len(self.caches) < MAX_CACHES)
    @rule(
        geometries=st.lists(st.sampled_from(sorted(GEOMETRIES)), min_size=1, max_size=2),
        tables=st.integers(1, 2),
        prompt=st.integers(0, 24),
        seed=st.integers(0, 2**16),
    )
    def create_cache(self, geometries: list[str], tables: int, prompt: int, seed: int) -> None:
        """A new cache: one layer per geometry, each prefilled with ``prompt`` tokens (pools
        take pages as their tables append)."""
        self.made += 1
        layers = []
        for index, name in enumerate(geometries):
            block_size, heads = GEOMETRIES[name]
            pool = ArenaBlockPool(self.arena, block_size, heads, HEAD_DIM)
            batch = TokenTableBatch(tables, block_size)
            layer = Layer(
                f"cache {self.made} layer {index} ({name})",
                pool,
                batch,
                [{} for _ in range(tables)],
                [0] * tables,
            )
            pool.listeners.append(batch.rename_blocks)  # as kvstack/hf/paged.py registers it
            pool.listeners.append(layer.after_rename)
            layers.append(layer)
        self.caches.append(Cache(f"cache {self.made}", layers))
        for index in range(len(layers) if prompt else 0):
            self.append(len(self.caches) - 1, index, prompt, seed + index)

    @precondition(lambda self: self.caches)
    @rule(cache=PICK, layer=PICK, n=st.integers(1, 24), seed=st.integers(0, 2**16))
    def append(self, cache: int, layer: int, n: int, seed: int) -> None:
        """A forward step of one layer: make room (compacting the arena, which may move every
        cache's pages), then append n tokens with random K/V to every table of the layer."""
        layer = self.pick_layer(cache, layer)
        needed = layer.blocks_needed(n)
        assert layer.batch.blocks_needed(n) == needed
        key, value = kv_rows(layer.batch.num_tables, n, layer.pool.num_kv_heads, seed)
        needed_bytes = needed * layer.pool.block_bytes
        must_fail = not self.private and needed * layer.pool.block_elements > self.free_elements()
        before = self.snapshot() if must_fail else None
        compactions = self.arena.compactions
        try:
            layer.pool.reserve(needed)  # as PagedLayer._reserve does
        except ArenaExhausted as error:
            assert not self.private, "a private arena grows instead"
            assert_names_bytes(error, needed_bytes, self.arena)
            # A3: it truly does not fit, even after any compaction it tried.
            assert not layer.pool.can_allocate(needed), "refused blocks that fit"
            if before is not None:
                assert_same_snapshot(before, self.snapshot())
            event("append: arena exhausted" + ("" if must_fail else " (fragmented)"))
            return
        assert not must_fail, f"{needed_bytes} bytes allocated with {self.arena.bytes_free} free"
        if self.arena.compactions > compactions:
            event("append: compacted the arena first")
        layer.batch.append(layer.pool, key, value)
        for table in range(layer.batch.num_tables):
            new = math.ceil(max(0, n - layer.free_slots(table)) / layer.block_size)
            layer.blocks[table] += new
            for i in range(n):
                layer.live[table][layer.num_tokens + i] = (key[table, i], value[table, i])
        layer.num_tokens += n

    @precondition(lambda self: self.caches)
    @rule(
        cache=PICK,
        layer=PICK,
        picks=st.lists(st.tuples(PICK, PICK), min_size=1, max_size=8),
        share=st.sampled_from([0.0, 0.5, 0.9]),
        seed=st.integers(0, 2**16),
        then_repack=st.booleans(),
    )
    def evict(
        self,
        cache: int,
        layer: int,
        picks: list[tuple[int, int]],
        share: float,
        seed: int,
        then_repack: bool,
    ) -> None:
        """Evict random live tokens of any tables (the picks, plus about ``share`` of every
        table's live tokens, chosen by ``seed``); their slots return to the tables. With
        ``then_repack`` the step ends as vToken's does: every table with F > theta repacks."""
        self._evict(self.pick_layer(cache, layer), picks, share, seed)
        if then_repack:
            for table in range(self.pick_layer(cache, layer).batch.num_tables):
                self.repack(cache, layer, table, force=False)

    def _evict(self, layer: Layer, picks: list[tuple[int, int]], share: float, seed: int) -> None:
        victims = torch.zeros(layer.batch.num_tables, layer.num_tokens, dtype=torch.bool)
        for table_pick, token_pick in picks:
            table = table_pick % layer.batch.num_tables
            live = sorted(layer.live[table])
            if live:
                victims[table, live[token_pick % len(live)]] = True
        generator = torch.Generator().manual_seed(seed)
        for table, live in enumerate(layer.live):
            chosen = torch.rand(len(live), generator=generator) < share
            victims[table, torch.tensor(sorted(live), dtype=torch.int64)[chosen]] = True
        if not victims.any():
            return
        counts = layer.batch.evict(victims, release=True)
        for table in range(layer.batch.num_tables):
            chosen = victims[table].nonzero()[:, 0].tolist()
            assert counts[table] == len(chosen)
            for index in chosen:
                del layer.live[table][index]

    @precondition(lambda self: self.caches)
    @rule(cache=PICK, layer=PICK, table=PICK, force=st.booleans())
    def repack(self, cache: int, layer: int, table: int, force: bool) -> None:
        """vToken's repack of one table with the registered ``copy_slots``, through the batch's
        reference-table round trip (``table``/``set_table``); freed blocks go to the arena."""
        layer = self.pick_layer(cache, layer)
        index = table % layer.batch.num_tables
        live, blocks = len(layer.live[index]), layer.blocks[index]
        needed = math.ceil(live / layer.block_size)
        waste = 1.0 - live / (blocks * layer.block_size) if blocks else 0.0
        expect = needed < blocks and (force or waste > DEFAULT_WASTE_THRESHOLD)
        reference_table = layer.batch.table(index)
        plan = plan_repack(reference_table, force=force)
        assert (plan is not None) == expect, (live, blocks, waste, force)
        if plan is None:
            return
        used = self.arena.used["kv"]
        execute_repack(reference_table, layer.pool, plan, copy=ops.get("copy_slots"))
        layer.batch.set_table(index, reference_table)
        freed = blocks - needed
        assert used - self.arena.used["kv"] == freed * layer.pool.block_elements, "not returned"
        layer.blocks[index] = needed
        event("repack: blocks returned to the arena")

    # One cache always stays (teardown frees the last): with none, most rules would be disabled.
    @precondition(lambda self: len(self.caches) > 1)
    @rule(cache=PICK)
    def free_cache(self, cache: int) -> None:
        """The request finished: every block and state page of the cache goes back."""
        gone = self.caches.pop(cache % len(self.caches))
        capacity = self.arena.capacity_bytes
        for layer in gone.layers:
            layer.batch.release_all(layer.pool)
            assert not layer.pool.pages and layer.pool.bytes_used == 0
        for owner in gone.states:
            self.arena.free(owner.pages)
        if self.private:  # real bytes fall after frees (once trimmed)
            self.arena.trim()
            self.check_trimmed(capacity)
            if self.arena.capacity_bytes < capacity:
                event("free cache: real bytes fell")

    @precondition(lambda self: self.caches and len(self.owners()) < MAX_STATE_OWNERS)
    @rule(
        cache=PICK,
        size=st.integers(1, 48),
        count=st.integers(1, 3),
        seed=st.integers(0, 2**16),
    )
    def take_state(self, cache: int, size: int, count: int, seed: int) -> None:
        """A hybrid layer's state pages for one sequence, exactly their size, contiguous."""
        cache = self.caches[cache % len(self.caches)]
        owner = StateOwner(self.arena, f"{cache.name} state {len(cache.states)}")
        must_fail = not self.private and size * count > self.free_elements()
        before = self.snapshot() if must_fail else None
        try:
            owner.take(size, count, state_values(size * count, seed))
        except ArenaExhausted as error:
            assert not self.private, "a private arena grows instead"
            assert_names_bytes(error, size * count * self.arena.itemsize, self.arena)
            assert self.arena.largest_free() < size * count, "refused a run that fits"
            if before is not None:
                assert_same_snapshot(before, self.snapshot())
            event("state: arena exhausted")
            return
        assert not must_fail, "state pages allocated past the arena's free bytes"
        cache.states.append(owner)

    @precondition(lambda self: self.owners())
    @rule(owner=PICK, seed=st.integers(0, 2**16))
    def write_state(self, owner: int, seed: int) -> None:
        """A state layer's step overwrites its state in place."""
        owner = self.owners()[owner % len(self.owners())]
        content = state_values(owner.content.numel(), seed)
        owner.view().copy_(content)
        owner.content = content

    @precondition(lambda self: self.owners())
    @rule(owner=PICK)
    def free_state(self, owner: int) -> None:
        owner = self.owners()[owner % len(self.owners())]
        self.arena.free(owner.pages)
        for cache in self.caches:
            cache.states = [mine for mine in cache.states if mine is not owner]

    # Gated on fragmentation: hypothesis draws argument-light rules most often, and compacting
    # a compact arena (a no-op) would crowd out the steps that fragment it.
    @precondition(lambda self: len(self.arena.free_extents) > 1)
    @rule()
    def compact(self) -> None:
        """A4: pages slide together with their contents; every owner whose pages moved hears
        (and checks its bytes inside ``pages_moved``). Every other call compacts one way only
        (``two_ended=False``), the rest the arena's default (two-ended when fixed)."""
        self.compact_calls += 1
        two_ended = None if self.compact_calls % 2 else False
        offsets = {id(page): page.offset for page in self.arena.pages}
        compactions = self.arena.compactions
        self.arena.compact(two_ended=two_ended)
        moved = sum(offsets[id(page)] != page.offset for page in self.arena.pages)
        assert self.arena.compactions == compactions + (moved > 0)
        default = not self.private
        assert_compacted(self.arena, default if two_ended is None else two_ended)
        how = "default" if two_ended is None else "one way"
        event(f"compact ({how}): " + ("pages moved" if moved else "nothing to move"))

    @precondition(lambda self: not self.private and self.caches)
    @rule(
        what=st.sampled_from(["allocate", "reserve", "state"]),
        cache=PICK,
        layer=PICK,
        extra=st.integers(1, 3),
        size=st.integers(1, 48),
        contiguous=st.booleans(),
    )
    def exhaust(
        self, what: str, cache: int, layer: int, extra: int, size: int, contiguous: bool
    ) -> None:
        """A3: asking for more than the arena holds raises ``ArenaExhausted`` naming the bytes
        needed and free, and nothing at all changes: no compaction, no page, no byte."""
        free = self.free_elements()
        if what == "state":
            count = free // size + extra
            needed_bytes = size * count * self.arena.itemsize
            call = lambda: self.arena.allocate(  # noqa: E731
                StateOwner(self.arena, "greedy"), "state", size, count, contiguous=contiguous
            )
        else:
            pool = self.pick_layer(cache, layer).pool
            count = free // pool.block_elements + extra
            needed_bytes = count * pool.block_bytes
            call = (lambda: pool.allocate(count)) if what == "allocate" else None
            call = call or (lambda: pool.reserve(count))
        before = self.snapshot()
        try:
            call()
        except ArenaExhausted as error:
            assert_names_bytes(error, needed_bytes, self.arena)
        else:
            raise AssertionError(f"{what} of {needed_bytes} bytes with {free} elements free")
        assert_same_snapshot(before, self.snapshot())
        event(f"exhaust: {what}")

    # ------------------------------------------------------------------------- invariants
    @invariant()
    def arena_consistent(self) -> None:
        """A1, A2, A5, and no page that no pool or owner holds."""
        self.arena.check_invariants()
        known = {id(page) for layer in self.layers() for page in layer.pool.pages.values()}
        known |= {id(page) for owner in self.owners() for page in owner.pages}
        assert {id(page) for page in self.arena.pages} == known, "a page leaked or vanished"
        assert self.arena.buffer.untyped_storage().nbytes() == self.arena.capacity_bytes

    @invariant()
    def fits_counts_what_placement_finds(self) -> None:
        """``fits`` counts pages per free extent; placing them one by one must agree."""
        sizes = {layer.pool.block_elements for layer in self.layers()} | {1, 7, 48}
        for size in sorted(sizes):
            for align in sorted({1, 4, size}):
                placeable = len(self.arena._place_some(size, 1 << 20, align))
                for count in {0, 1, placeable, placeable + 1}:
                    assert self.arena.fits(size, count, align) == (count <= placeable), (
                        size,
                        count,
                        align,
                        placeable,
                        self.arena.free_extents,
                    )

    @invariant()
    def bytes_per_kind(self) -> None:
        stats = self.arena.stats()
        kv = sum(sum(layer.blocks) * layer.pool.block_bytes for layer in self.layers())
        state = sum(owner.content.numel() for owner in self.owners()) * self.arena.itemsize
        assert stats["bytes_used_kv"] == kv, (stats, kv)
        assert stats["bytes_used_state"] == state, (stats, state)
        assert stats["bytes_used"] == kv + state
        assert stats["pages_kv"] == sum(sum(layer.blocks) for layer in self.layers())
        for layer in self.layers():
            assert layer.pool.bytes_used == sum(layer.blocks) * layer.pool.block_bytes

    @invariant()
    def tables_read_model(self) -> None:
        for layer in self.layers():
            layer.check_reads_model()

    @invariant()
    def states_read_model(self) -> None:
        for owner in self.owners():
            owner.check()

    # ------------------------------------------------------------------------- private arena
    def check_trimmed(self, before: int) -> None:
        """After ``trim``: real bytes never rose, exceed the pages by under two segments, and
        the top segment holds part of a page or of a reservation (no whole segment is kept
        empty: what is spare is the alignment between pages of different kinds, and the rest
        of the last segment)."""
        arena = self.arena
        real = arena.buffer.untyped_storage().nbytes()
        assert real == arena.capacity_bytes <= before, (real, before)
        spare = arena.capacity_bytes - arena.bytes_used
        assert spare < 2 * SEGMENT_BYTES, (
            f"{arena.capacity_bytes} real bytes for {arena.bytes_used} used"
        )
        high = max((page.end for page in arena.pages), default=0) * arena.itemsize
        reserved = sum(arena.reservations.values()) * arena.itemsize
        assert arena.capacity_bytes == 0 or arena.capacity_bytes - SEGMENT_BYTES < max(
            high, reserved
        ), f"{arena.capacity_bytes} real bytes, pages end at {high}, {reserved} reserved"

    def teardown(self) -> None:
        """Release everything: no page is left and the free space is one extent."""
        arena = getattr(self, "arena", None)
        if arena is None:
            return
        while self.caches:
            self.free_cache(0)
        assert not arena.pages and sum(arena.used.values()) == 0
        arena.trim()
        whole = [(0, arena.capacity)] if arena.capacity else []
        assert arena.free_extents == whole, arena.free_extents
        arena.check_invariants()
        if self.private:
            assert arena.capacity_bytes == 0  # every segment given back
        else:
            assert arena.capacity_bytes == FIXED_CAPACITY // 4 * 4  # fixed: never resized


class PrivateArenaMachine(ArenaMachine):
    """The same caches on a private arena, which grows in segments and trims."""

    private = True

    # Gated like compact: only when there are segments to give back (free_cache trims always).
    @precondition(lambda self: self.arena.capacity_bytes - self.arena.bytes_used >= SEGMENT_BYTES)
    @rule()
    def trim(self) -> None:
        before = self.arena.capacity_bytes
        floor = math.ceil(sum(self.arena.used.values()) / self.arena.segment)
        self.arena.trim()
        self.check_trimmed(before)
        if before - floor * SEGMENT_BYTES >= 2 * SEGMENT_BYTES:
            assert self.arena.capacity_bytes < before, "trim kept two empty segments"
            event("trim: real bytes fell")


# The active hypothesis profile (ci / dev / thorough) supplies max_examples and the rest.
ArenaMachine.TestCase.settings = settings(stateful_step_count=25)
PrivateArenaMachine.TestCase.settings = settings(stateful_step_count=25)
TestArenaStateMachine = ArenaMachine.TestCase
TestPrivateArenaStateMachine = PrivateArenaMachine.TestCase
