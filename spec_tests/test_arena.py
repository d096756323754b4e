"""Unit tests of ``KVArena`` and ``ArenaBlockPool`` (``kvstack.reference.arena``): capacity
parsing and its errors, two-ended compaction, the private arena's real bytes, the pool's views
of the arena buffer, and token tables that follow their blocks through a compaction.

The random interleavings live in ``spec_tests/test_arena_state_machine.py``; these are the
cases a reader can check by eye.
"""

from __future__ import annotations

import pytest
import torch

from kvstack import ops
from kvstack.arena import DEFAULT_SEGMENT_BYTES, ArenaBlockPool, KVArena
from kvstack.compiled.token_tables import TokenTableBatch
from kvstack.errors import InvalidArgumentError, InvalidDTypeError
from kvstack.reference import arena as reference_arena
from kvstack.reference.repack import execute_repack, plan_repack

HEAD_DIM = 4


class Owner:
    """A state-page owner that records every move it hears and keeps its pages' contents."""

    def __init__(self, arena: KVArena) -> None:
        self.arena = arena
        self.pages: list = []
        self.heard: list[dict] = []
        self.content = torch.empty(0)

    def take(self, size: int, count: int = 1, **kwargs) -> Owner:
        self.pages = self.arena.allocate(self, "state", size, count, contiguous=True, **kwargs)
        self.content = torch.randn(size * count).to(self.arena.dtype)
        self.view().copy_(self.content)
        return self

    def view(self) -> torch.Tensor:
        start = self.pages[0].offset
        return self.arena.buffer[start : start + sum(page.size for page in self.pages)]

    def pages_moved(self, moves: dict) -> None:
        # The bytes must already be at the new offsets when the owner hears (A4).
        assert torch.equal(self.view(), self.content), "told before the bytes moved"
        self.heard.append({page.offset: old for page, old in moves.items()})


