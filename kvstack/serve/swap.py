"""``HostSwap``: the host tier a preempted request's pages move to instead of being recomputed.

When the device arena runs out mid-decode, the engine preempts a request: the newest, or with
a swap tier the one its batch rule picks (``choose_victim``) where the rule defines that. Without
a swap tier the request's pages are dropped and it computes its prompt and outputs again later.
With one (``Engine(..., swap_bytes=...)``) its pages are copied to a host arena and the
request stays running but not resident: the batch rule sees its work as ``resident=False``
with the bytes it would fetch (``Work.fetch_bytes``), and when a step takes that work the
pages are copied back first. vLLM calls the two remedies recompute and swap.

Each move is copy-then-switch, so a failure part-way loses nothing:

* **out**: take host pages (all or none), copy every device page into them, and only then
  release the device pages. No room on the host: the request is recomputed instead.
* **in**: take device pages (all or none), copy, then free the host pages. No room on the
  device: nothing moved and the request stays on the host.

The host tier is a ``KVArena`` of ``capacity`` bytes on the CPU (pinned when the device is
CUDA, so the copies can use DMA), so its memory is real bytes, allocated once. Only the
lossless stacked store (``StackedKV``: one page holds ``block_size`` tokens of every layer
side by side) is swapped; a page moves as one contiguous run of arena elements.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvstack.arena import KVArena, Page
from kvstack.errors import ArenaExhausted, InvalidArgumentError
from kvstack.serve.stacked_kv import StackedKV


@dataclass(eq=False)
class SwappedKV:
    """A request's K/V while it lives on the host: its host pages, in token order, and how
    many tokens they hold."""

    pages: list[Page]
    tokens: int
    page_bytes: int  # device bytes of one page (every layer's block of ``block_size`` tokens)

    @property
    def nbytes(self) -> int:
        """Device bytes its swap-in takes and fetches."""
        return len(self.pages) * self.page_bytes

    def pages_moved(self, moves: dict[Page, int]) -> None:
        """The host arena compacted: the page objects hold their new offsets, nothing to do."""


@dataclass
class SwapStats:
    """What the swap tier moved, in bytes and moves, and the seconds spent copying (the engine
    waits for every copy: on CPU they cannot overlap a forward pass)."""

    bytes_out: int = 0  # device -> host
    bytes_in: int = 0  # host -> device
    swaps_out: int = 0
    swaps_in: int = 0
    refused_out: int = 0  # preemptions the host could not hold: recomputed instead
    copy_seconds: float = 0.0
    peak_host_bytes: int = field(default=0)


class HostSwap:
    """The host tier of one engine: ``capacity`` (bytes or a string such as ``"2GiB"``) of
    host memory in the device arena's dtype."""

    def __init__(self, capacity: int | str, device_arena: KVArena) -> None:
        self.device_arena = device_arena
        self.arena = KVArena(capacity, device="cpu", dtype=device_arena.dtype)
        if device_arena.device.type == "cuda":
            # Pinned host memory: copies to and from it run by DMA (the tiers' host arena too).
            self.arena.buffer = self.arena.buffer.pin_memory()
        self.stats = SwapStats()

    def __repr__(self) -> str:
        return f"HostSwap({self.arena!r})"

    @property
    def bytes_used(self) -> int:
        return self.arena.bytes_used

    def swap_out(self, store: StackedKV) -> SwappedKV | None:
        """Move ``store``'s pages to the host and release them on the device (``store`` is then
        empty); None, with nothing changed, when the host cannot hold them."""
        size = store.layers * store.block_elements  # one page: every layer's block, side by side
        count = -(-store.tokens // store.block_size)  # the pages its tokens fill
        swapped = SwappedKV([], store.tokens, store.page_bytes)
        try:
            swapped.pages = self.arena.allocate(swapped, "kv", size, count)
        except ArenaExhausted:
            self.stats.refused_out += 1
            return None
        started = time.perf_counter()
        source, target = self.device_arena.buffer, self.arena.buffer
        try:
            with torch.no_grad():
                for device_page, host_page in zip(store.pages[:count], swapped.pages, strict=True):
                    target[host_page.offset : host_page.end].copy_(
                        source[device_page.offset : device_page.end]
                    )
        except BaseException:
            self.free(swapped)  # the device pages are untouched: nothing moved
            raise
        self.stats.copy_seconds += time.perf_counter() - started
        moved = swapped.nbytes
        store.release()  # only now: the host copy is complete
        self.stats.bytes_out += moved
        self.stats.swaps_out += 1
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.arena.bytes_used)
        return swapped

    def swap_in(self, swapped: SwappedKV, store: StackedKV) -> None:
        """Copy ``swapped`` into ``store`` (an empty store on the device arena) and free its host
        pages. ``ArenaExhausted``, with nothing changed, when the device cannot hold them."""
        if store.tokens or store.pages:
            raise InvalidArgumentError(f"store must be empty to swap into, got {store!r}")
        store.reserve(swapped.tokens)  # all or none
        started = time.perf_counter()
        source, target = self.arena.buffer, self.device_arena.buffer
        try:
            with torch.no_grad():
                for host_page, device_page in zip(swapped.pages, store.pages, strict=True):
                    target[device_page.offset : device_page.end].copy_(
                        source[host_page.offset : host_page.end]
                    )
        except BaseException:
            store.release()  # the host copy is untouched: the request stays swapped
            raise
        self.stats.copy_seconds += time.perf_counter() - started
        store.tokens = swapped.tokens
        fetched = swapped.nbytes
        self.free(swapped)
        self.stats.bytes_in += fetched
        self.stats.swaps_in += 1

    def free(self, swapped: SwappedKV) -> None:
        """Return ``swapped``'s host pages (a cancelled request's, or after ``swap_in``)."""
        if swapped.pages:
            self.arena.free(swapped.pages)
        swapped.pages = []


__all__ = ["HostSwap", "SwapStats", "SwappedKV"]
