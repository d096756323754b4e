"""KV arena: one memory budget from which every cache draws its pages.

An arena is one tensor, ``buffer`` (``capacity`` bytes of the arena's dtype, as elements), carved
into *pages*. A page is a run of elements ``[offset, offset + size)`` with an owner and a kind:

    "kv"     an attention KV block of one layer geometry: block_size tokens x heads x head_dim,
             for K and V interleaved per token, so that ``ArenaBlockPool`` can view every block of
             that geometry as ``[num_blocks, block_size, heads, head_dim]`` keys and values;
    "state"  one hybrid layer's conv or recurrent state for one sequence, exactly its size.

Both kinds come from the same free space, so capacity moves between them on demand. Nothing is
padded to a common page size (vLLM's unified layout pads; see ``bench/arena.py``). A KV block is
aligned to its own size, which is what lets a pool address it by ``offset // block_elements``.

Two kinds of arena:
  * fixed   ``KVArena(capacity, device=..., dtype=...)``: ``buffer`` is allocated once and never
            grows or reallocates, so the process holds exactly the budget;
  * private ``KVArena.private(...)``: what a cache built without ``arena=`` gets. It starts
            empty, grows in fixed segments of ``segment_bytes`` (default
            ``DEFAULT_SEGMENT_BYTES``) when a page does not fit, and ``trim()`` gives whole
            segments back to torch once they are empty (after compaction), so real bytes fall
            after eviction. Growing or shrinking replaces ``buffer``; both buffers exist during
            the copy, and ``peak_bytes_reserved`` counts them both.

Invariants (checked by ``check_invariants`` and ``spec_tests/test_arena_state_machine.py``):
  A1 pages and free extents tile ``[0, capacity)`` exactly: no overlap, nothing lost;
  A2 free extents are sorted and coalesced (no two touch), so the free list is canonical;
  A3 allocation is atomic: every requested page or none (``ArenaExhausted``, nothing changed);
  A4 compaction moves page contents with their pages (``move_pages``) and tells every owner
     whose pages moved, before anything else reads them; it never changes a page's size, kind
     or owner, and it leaves free space as one extent at the end (alignment gaps aside);
  A5 bytes used per kind are the sum of page sizes of that kind.

Owners implement ``pages_moved(moves)`` (``moves`` maps each moved page to its old offset; an
empty map means ``buffer`` was replaced and views must be taken again).
"""

from __future__ import annotations

import bisect
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.errors import (
    ArenaExhausted,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidDTypeError,
)
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.checks import FLOAT_DTYPES, check_positive_int

PAGE_KINDS = ("kv", "state")
FLOAT_DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
DEFAULT_SEGMENT_BYTES = 1 << 20  # 1 MiB: a private arena grows and shrinks by this much
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(name: str, value: int | str) -> int:
    """``value`` as a number of bytes: an int, or a string such as ``"2GiB"``, ``"512 MB"``."""
    if isinstance(value, bool):
        raise InvalidArgumentError(
            f"{name} must be a byte count or a string like '2GiB', got {value!r}"
        )
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgumentError(f"{name} must be >= 0 bytes, got {value}")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
        raise InvalidArgumentError(
            f"{name}={value!r} is not a byte count; expected a non-negative number with an "
            f"optional unit in {sorted(u for u in _UNITS if u)} (e.g. '2GiB')"
        )
    raise InvalidDTypeError(
        f"{name} must be an int or a str such as '2GiB', got {value!r} ({type(value).__name__})"
    )


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(eq=False)
class Page:
    """A run of arena elements ``[offset, offset + size)``. Compared by identity."""

    kind: str
    offset: int
    size: int
    owner: Any
    align: int = 1  # compaction keeps ``offset % align == 0``
    run: Page | None = None  # the first page of a ``contiguous`` allocation this page is part of

    @property
    def end(self) -> int:
        return self.offset + self.size