def kv(tables: int, n: int, heads: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (tables, n, heads, HEAD_DIM)  # [N, n, H, D]
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def live_rows(pool: ArenaBlockPool, batch: TokenTableBatch) -> list:
    """Every table's live (logical index, K, V), read through the table."""
    rows = []
    for table in batch.tables():
        table.check_invariants()
        key, value = pool.read(table.live_slots())
        rows.append((table.live_indices().tolist(), key, value))
    return rows


def assert_same_rows(before: list, after: list) -> None:
    for (indices, key, value), (indices2, key2, value2) in zip(before, after, strict=True):
        assert indices == indices2
        assert torch.equal(key, key2) and torch.equal(value, value2), "K/V changed"


# ----------------------------------------------------------------------------- capacity
@pytest.mark.parametrize(
    ("capacity", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512 MB", 512 * 10**6),
        (1024, 1024),
        ("1.5KiB", 1536),
        (" 3 kb ", 3000),
    ],
)
def test_capacity_is_parsed_to_bytes(capacity, expected):
    # meta: the 2 GiB budget is parsed and shaped, but no memory is taken on this machine.
    arena = KVArena(capacity, device="meta")
    assert arena.capacity_bytes == expected
    assert arena.buffer.numel() * arena.buffer.element_size() == expected
    assert arena.free_extents == [(0, expected // 4)]


def test_a_cpu_arena_holds_exactly_its_capacity():
    arena = KVArena(1024)
    assert arena.buffer.untyped_storage().nbytes() == 1024 == arena.capacity_bytes
    assert arena.stats()["bytes_reserved"] == 1024 and arena.bytes_free == 1024


@pytest.fixture
def storage_spy(monkeypatch):
    """Records every buffer an arena would build: a refused capacity must build none."""
    built = []
    original = reference_arena.KVArena._init_storage

    def spy(self, elements):
        built.append(elements)
        original(self, elements)

    monkeypatch.setattr(reference_arena.KVArena, "_init_storage", spy)
    return built


@pytest.mark.parametrize(
    ("capacity", "error"),
    [
        (-1, InvalidArgumentError),
        ("abc", InvalidArgumentError),
        ("2 GiBs", InvalidArgumentError),
        (True, InvalidArgumentError),
        (1.5, InvalidDTypeError),
    ],
    ids=["negative", "not-a-number", "unknown-unit", "bool", "float"],
)
def test_bad_capacity_is_refused_naming_the_value(capacity, error, storage_spy):
    with pytest.raises(error) as raised:
        KVArena(capacity)
    message = str(raised.value)
    assert "capacity" in message, message
    assert repr(capacity) in message, f"the message does not name {capacity!r}: {message}"
    assert storage_spy == [], "the arena was built"


@pytest.mark.parametrize(
    ("segment_bytes", "error"),
    [
        (-1, InvalidArgumentError),
        ("abc", InvalidArgumentError),
        ("2 GiBs", InvalidArgumentError),
        (True, InvalidArgumentError),
        (1.5, InvalidDTypeError),
        (3, InvalidArgumentError),  # smaller than one float32 element
    ],
    ids=["negative", "not-a-number", "unknown-unit", "bool", "float", "below-one-element"],
)
def test_bad_segment_size_is_refused_naming_the_argument(segment_bytes, error, storage_spy):
    """The error names the argument the caller passed (``segment_bytes``), not ``capacity``."""
    with pytest.raises(error) as raised:
        KVArena.private(segment_bytes=segment_bytes)
    message = str(raised.value)
    assert "segment_bytes" in message and repr(segment_bytes) in message, message
    assert storage_spy == [], "the arena was built"


def test_a_private_arena_takes_no_memory_until_a_page_needs_it(monkeypatch):
    """ "It starts empty": building one allocates no segment, not even for a moment (on CUDA a
    transient segment would stay in torch's caching allocator)."""
    sizes = []
    for name in ("zeros", "empty", "full"):
        original = getattr(torch, name)

        def spy(*args, _original=original, **kwargs):
            tensor = _original(*args, **kwargs)
            sizes.append(tensor.numel())
            return tensor

        monkeypatch.setattr(torch, name, spy)
    arena = KVArena.private(segment_bytes="64KiB")
    monkeypatch.undo()
    assert arena.capacity_bytes == 0 and arena.segment * arena.itemsize == 64 * 1024
    assert max(sizes, default=0) <= 1, f"built tensors of {sizes} elements"


@pytest.mark.parametrize(
    ("capacity", "dtype", "itemsize"),
    [
        (3, torch.float32, 4),
        (0, torch.float32, 4),
        (1, torch.bfloat16, 2),
        ("0 KiB", torch.float16, 2),
    ],
)
def test_capacity_smaller_than_one_element_is_refused(capacity, dtype, itemsize, storage_spy):
    with pytest.raises(InvalidArgumentError) as raised:
        KVArena(capacity, dtype=dtype)
    message = str(raised.value)
    assert repr(capacity) in message and f"{itemsize} bytes" in message, message
    assert storage_spy == []


def test_one_element_is_enough():
    arena = KVArena(2, dtype=torch.bfloat16)
    assert arena.capacity == 1 and arena.capacity_bytes == 2
    assert arena.allocate(Owner(arena), "state", 1)[0].offset == 0


# ----------------------------------------------------------------------------- compaction
def test_compaction_of_mixed_kinds_leaves_one_free_extent_and_owners_hear():
    """Two-ended: KV blocks slide down, state pages slide up; the free space is one extent
    between them, every byte moved with its page, and each owner heard its own moves."""
    arena = KVArena(64 * 32 * 4)  # 64 blocks of 32 elements
    pool = ArenaBlockPool(arena, 4, 1, HEAD_DIM)  # 32 elements per block
    batch = TokenTableBatch(1, 4)
    pool.listeners.append(batch.rename_blocks)
    renames: list[dict] = []
    pool.listeners.append(renames.append)
    spacer = pool.allocate(3)  # blocks 0-2
    key, value = kv(1, 12, 1)
    batch.append(pool, key, value)  # blocks 3-5
    gone = Owner(arena).take(40)  # state pages come from the top: [capacity - 40, capacity)
    high = Owner(arena).take(7, 3)  # three contiguous pages below it
    low = Owner(arena).take(5)  # and one more below those
    untouched = Owner(arena).take(3)
    arena.free(gone.pages + untouched.pages)
    pool.free(spacer)
    before = live_rows(pool, batch)
    old = {id(page): page.offset for page in arena.pages}

    arena.compact()

    arena.check_invariants()
    assert len(arena.free_extents) == 1, arena.free_extents
    pages = sorted(arena.pages, key=lambda page: page.offset)
    assert [page.kind for page in pages] == ["kv"] * 3 + ["state"] * 4
    assert [page.offset for page in pages[:3]] == [0, 32, 64]  # KV packed down from 0
    top = arena.capacity
    for page in reversed(pages[3:]):  # state packed up to the top, back to back
        assert page.end == top
        top = page.offset
    assert arena.free_extents == [(pages[2].end, pages[3].offset)]
    # Contents moved with their pages, and each owner heard exactly its moved pages, once.
    assert_same_rows(before, live_rows(pool, batch))
    for owner in (high, low):
        assert torch.equal(owner.view(), owner.content)
        assert owner.heard == [{page.offset: old[id(page)] for page in owner.pages}]
        assert all(page.offset == old[id(page)] + 40 for page in owner.pages)
    assert renames == [{3: 0, 4: 1, 5: 2}]
    assert batch.blocks == [[0, 1, 2]]
    assert arena.stats()["compactions"] == 1


class UncheckedOwner(Owner):
    def pages_moved(self, moves: dict) -> None:
        self.heard.append(moves)


def test_contiguous_aligned_state_pages_stay_contiguous_through_compaction():
    """``contiguous=True`` promises one strided view; an owner that asked for aligned pages
    must still find them back to back after the arena moved them (A4 keeps sizes, kinds and
    owners, and the allocation's contiguity with them)."""
    arena = KVArena(100 * 4)  # 100 elements
    owner = UncheckedOwner(arena).take(3, 2, align=4)  # [92, 95) and [95, 98): 2 free on top
    Owner(arena).take(5)  # below them
    arena.compact()  # both slide up as far as they can
    first, second = owner.pages
    assert first.offset % 4 == 0
    assert second.offset == first.end, f"split: {first} and {second}"


def test_compaction_of_a_compact_arena_moves_nothing():
    arena = KVArena(4096)
    owner = Owner(arena).take(10)
    pool = ArenaBlockPool(arena, 4, 1, HEAD_DIM)
    pool.allocate(2)
    generation = arena.generation
    arena.compact()
    assert owner.heard == [] and arena.generation == generation
    assert arena.stats()["compactions"] == 0


# ----------------------------------------------------------------------------- private arenas
def test_default_segment_is_one_mebibyte_as_documented():
    assert DEFAULT_SEGMENT_BYTES == 2**20  # "1 MiB: a private arena grows and shrinks by this much"
    for dtype in (torch.float32, torch.bfloat16):
        arena = KVArena.private(dtype=dtype)
        assert arena.capacity_bytes == 0 and arena.buffer.untyped_storage().nbytes() == 0
        assert arena.segment * arena.itemsize == DEFAULT_SEGMENT_BYTES
        Owner(arena).take(1)  # one element: one whole segment
        assert arena.buffer.untyped_storage().nbytes() == DEFAULT_SEGMENT_BYTES
        Owner(arena).take(arena.segment - 1)  # the rest of it: no growth
        assert arena.buffer.untyped_storage().nbytes() == DEFAULT_SEGMENT_BYTES
        Owner(arena).take(arena.segment // 2)  # more: one whole segment more
        assert arena.buffer.untyped_storage().nbytes() == 2 * DEFAULT_SEGMENT_BYTES


@pytest.mark.parametrize("how", ["kv blocks", "state page"])
def test_private_arena_grows_by_no_more_segments_than_the_pages_need(how):
    """Real bytes: pages that fill exactly k segments get k segments, not k + 1."""
    segment = 1024  # bytes: 256 float32 elements
    arena = KVArena.private(segment_bytes=segment)
    if how == "kv blocks":
        ArenaBlockPool(arena, 4, 4, HEAD_DIM).allocate(2)  # 2 blocks of 128 elements
    else:
        Owner(arena).take(arena.segment)
    assert arena.bytes_used == segment
    assert arena.capacity_bytes == segment, f"{arena.capacity_bytes} bytes for {segment} used"


def test_private_arena_real_bytes_fall_after_eviction_repack_and_trim():
    segment = 4096  # bytes: 1024 elements, 8 blocks of [4 tokens, 2 (K, V), 8 heads, 4]
    arena = KVArena.private(segment_bytes=segment)
    pool = ArenaBlockPool(arena, 4, 8, HEAD_DIM)  # 128 elements per block
    batch = TokenTableBatch(2, 4)
    pool.listeners.append(batch.rename_blocks)
    for step in range(6):
        key, value = kv(2, 10, 8, seed=step)
        pool.reserve(batch.blocks_needed(10))
        batch.append(pool, key, value)
    grown = arena.buffer.untyped_storage().nbytes()
    assert grown == arena.capacity_bytes >= 4 * segment  # 2 x 15 blocks of 512 bytes
    victims = torch.ones(2, batch.num_tokens, dtype=torch.bool)
    victims[:, ::10] = False  # keep one token in ten
    batch.evict(victims)
    for index in range(2):
        table = batch.table(index)
        execute_repack(table, pool, plan_repack(table, force=True), copy=ops.get("copy_slots"))
        batch.set_table(index, table)
    kept = live_rows(pool, batch)
    assert arena.buffer.untyped_storage().nbytes() == grown  # freed, but not yet given back

    arena.trim()

    real = arena.buffer.untyped_storage().nbytes()
    assert real == arena.capacity_bytes < grown
    assert real - arena.bytes_used < segment
    assert_same_rows(kept, live_rows(pool, batch))  # the live tokens survived the shrink
    assert pool.key.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()


class Quiet:
    """A page owner that needs no news of moves (its pages hold nothing the test reads)."""

    def pages_moved(self, moves: dict) -> None:
        pass


def test_a_trim_that_cannot_free_a_segment_is_not_retried_until_pages_come_or_go(monkeypatch):
    segment = 1024  # bytes: 256 elements
    arena = KVArena.private(segment_bytes=segment)
    small = arena.allocate(Quiet(), "kv", 10)
    arena.allocate(Quiet(), "kv", 100, align=256)  # can only start at 0 or 256: at 256
    assert arena.capacity_bytes == 2 * segment
    compactions = []
    real_compact = arena.compact
    monkeypatch.setattr(arena, "compact", lambda **kw: compactions.append(1) or real_compact(**kw))
    # 110 elements fit one segment, but the aligned page keeps the top one: nothing to give back.
    arena.trim()
    arena.trim()
    assert arena.capacity_bytes == 2 * segment and len(compactions) == 1  # tried once
    arena.free(small)  # now the aligned page can slide to 0
    arena.trim()
    assert arena.capacity_bytes == segment and len(compactions) == 2
    arena.check_invariants()


def test_peak_bytes_reserved_counts_both_buffers_during_a_resize():
    segment = 1024  # bytes: 256 elements
    arena = KVArena.private(segment_bytes=segment)
    peaks = []
    for size in (1, 255, 100, 200):
        Owner(arena).take(size)
        peaks.append((arena.capacity_bytes, arena.stats()["peak_bytes_reserved"]))
    # 0 -> 1 segment; the 255 fit; 1 -> 2 (old and new alive together: 3); 2 -> 3 (5).
    assert peaks == [(1024, 1024), (1024, 1024), (2048, 3072), (3072, 5120)]
    arena.free([page for page in arena.pages if page.size in (100, 200)])
    arena.trim()  # 3 -> 1 segment: 4 segments alive during the copy, below the peak of 5
    assert arena.capacity_bytes == segment
    assert arena.stats()["peak_bytes_reserved"] == 5 * segment


# ----------------------------------------------------------------------------- pool views
@pytest.mark.parametrize(("block_size", "heads"), [(4, 1), (16, 3)])
def test_pool_key_and_value_are_views_of_the_arena_buffer(block_size, heads):
    """``[n, block_size, 2, heads, head_dim]`` over the buffer: K at index 0, V at 1."""
    arena = KVArena(10_000)
    pool = ArenaBlockPool(arena, block_size, heads, HEAD_DIM)
    elements = block_size * 2 * heads * HEAD_DIM
    n = arena.capacity // elements
    assert pool.num_blocks == n
    arena.buffer.copy_(torch.arange(arena.capacity, dtype=torch.float32))
    layout = torch.arange(n * elements, dtype=torch.float32).view(n, block_size, 2, heads, HEAD_DIM)
    assert pool.key.shape == pool.value.shape == (n, block_size, heads, HEAD_DIM)
    assert torch.equal(pool.key, layout[:, :, 0]) and torch.equal(pool.value, layout[:, :, 1])
    storage = arena.buffer.untyped_storage().data_ptr()
    assert pool.key.untyped_storage().data_ptr() == storage
    assert pool.value.untyped_storage().data_ptr() == storage
    pool.value[1, 2, heads - 1, 3] = -7.0  # a write through the view lands in the buffer
    offset = elements + 2 * 2 * heads * HEAD_DIM + heads * HEAD_DIM + (heads - 1) * HEAD_DIM + 3
    assert arena.buffer[offset] == -7.0
    block = pool.allocate(1)[0]
    assert pool.pages[block].offset == block * elements


def test_pool_views_follow_a_growing_private_arena():
    arena = KVArena.private(segment_bytes=1024)
    pool = ArenaBlockPool(arena, 4, 1, HEAD_DIM)
    batch = TokenTableBatch(1, 4)
    key, value = kv(1, 40, 1)
    pool.reserve(batch.blocks_needed(40))
    batch.append(pool, key, value)  # 10 blocks of 128 bytes: the arena grew past 1 KiB
    assert arena.capacity_bytes > 1024
    assert pool.key.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    read_key, read_value = pool.read(batch.table(0).live_slots())
    assert torch.equal(read_key, key[0]) and torch.equal(read_value, value[0])


# ----------------------------------------------------------------------------- renaming
def test_rename_blocks_keeps_every_live_token_readable_after_a_compaction():
    """Two geometries interleaved on one arena; freeing one pool's blocks and compacting moves
    the other's. The tables follow (``rename_blocks``): live tokens read back, Naive-Evicted
    slots stay held, and freed slots in moved blocks are reused by the next append."""
    arena = KVArena(40 * 384 * 4)
    wide = ArenaBlockPool(arena, 16, 3, HEAD_DIM)  # 384 elements per block
    narrow = ArenaBlockPool(arena, 4, 1, HEAD_DIM)  # 32
    batches = {id(wide): TokenTableBatch(2, 16), id(narrow): TokenTableBatch(2, 4)}
    for pool in (wide, narrow):
        pool.listeners.append(batches[id(pool)].rename_blocks)
    others = ArenaBlockPool(arena, 16, 3, HEAD_DIM)
    spacers = []
    for step in range(3):  # interleave: a spacer block, then each pool's new blocks
        spacers += others.allocate(1)
        for pool in (wide, narrow):
            batch = batches[id(pool)]
            key, value = kv(2, 9, pool.num_kv_heads, seed=10 * step + pool.block_size)
            pool.reserve(batch.blocks_needed(9))
            batch.append(pool, key, value)
    for pool in (wide, narrow):  # evict (released) and Naive-Evict (slots kept)
        batch = batches[id(pool)]
        victims = torch.zeros(2, batch.num_tokens, dtype=torch.bool)
        victims[0, 1:6] = True
        victims[1, ::3] = True
        batch.evict(victims, release=True)
        batch.evict_one_each(torch.tensor([7, 8]), release=False)
    before = {id(pool): live_rows(pool, batches[id(pool)]) for pool in (wide, narrow)}
    held = {id(pool): int((batches[id(pool)].slots >= 0).sum()) for pool in (wide, narrow)}
    blocks = {id(pool): sorted(pool.pages) for pool in (wide, narrow)}
    others.free(spacers)

    arena.compact()

    for pool in (wide, narrow):
        batch = batches[id(pool)]
        assert sorted(b for table in batch.blocks for b in table) == sorted(pool.pages)
        assert_same_rows(before[id(pool)], live_rows(pool, batch))
        assert int((batch.slots >= 0).sum()) == held[id(pool)]
        # The next append fills the released slots (now in moved blocks) first.
        free = [list(slots) for slots in batch.free_slots]
        key, value = kv(2, 2, pool.num_kv_heads, seed=99)
        slots = batch.append(pool, key, value)
        assert [row[:2] for row in free] == slots.tolist()
        read_key, read_value = pool.read(slots.flatten())
        assert torch.equal(read_key, key.flatten(0, 1)) and torch.equal(
            read_value, value.flatten(0, 1)
        )
        for table in batch.tables():
            table.check_invariants()
    for pool in (wide, narrow):  # both pools' blocks moved, so the renames were exercised
        assert sorted(pool.pages) != blocks[id(pool)], f"{pool} did not move"
    arena.check_invariants()


@pytest.mark.parametrize("moves", [1, 7, 16])
def test_copy_slots_on_arena_views_matches_the_reference(moves):
    """K and V of an ArenaBlockPool are views of one buffer, so the fastest copy_slots takes its
    eager path there; it must still copy exactly what the reference copies."""
    from kvstack import ops

    arena = KVArena(64 * 1024)
    pool = ArenaBlockPool(arena, 4, 2, HEAD_DIM)
    pool.allocate(8)
    arena.buffer.copy_(torch.randn(arena.buffer.shape, generator=torch.Generator().manual_seed(0)))
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(moves))
    src, dst = slots[:moves], slots[moves : 2 * moves]  # disjoint, as a repack plan's are
    key, value = pool.key.clone(), pool.value.clone()
    ops.get("copy_slots")(pool.key, pool.value, src, dst)
    ops.get("copy_slots", "reference")(key, value, src, dst)
    assert torch.equal(pool.key, key) and torch.equal(pool.value, value)
