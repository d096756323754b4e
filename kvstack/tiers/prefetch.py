"""Fetch the pages the next layer will read while the current layer computes (KVDrive).

``Prefetcher.prefetch(keys)`` hands the pages to a worker thread as one task (a layer's pages:
one queue hand-off, not one per page), which reads them in order, each from the fastest tier
holding it (a disk read checks its checksum), copies it to the device (on a CPU device, a page
read from host or disk is already there) and completes that page's future before it starts the
next.
``take(key)`` returns the page for attention; it waits for that page's fetch to complete first,
so **no page is read before its copy completes** (vToken's I3, across tiers). On CUDA the copy
runs on a side stream and ``take`` makes the compute stream wait on its event; on CPU the
worker's copy is complete when its future is.

Accounting: ``transfer_seconds`` is the time fetches took (on the workers, or on the caller for
a page that was not prefetched); ``stall_seconds`` is the time the caller waited for them. The
overlap fraction, 1 − stall ÷ transfer, is the share of transfer time hidden behind compute.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvstack.tiers.disk import Page, page_nbytes
from kvstack.tiers.store import TieredStore, check_count


def check_worker_count(workers: object, name: str) -> None:
    """Raise unless ``workers`` (the argument called ``name``) is a whole number >= 0."""
    check_count(name, workers, "0: fetch each page when it is read, on the thread that reads it")


class Prefetcher:
    """``workers`` threads fetch ahead; with ``workers=0`` nothing is fetched ahead: each page is
    fetched by the thread that takes it, when it takes it (no overlap, and no second thread
    competing with the model's for the GIL and the core)."""

    def __init__(self, store: TieredStore, device: str | torch.device, workers: int = 1) -> None:
        check_worker_count(workers, "workers")
        self.store = store
        self.device = torch.device(device)
        self._pool = (
            ThreadPoolExecutor(workers, thread_name_prefix="kvstack-prefetch") if workers else None
        )
        self._pending: dict[str, Future] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.transfer_seconds = 0.0
        self.stall_seconds = 0.0
        self.bytes_fetched: Counter[str] = Counter()  # source tier -> bytes brought to the device

    def prefetch(self, keys: list[str]) -> None:
        """Start fetching ``keys`` on a worker, in this order: those not already pending and not
        on the device (``take_all`` reads those in place; one demoted meanwhile is fetched by
        ``take`` when it is read)."""
        if self._pool is None:  # no workers: take fetches each page when it is read
            return
        resident = self.store.device_pages(keys)
        batch = []
        for key in keys:
            if key not in self._pending and key not in resident:
                future: Future = Future()
                self._pending[key] = future
                batch.append((key, future))
        if not batch:
            return
        try:
            self._pool.submit(self._fetch_batch, batch)
        except BaseException as error:  # a closed pool: nobody would complete these futures
            for key, future in batch:
                del self._pending[key]
                future.set_exception(error)
            raise

    def forget(self, keys: set[str] | list[str]) -> None:
        """Stop waiting for ``keys`` (pages dropped from every tier since they were handed
        out: their fetches complete or fail on the worker, and nobody takes them)."""
        for key in keys:
            self._pending.pop(key, None)

    def _fetch_batch(self, batch: list[tuple[str, Future]]) -> None:
        for key, future in batch:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._fetch(key))
            except BaseException as error:  # the page's taker gets it (or drain forgets it)
                future.set_exception(error)

    def take(self, key: str) -> tuple[Page, str]:
        """The page on the device, once its copy is complete, and the tier it came from; counts
        the read in the store."""
        page, tier = self._wait(key)
        self.store.touch(key, tier)
        return page, tier

    def _wait(self, key: str) -> tuple[Page, str]:
        """``take`` without counting the read in the store."""
        future = self._pending.pop(key, None)
        start = time.perf_counter()
        if future is None:  # not prefetched: the caller fetches it and waits for all of it
            page, tier, event, _ = self._fetch(key)
            seconds = time.perf_counter() - start
            self.transfer_seconds += seconds
        else:
            page, tier, event, seconds = future.result()
            self.transfer_seconds += seconds
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for tensor in page.values():  # made on the side stream, freed after the compute
                tensor.record_stream(compute)  # stream's use: the allocator must wait for it
        self.stall_seconds += time.perf_counter() - start
        if tier != "device":
            self.bytes_fetched[tier] += page_nbytes(page)
        return page, tier

    def take_all(self, keys: list[str]) -> list[tuple[Page, str]]:
        """``take`` of every key, in order. Pages the device tier holds and nobody prefetched
        are read under one acquisition of the store's lock (a layer reads dozens of them each
        step; no transfer, so no transfer time); the reads are counted under one more, the
        fetched pages' first, then the resident ones (the order ``take`` page by page gave)."""
        resident = self.store.device_pages([k for k in keys if k not in self._pending])
        taken = [(resident[k], "device") if k in resident else self._wait(k) for k in keys]
        fetched = [(k, tier) for k, (_, tier) in zip(keys, taken, strict=True) if k not in resident]
        self.store.touch_reads(fetched + [(k, "device") for k in resident])
        return taken

    def _fetch(self, key: str) -> tuple[Page, str, torch.cuda.Event | None, float]:
        start = time.perf_counter()
        page, tier = self.store.peek(key)
        event = None
        if self._stream is not None and tier != "device":
            with torch.cuda.stream(self._stream):
                page = {n: t.to(self.device, non_blocking=True) for n, t in page.items()}
                event = torch.cuda.Event()
                event.record(self._stream)
        elif tier != "device" and self.device.type != "cpu":
            page = {n: t.to(self.device) for n, t in page.items()}
        # On a CPU device the host and disk tiers' tensors are already where attention reads
        # them (a copy would change nothing, and its calls cost the worker the GIL twice).
        return page, tier, event, time.perf_counter() - start

    @property
    def overlap_fraction(self) -> float:
        """Share of transfer time hidden behind compute (1.0 when nothing was transferred)."""
        if self.transfer_seconds == 0:
            return 1.0
        return max(0.0, 1.0 - self.stall_seconds / self.transfer_seconds)

    def drain(self) -> None:
        """Wait for every pending fetch and forget it (a reset: nothing will take them). A fetch
        that failed (a page deleted or corrupt meanwhile) is forgotten with its error: the page
        is not used, and a later read of it raises again."""
        wait(list(self._pending.values()))
        self._pending.clear()

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