def move_pages(
    buffer: torch.Tensor, src_offsets: torch.Tensor, dst_offsets: torch.Tensor, sizes: torch.Tensor
) -> None:
    """Move runs of ``buffer`` ([E] elements): run i, ``sizes[i]`` long, from ``src_offsets[i]``
    to ``dst_offsets[i]``, as if every source were read before any destination is written.

    Destinations must not overlap one another; a destination may overlap any source (compaction
    slides pages into space that other moving pages leave). The reads are copies, so a
    compaction briefly holds the moved bytes twice."""
    runs = list(zip(src_offsets.tolist(), dst_offsets.tolist(), sizes.tolist(), strict=True))
    contents = [buffer[src : src + size].clone() for src, _, size in runs]  # every read first
    for (_, dst, size), content in zip(runs, contents, strict=True):
        buffer[dst : dst + size] = content


class KVArena:
    """One memory budget shared by every layer, row, cache and page kind (see the module doc).

    >>> arena = KVArena("2GiB", device="cuda", dtype=torch.bfloat16)
    >>> cache = TokenTableCache(model.config, policy=H2O(), budget=256, arena=arena)
    """

    def __init__(
        self,
        capacity: int | str,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        move: Callable[..., None] | None = None,
    ) -> None:
        capacity_bytes = parse_bytes("capacity", capacity)
        if dtype not in FLOAT_DTYPES:
            raise InvalidDTypeError(
                f"dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype!r}"
            )
        self.dtype = dtype
        self.device = torch.device(device)
        self.itemsize = torch.empty(0, dtype=dtype).element_size()
        if capacity_bytes < self.itemsize:
            raise InvalidArgumentError(
                f"capacity must hold at least one {dtype} element ({self.itemsize} bytes), got "
                f"{capacity!r}"
            )
        self.growable = False
        self.segment = 0  # elements; a private arena's growth step
        self._fruitless_trim: tuple | None = None  # (pages, floor, capacity) of a trim in vain
        self._move = move
        self._init_storage(capacity_bytes // self.itemsize)

    @classmethod
    def private(
        cls,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        segment_bytes: int | str = DEFAULT_SEGMENT_BYTES,
        move: Callable[..., None] | None = None,
    ) -> KVArena:
        """An arena that starts empty and grows (and shrinks) in segments of ``segment_bytes``."""
        segment = parse_bytes("segment_bytes", segment_bytes)
        if dtype not in FLOAT_DTYPE_BYTES:
            raise InvalidDTypeError(
                f"dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype!r}"
            )
        if segment < FLOAT_DTYPE_BYTES[dtype]:
            raise InvalidArgumentError(
                f"segment_bytes must hold at least one {dtype} element "
                f"({FLOAT_DTYPE_BYTES[dtype]} bytes), got {segment_bytes!r}"
            )
        arena = cls(FLOAT_DTYPE_BYTES[dtype], device=device, dtype=dtype, move=move)
        # Built with one element, then emptied: a private arena holds nothing until a page needs it.
        arena.growable = True
        arena.segment = segment // arena.itemsize
        arena._init_storage(0)
        return arena

    def _init_storage(self, elements: int) -> None:
        # Zeroed, not empty: attention reads masked-out slots through clamped indices and
        # multiplies them by zero, which NaN garbage would survive.
        self.buffer = torch.zeros(elements, dtype=self.dtype, device=self.device)
        self.capacity = elements  # elements
        self.free_extents: list[tuple[int, int]] = [(0, elements)] if elements else []
        self.pages: set[Page] = set()
        self.used = dict.fromkeys(PAGE_KINDS, 0)  # elements per kind
        self.peak_used = 0
        self.peak_reserved = elements
        self.reservations: dict[Any, int] = {}  # key -> elements a private arena keeps
        self.generation = 0  # bumped whenever buffer is replaced or pages move
        self.compactions = 0

    def __repr__(self) -> str:
        kind = "private" if self.growable else "fixed"
        return (
            f"KVArena({kind}, capacity={format_bytes(self.capacity_bytes)}, "
            f"used={format_bytes(self.bytes_used)}, dtype={self.dtype}, device={str(self.device)!r})"
        )

    # ----------------------------------------------------------------- sizes
    @property
    def capacity_bytes(self) -> int:
        return self.capacity * self.itemsize

    @property
    def bytes_used(self) -> int:
        return sum(self.used.values()) * self.itemsize

    @property
    def bytes_free(self) -> int:
        return (self.capacity - sum(self.used.values())) * self.itemsize

    def largest_free(self) -> int:
        """Elements in the largest free extent."""
        return max((end - start for start, end in self.free_extents), default=0)

    def fits(self, size: int, count: int = 1, align: int = 1) -> bool:
        """Whether ``count`` pages of ``size`` elements, each aligned to ``align``, fit now
        (``_place_some`` would find them all). Counted per free extent, not placed page by page:
        a cache asks this on every append, and a shared arena's free space is often hundreds of
        extents, so it stops at the first extents that hold them all."""
        if count <= 0:
            return True
        # From an aligned offset the next page starts ceil(size / align) * align further on.
        stride = math.ceil(size / align) * align
        remaining = count
        for start, end in self.free_extents:
            first = math.ceil(start / align) * align
            if first + size <= end:
                remaining -= (end - size - first) // stride + 1
                if remaining <= 0:
                    return True
        return False

    def stats(self) -> dict[str, float]:
        """The whole budget, in bytes unless named otherwise."""
        return {
            "bytes_reserved": self.capacity_bytes,
            "bytes_used": self.bytes_used,
            "bytes_used_kv": self.used["kv"] * self.itemsize,
            "bytes_used_state": self.used["state"] * self.itemsize,
            "bytes_free": self.bytes_free,
            "largest_free_bytes": self.largest_free() * self.itemsize,
            "peak_bytes_used": self.peak_used * self.itemsize,
            "peak_bytes_reserved": self.peak_reserved * self.itemsize,
            "pages_kv": sum(page.kind == "kv" for page in self.pages),
            "pages_state": sum(page.kind == "state" for page in self.pages),
            "compactions": self.compactions,
        }

    # ----------------------------------------------------------------- allocation
    def allocate(
        self,
        owner: Any,
        kind: str,
        size: int,
        count: int = 1,
        *,
        align: int = 1,
        contiguous: bool = False,
    ) -> list[Page]:
        """``count`` pages of ``size`` elements for ``owner``, each at an offset that is a multiple
        of ``align``; ``contiguous=True`` places them back to back (one strided view).

        All or nothing (A3). When they do not fit, a fixed arena compacts (if enough is free in
        total) and a private one grows; then ``ArenaExhausted`` names the bytes needed and free."""
        if kind not in PAGE_KINDS:
            raise InvalidArgumentError(f"kind must be one of {PAGE_KINDS}, got {kind!r}")
        check_positive_int("size", size)
        check_positive_int("align", align)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidArgumentError(f"count must be a non-negative integer, got {count!r}")
        if count == 0:
            return []
        from_top = kind == "state"
        offsets = self._place(size, count, align, contiguous, from_top)
        if offsets is None and (self.capacity - sum(self.used.values())) >= size * count:
            self.compact()
            offsets = self._place(size, count, align, contiguous, from_top)
        if offsets is None and self.growable:
            self._grow_for(size, count, align, contiguous)
            offsets = self._place(size, count, align, contiguous, from_top)
        if offsets is None:
            raise ArenaExhausted(
                f"{kind} pages need {size * count * self.itemsize} bytes ({count} x "
                f"{size * self.itemsize}), but the arena has {self.bytes_free} bytes free of "
                f"{self.capacity_bytes} (largest free run {self.largest_free() * self.itemsize} "
                "bytes)"
            )
        if contiguous:
            offsets = sorted(offsets)
        pages = []
        for index, offset in enumerate(offsets):
            page_align = align if (index == 0 or not contiguous) else 1
            page = Page(
                kind, offset, size, owner, page_align, pages[0] if pages and contiguous else None
            )
            self._take(offset, size)
            self.pages.add(page)
            pages.append(page)
        self.used[kind] += size * count
        self.peak_used = max(self.peak_used, sum(self.used.values()))
        return pages

    def free(self, pages: Iterable[Page]) -> None:
        """Return pages to the free space (coalescing). A page not held raises and frees none."""
        pages = list(pages)
        seen: set[int] = set()
        for page in pages:
            if page not in self.pages or id(page) in seen:
                raise DoubleFreeError(f"pages holds {page!r}, which this arena does not hold")
            seen.add(id(page))
        for page in pages:
            self.pages.remove(page)
            self.used[page.kind] -= page.size
            self._give(page.offset, page.end)

    def _place(
        self, size: int, count: int, align: int, contiguous: bool, from_top: bool = False
    ) -> list[int] | None:
        """Offsets for the pages, or None; changes nothing. First fit from the bottom, or, for
        ``from_top`` (state pages), from the top of the highest extents."""
        if not contiguous:
            offsets = self._place_some(size, count, align, from_top)
            return offsets if len(offsets) == count else None
        extents = reversed(self.free_extents) if from_top else self.free_extents
        for start, end in extents:
            offset = (
                (end - size * count) // align * align
                if from_top
                else math.ceil(start / align) * align
            )
            if start <= offset and offset + size * count <= end:
                return [offset + i * size for i in range(count)]
        return None

    def _place_some(self, size: int, count: int, align: int, from_top: bool = False) -> list[int]:
        """Offsets of as many of the pages (up to ``count``) as fit now. Changes nothing."""
        offsets: list[int] = []
        if from_top:
            for start, end in reversed(self.free_extents):
                if len(offsets) == count:
                    break
                offset = (end - size) // align * align
                while offset >= start and len(offsets) < count:
                    offsets.append(offset)
                    offset = (offset - size) // align * align
            return offsets
        for start, end in self.free_extents:
            if len(offsets) == count:
                break
            offset = math.ceil(start / align) * align
            while offset + size <= end and len(offsets) < count:
                offsets.append(offset)
                offset = math.ceil((offset + size) / align) * align
        return offsets

    def _take(self, offset: int, size: int) -> None:
        # The extent holding [offset, offset + size): split it around the page.
        index = bisect.bisect_right(self.free_extents, (offset, math.inf)) - 1
        start, end = self.free_extents[index]
        assert start <= offset and offset + size <= end, "placement outside a free extent"
        pieces = [(s, e) for s, e in ((start, offset), (offset + size, end)) if e > s]
        self.free_extents[index : index + 1] = pieces

    def _give(self, start: int, end: int) -> None:
        index = bisect.bisect_left(self.free_extents, (start, end))
        if index > 0 and self.free_extents[index - 1][1] == start:  # touches the one before
            index -= 1
            start = self.free_extents[index][0]
            del self.free_extents[index]
        if index < len(self.free_extents) and self.free_extents[index][0] == end:  # and after
            end = self.free_extents[index][1]
            del self.free_extents[index]
        self.free_extents.insert(index, (start, end))

    # ----------------------------------------------------------------- moving pages
    def compact(self, *, two_ended: bool | None = None) -> None:
        """Slide pages together so free space becomes one extent (A4): KV pages down to the
        lowest offsets their alignment allows and, ``two_ended`` (the default for fixed
        arenas), state pages up to the top, where new state pages are placed too, so the two
        kinds do not leave alignment gaps between each other. A private arena compacts
        everything down (``trim`` then cuts the top). Owners hear which of their pages moved."""
        two_ended = not self.growable if two_ended is None else two_ended
        targets = self._compaction_targets(two_ended)
        if two_ended and targets is None:  # the kinds would collide: one direction only
            targets = self._compaction_targets(False)
        moved = [(page, page.offset, new) for page, new in targets.items() if new != page.offset]
        if not moved:
            return
        if self.buffer.device.type != "meta":
            move = self._move or move_pages
            as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
            move(
                self.buffer,
                as_tensor([old for _, old, _ in moved]),
                as_tensor([new for _, _, new in moved]),
                as_tensor([page.size for page, _, _ in moved]),
            )
        for page, _, new in moved:
            page.offset = new
        self._rebuild_free_extents()
        self.generation += 1
        self.compactions += 1
        by_owner: dict[int, tuple[Any, dict[Page, int]]] = {}
        for page, old, _ in moved:
            by_owner.setdefault(id(page.owner), (page.owner, {}))[1][page] = old
        for owner, moves in by_owner.values():
            owner.pages_moved(moves)

    def _compaction_targets(self, two_ended: bool) -> dict[Page, int] | None:
        """Each page's offset after compaction, or None when the two ends would overlap. The
        pages of one ``contiguous`` allocation move as one unit, so they stay back to back."""
        units: list[list[Page]] = []
        for page in sorted(self.pages, key=lambda page: page.offset):
            if page.run is not None and units and units[-1][0] is page.run:
                units[-1].append(page)
            else:
                units.append([page])
        down = [unit for unit in units if not two_ended or unit[0].kind == "kv"]
        up = [unit for unit in reversed(units) if two_ended and unit[0].kind == "state"]
        targets: dict[Page, int] = {}

        def place(unit: list[Page], start: int) -> None:
            for page in unit:
                targets[page] = start
                start += page.size

        cursor = 0
        for unit in down:
            start = math.ceil(cursor / unit[0].align) * unit[0].align
            place(unit, start)
            cursor = start + sum(page.size for page in unit)
        top = self.capacity
        for unit in up:
            start = (top - sum(page.size for page in unit)) // unit[0].align * unit[0].align
            place(unit, start)
            top = start
        return targets if cursor <= top else None

    def _rebuild_free_extents(self) -> None:
        self.free_extents = []
        cursor = 0
        for page in sorted(self.pages, key=lambda page: page.offset):
            if page.offset > cursor:
                self.free_extents.append((cursor, page.offset))
            cursor = page.end
        if cursor < self.capacity:
            self.free_extents.append((cursor, self.capacity))

    # ----------------------------------------------------------------- private growth
    def reserve(self, key: Any, nbytes: int) -> None:
        """A private arena keeps at least the sum of its reservations (bytes) when it trims, and
        grows to it now; ``nbytes=0`` drops ``key``'s reservation. Fixed arenas ignore it."""
        if not self.growable:
            return
        elements = math.ceil(parse_bytes("nbytes", nbytes) / self.itemsize)
        if elements:
            self.reservations[key] = elements
        else:
            self.reservations.pop(key, None)
        floor = sum(self.reservations.values())
        if floor > self.capacity:
            self._resize(self._round_to_segments(floor))

    def _round_to_segments(self, elements: int) -> int:
        return math.ceil(elements / self.segment) * self.segment

    def _grow_for(self, size: int, count: int, align: int, contiguous: bool) -> None:
        """Grow by the fewest whole segments that make the pages fit: the ones that fit in holes
        below the free tail go there, the rest at the end."""
        tail = self.capacity  # start of the free extent that reaches the end, if any
        holes = self.free_extents
        if holes and holes[-1][1] == self.capacity:
            tail, holes = holes[-1][0], holes[:-1]
        start = math.ceil(tail / align) * align
        if contiguous:
            end = start + size * count
        else:
            fitting = 0
            for hole_start, hole_end in holes:
                offset = math.ceil(hole_start / align) * align
                while offset + size <= hole_end and fitting < count:
                    fitting += 1
                    offset = math.ceil((offset + size) / align) * align
            missing = count - fitting
            end = start + (missing - 1) * math.ceil(size / align) * align + size
        self._resize(self._round_to_segments(max(end, self.capacity + 1)))

    def trim(self) -> None:
        """Give whole empty segments back to torch (private arenas): when a whole segment
        above the pages and reservations (rounded up to segments) is free, compact and shrink
        to the segment above them, so at most the last segment's remainder is held unused.
        Fixed arenas never change size. (Kept at two segments, a 1 MiB segment left an evicting
        SmolLM2 cache holding 1 MiB more than it could use: 3 % of the full KV it replaces.
        A cache's reservation, not this slack, keeps a steady decode from shrinking and growing
        by turns.)"""
        if not self.growable:
            return
        floor = max(sum(self.used.values()), sum(self.reservations.values()))
        if self.capacity - self._round_to_segments(floor) < self.segment:
            return
        # Pages of different alignments can leave gaps that keep the compacted pages in the top
        # segment: such a trim frees nothing, and is not tried again until pages come or go.
        attempt = (len(self.pages), floor, self.capacity)
        if attempt == self._fruitless_trim:
            return
        self.compact(two_ended=False)
        high = max((page.end for page in self.pages), default=0)
        target = self._round_to_segments(max(high, sum(self.reservations.values())))
        if target < self.capacity:
            self._resize(target)
        else:
            self._fruitless_trim = attempt

    def _resize(self, elements: int) -> None:
        """Replace ``buffer`` by one of ``elements`` (pages keep their offsets; all lie below)."""
        high = max((page.end for page in self.pages), default=0)
        assert elements >= high, "a resize would cut a page"
        new = torch.zeros(elements, dtype=self.dtype, device=self.device)
        keep = min(high, elements)
        new[:keep] = self.buffer[:keep]
        # Both buffers are alive during the copy: that is real memory too.
        self.peak_reserved = max(self.peak_reserved, self.capacity + elements)
        old_capacity, self.buffer, self.capacity = self.capacity, new, elements
        if elements > old_capacity:
            self._give(old_capacity, elements)
        else:
            self._rebuild_free_extents()
        self.generation += 1
        for owner in {id(page.owner): page.owner for page in self.pages}.values():
            owner.pages_moved({})

    # ----------------------------------------------------------------- checks
    def check_invariants(self) -> None:
        """Raise AssertionError if A1, A2 or A5 is violated."""
        runs = sorted(
            [(page.offset, page.end, "page") for page in self.pages]
            + [(start, end, "free") for start, end in self.free_extents]
        )
        cursor = 0
        for start, end, _ in runs:
            assert start == cursor, f"A1: gap or overlap at element {cursor} (next run {start})"
            assert end > start, "A1: an empty run"
            cursor = end
        assert cursor == self.capacity, f"A1: runs end at {cursor}, capacity is {self.capacity}"
        for (_, end), (start, _) in zip(self.free_extents, self.free_extents[1:], strict=False):
            assert end < start, "A2: free extents touch or are unsorted"
        for kind in PAGE_KINDS:
            held = sum(page.size for page in self.pages if page.kind == kind)
            assert held == self.used[kind], (
                f"A5: {kind} pages hold {held}, counted {self.used[kind]}"
            )
        for page in self.pages:
            assert page.offset % page.align == 0, f"{page!r} lost its alignment"
        assert self.buffer.numel() == self.capacity


class ArenaBlockPool(BlockPool):
    """A ``BlockPool`` whose blocks are "kv" pages of an arena.

    Every block of this geometry is viewed in place: ``buffer[: n * E]`` as
    ``[n, block_size, 2, heads, head_dim]`` (E = block_size * 2 * heads * head_dim elements), so
    ``key = view[:, :, 0]`` and ``value = view[:, :, 1]`` are ``[n, block_size, heads, head_dim]``
    with one slot ``block * block_size + offset`` per token, exactly as ``BlockPool``'s. A block id
    is ``page.offset // E``; pages are aligned to E, so ids are exact. When the arena moves pages,
    the pool renames their blocks and tells its listeners ``{old block: new block}`` (the token
    tables holding them)."""

    def __init__(self, arena: KVArena, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        if not isinstance(arena, KVArena):
            raise InvalidArgumentError(f"arena must be a KVArena, got {type(arena).__name__}")
        self.arena = arena
        self.block_size = check_positive_int("block_size", block_size)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.block_elements = block_size * 2 * num_kv_heads * head_dim
        self.block_bytes = self.block_elements * arena.itemsize
        self.pages: dict[int, Page] = {}  # block id -> its page
        self.ref_counts: dict[int, int] = {}
        self.listeners: list[Callable[[dict[int, int]], None]] = []
        # Told (kind, +/- bytes) whenever this pool takes or returns pages: its cache's ledger.
        self.account: Callable[[str, int], None] | None = None
        self._view_generation = -1

    def __repr__(self) -> str:
        return (
            f"ArenaBlockPool(blocks_held={len(self.pages)}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, arena={self.arena})"
        )

    # ----------------------------------------------------------------- views
    def _refresh(self) -> None:
        if self._view_generation == self.arena.generation:
            return
        n = self.arena.capacity // self.block_elements
        # [n * E] -> [n, block_size, 2 (K, V), heads, head_dim]
        blocks = self.arena.buffer[: n * self.block_elements].view(
            n, self.block_size, 2, self.num_kv_heads, self.head_dim
        )
        self._key, self._value = blocks[:, :, 0], blocks[:, :, 1]
        self._view_generation = self.arena.generation

    @property
    def key(self) -> torch.Tensor:
        self._refresh()
        return self._key

    @property
    def value(self) -> torch.Tensor:
        self._refresh()
        return self._value

    @property
    def num_blocks(self) -> int:
        return self.arena.capacity // self.block_elements

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks of this geometry that fit in the arena's free space now."""
        count = 0
        for start, end in self.arena.free_extents:
            first = math.ceil(start / self.block_elements)
            count += max(0, end // self.block_elements - first)
        return count

    @property
    def free_blocks(self) -> list[int]:
        return [
            block
            for start, end in self.arena.free_extents
            for block in range(math.ceil(start / self.block_elements), end // self.block_elements)
        ]

    def can_allocate(self, n: int) -> bool:
        return self.arena.fits(self.block_elements, n, self.block_elements)

    # ----------------------------------------------------------------- allocation
    def reserve(self, n: int) -> None:
        """Make room for ``n`` more blocks now (compacting or growing the arena), or raise
        ``ArenaExhausted`` changing nothing."""
        if n and not self.can_allocate(n):
            self.free(self.allocate(n))  # compaction / growth happen inside; then give back

    def allocate(self, n: int) -> list[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"n must be a non-negative integer, got {n!r}")
        pages = self.arena.allocate(self, "kv", self.block_elements, n, align=self.block_elements)
        blocks = []
        for page in pages:
            block = page.offset // self.block_elements
            self.pages[block] = page
            self.ref_counts[block] = 1
            blocks.append(block)
        if self.account is not None:
            self.account("kv", len(pages) * self.block_bytes)
        return blocks

    def grow(self, num_new_blocks: int) -> None:
        raise InvalidArgumentError("an ArenaBlockPool does not grow; its arena does (reserve)")

    def free(self, blocks: Iterable[int]) -> None:
        if not isinstance(blocks, Iterable) or isinstance(blocks, (str, bytes)):
            raise InvalidDTypeError(f"blocks must be an iterable of block ids, got {blocks!r}")
        blocks = list(blocks)
        self._check_allocated("blocks", blocks)
        released = []
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                del self.ref_counts[block]
                released.append(self.pages.pop(block))
        self.arena.free(released)
        if self.account is not None and released:
            self.account("kv", -len(released) * self.block_bytes)

    def share(self, block: int) -> None:
        self._check_allocated("block", [block])
        self.ref_counts[block] += 1

    def _check_allocated(self, name: str, blocks: list[int]) -> None:
        drops: dict[int, int] = {}
        for block in blocks:
            if isinstance(block, bool) or not isinstance(block, int):
                raise InvalidDTypeError(f"{name} must hold int block ids, got {block!r}")
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self.ref_counts.get(block, 0):
                raise DoubleFreeError(
                    f"{name} names block {block}, which has {self.ref_counts.get(block, 0)} "
                    f"owner(s) in this pool and is named {drops[block]} time(s)"
                )

    def release_all(self) -> None:
        """Return every block this pool holds to the arena."""
        self.free([block for block, count in self.ref_counts.items() for _ in range(count)])

    @property
    def bytes_used(self) -> int:
        return len(self.pages) * self.block_bytes

    # ----------------------------------------------------------------- the arena moved pages
    def pages_moved(self, moves: dict[Page, int]) -> None:
        if not moves:
            return  # buffer replaced: views are rebuilt on next use (generation changed)
        renamed = {
            old // self.block_elements: page.offset // self.block_elements
            for page, old in moves.items()
        }
        pages = {renamed.get(block, block): page for block, page in self.pages.items()}
        counts = {renamed.get(block, block): count for block, count in self.ref_counts.items()}
        self.pages, self.ref_counts = pages, counts
        for listener in self.listeners:
            listener(renamed)
