"""Pages across three tiers: device memory, host memory and disk (PersistentKV / KVDrive).

Every page has one **home** tier and may have **copies** in others (a prefetched page is a copy
on device of a page whose home is host or disk). The rules that keep a page from being lost:

* **Copy, then switch.** A move writes the page to its new tier first, and only once that write
  has completed does the page's home change and the old bytes go. A failure mid-move (a full
  disk, a killed process) leaves the page at its old home, whole.
* **Copies go before homes.** Making room in a tier drops copies first (their home still holds
  the page), then demotes homed pages one tier down in the order of the store's eviction rule
  (``kvstack.tiers.eviction``). A page is never dropped from its last tier, unless the store
  was built with ``may_drop=True`` (lossless recompute: its owner can compute a dropped KV page
  again from its tokens). Then the lowest tier on makes room by **dropping** pages in the
  rule's order (``demote_to=None``: the rule prices recomputing them); only KV pages
  (``tokens > 0``) are dropped, and the store remembers what it knew of each (``dropped``).
* **A save's pages stay on disk.** ``keep_on_disk`` names the pages whose files a saved
  conversation needs (``TieredCache.save`` sets it). Their disk files are not dropped as copies
  to make room, and a move up keeps the file as a copy: a disk too full for anything else
  raises ``TierFull`` instead of breaking the save. With ``may_drop`` they are dropped last,
  after every other KV page (the save then resumes only by recomputing what was dropped).
* **Reads are checked.** Pages read from disk are verified against their checksum
  (``DiskTier``); a corrupt page raises ``PageCorrupted`` and is never returned.

Budgets are bytes: ``device_bytes`` and ``host_bytes`` of page tensors, ``disk_bytes`` of page
files. The host tier's tensors are pinned when the device is CUDA, so device copies can be
asynchronous. ``stats()`` reports what each tier holds, the bytes moved between each pair of
tiers and the reads served by each tier.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from kvstack.errors import InvalidArgumentError, TierFull
from kvstack.tiers.disk import DiskTier, Page, check_key, encode_page, page_nbytes
from kvstack.tiers.eviction import LRU, TIERS, EvictionRule, PageInfo


def _locked(method):
    """Run ``method`` holding the store's lock: a prefetch worker reads pages while the model's
    thread stores and demotes them."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class TieredStore:
    """Pages (dicts of named tensors) with one home tier each and any number of copies.

    Budgets: ``device_bytes`` and ``host_bytes`` of page tensors, ``disk_bytes`` of page files
    under ``disk_path``; 0 switches a tier off. ``rule`` ranks a full tier's pages for demotion
    (default ``LRU``). Methods that make room take ``protect``: a page that must not leave (the
    one being written). Thread-safe: every method that reads or changes the pages holds
    ``lock`` (an ``RLock``; the queries ``bytes_used``, ``bytes_free`` and ``tiers_of`` are
    for callers that hold it, or that tolerate a page moving meanwhile)."""

    def __init__(
        self,
        *,
        device_bytes: int,
        host_bytes: int,
        disk_path: str | os.PathLike | None = None,
        disk_bytes: int = 0,
        device: str | torch.device = "cpu",
        rule: EvictionRule | None = None,
        min_page_bytes: int = 1,
        min_page_file_bytes: int | None = None,
        may_drop: bool = False,
    ) -> None:
        """``min_page_bytes``: the smallest page the caller will store; a memory budget that
        cannot hold one (other than a zero budget, which switches the tier off) is refused.
        ``min_page_file_bytes``: the same for the disk budget, in bytes of a page's file
        (``page_file_bytes``: its header and checksum besides its tensors; default
        ``min_page_bytes``). ``may_drop``: the lowest tier on drops KV pages when full (see the
        module docstring)."""
        budgets = {"device": device_bytes, "host": host_bytes, "disk": disk_bytes}
        minimum = {"device": min_page_bytes, "host": min_page_bytes}
        minimum["disk"] = min_page_bytes if min_page_file_bytes is None else min_page_file_bytes
        for tier, budget in budgets.items():
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
                raise InvalidArgumentError(
                    f"{tier}_bytes={budget!r}; expected a non-negative number of bytes"
                )
            if 0 < budget < minimum[tier]:
                page = "page file" if tier == "disk" else "page"
                raise InvalidArgumentError(
                    f"{tier}_bytes={budget} cannot hold one {page} of {minimum[tier]} bytes; "
                    f"expected 0 (tier off) or at least {minimum[tier]}"
                )
        if not isinstance(may_drop, bool):
            raise InvalidArgumentError(f"may_drop={may_drop!r}; expected a bool")
        if disk_bytes and disk_path is None:
            raise InvalidArgumentError(f"disk_bytes={disk_bytes} needs a disk_path; got None")
        self.device = torch.device(device)
        self.capacity = budgets
        self.disk = DiskTier(disk_path, disk_bytes) if disk_bytes else None
        self.rule: EvictionRule = rule if rule is not None else LRU()
        self._memory: dict[str, dict[str, Page]] = {"device": {}, "host": {}}  # tier -> key -> page
        self._used = {"device": 0, "host": 0}
        self.pages: dict[str, PageInfo] = {}
        self.may_drop = may_drop
        self.dropped: dict[str, PageInfo] = {}  # dropped from every tier, as they were known
        self.drops = 0  # pages dropped so far
        # Pages being copied -> copies in progress (a copy's room-making can copy the same page
        # again, a demotion): the room a copy needs may demote them, never drop them.
        self._copying: Counter[str] = Counter()
        self.keep_on_disk: set[str] = set()  # pages a save in force needs on disk (see above)
        self.clock = 0  # advanced by every read (and ``tick``): the rules' notion of time
        self.bytes_moved: Counter[str] = Counter()  # "device->host" -> bytes
        self.hits: Counter[str] = Counter()  # tier that served a read -> reads
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ queries
    def bytes_used(self, tier: str) -> int:
        return self.disk.bytes_used if tier == "disk" and self.disk else self._used.get(tier, 0)

    def bytes_free(self, tier: str) -> int:
        return self.capacity[tier] - self.bytes_used(tier)

    def tiers_of(self, key: str) -> list[str]:
        """The tiers holding ``key``, fastest first."""
        info = self._info(key)
        return [t for t in TIERS if t == info.home or t in info.copies]

    @_locked
    def stats(self) -> dict[str, Any]:
        return {
            "pages": len(self.pages),
            "bytes_used": {t: self.bytes_used(t) for t in TIERS},
            "capacity_bytes": dict(self.capacity),
            "pages_homed": {t: sum(p.home == t for p in self.pages.values()) for t in TIERS},
            "bytes_moved": dict(self.bytes_moved),
            "hits": {t: self.hits[t] for t in TIERS},
            "pages_dropped": len(self.dropped),
            "drops": self.drops,
            # Host memory the disk tier keeps for its reads, outside every tier's budget.
            "disk_read_buffer_bytes": (
                self.disk.read_buffers.held_bytes if self.disk is not None else 0
            ),
        }

    # ------------------------------------------------------------------ writes
    @_locked
    def put(
        self, key: str, page: Page, *, tier: str = "device", position: int = 0, tokens: int = 0
    ) -> None:
        """Store a new page with its home in ``tier``, demoting others if the tier is full.
        ``position`` and ``tokens`` (its first token's position and how many it holds) let the
        cost-aware rule price recomputing it. Raises ``TierFull`` when ``make_room`` cannot free
        the page's bytes: the page is not stored, and what was demoted or dropped on the way
        stays so (whole, or in ``dropped``)."""
        check_key(key)
        self._check_tier(tier)
        if (
            not isinstance(page, dict)
            or not page
            or not all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in page.items())
        ):
            raise InvalidArgumentError(
                f"page for {key!r} is {type(page).__name__} {page!r:.80}; expected a non-empty "
                "dict of name -> tensor"
            )
        if key in self.pages or key in self.dropped:
            raise InvalidArgumentError(f"page key {key!r} is already stored; expected a new key")
        check_count("position", position)
        check_count("tokens", tokens)
        info = PageInfo(key, page_nbytes(page), tier, position=position, tokens=tokens)
        info.stored_at = info.last_used = self.clock
        self._write(tier, info, page)
        self.pages[key] = info

    def get(self, key: str) -> tuple[Page, str]:
        """The page and the tier that served it (the fastest holding it); counts a hit there.
        (Not atomic with other threads' moves: the page may change tier between the read and
        the count; the bytes returned are the page's either way.)"""
        page, tier = self.peek(key)
        self.touch(key, tier)
        return page, tier

    def peek(self, key: str) -> tuple[Page, str]:
        """``get`` without counting the read (a prefetch: ``touch`` counts it when it is used).
        Pages from host or disk are on the CPU; the caller copies them where it needs them and
        never changes the tensors (memory tiers hand out their own). Only finding the page holds
        the lock: a disk page's file is opened under it and read and checked after, so a
        prefetch worker's disk read does not stall the thread that runs the model."""
        with self.lock:
            tier = self.tiers_of(key)[0]
            if tier != "disk":
                return self._read(tier, key), tier
            handle = self.disk.open(key)
        return self.disk.read_opened(key, handle), tier

    @_locked
    def homes(self, keys: list[str]) -> dict[str, str | None]:
        """Each key's home tier (None: dropped from every tier), under one lock."""
        return {key: None if key in self.dropped else self._info(key).home for key in keys}

    @_locked
    def dropped_among(self, keys: list[str]) -> set[str]:
        """The keys among ``keys`` that were dropped from every tier, under one lock."""
        return {key for key in keys if key in self.dropped}

    @_locked
    def device_pages(self, keys: list[str]) -> dict[str, Page]:
        """The device tier's pages among ``keys`` (homes and copies), under one lock."""
        device = self._memory["device"]
        return {key: device[key] for key in keys if key in device}

    @_locked
    def touch_reads(self, reads: list[tuple[str, str]]) -> None:
        """``touch`` of every (key, tier) read, in order, under one lock (a layer's fetched
        pages: one acquisition per layer, not one per page, on the thread that runs the
        model)."""
        for key, tier in reads:
            self.touch(key, tier)

    @_locked
    def tick(self) -> int:
        """Advance the clock without a read: an event the rules should see as later than every
        read and write before it (``TurnStore`` ticks once per turn it saves, so pages saved
        later are newer). Returns the new time."""
        self.clock += 1
        return self.clock

    @_locked
    def mark_used(self, keys: list[str]) -> None:
        """Set the pages' last use to now without counting a read (their owner used them
        without reading them: ``TurnStore`` marks a conversation's pages when it saves a turn,
        so they share one time)."""
        for key in keys:
            self._info(key).last_used = self.clock

    @_locked
    def touch(self, key: str, tier: str) -> None:
        """Count a read of ``key`` served by ``tier``: the rules' recency and use counts."""
        info = self._info(key)
        self.clock += 1
        info.last_used, info.uses = self.clock, info.uses + 1
        self.hits[tier] += 1

    @_locked
    def adopt_disk_page(self, key: str, nbytes: int, *, position: int = 0, tokens: int = 0) -> None:
        """Name a page already on the disk tier (written by an earlier process) as homed there;
        ``nbytes``: its tensors' bytes, what a memory tier will hold for it."""
        if self.disk is None or key not in self.disk:
            where = "the disk tier is off" if self.disk is None else f"in {str(self.disk.path)!r}"
            raise KeyError(
                f"page {key!r} has no file on the disk tier ({where}); adopt_disk_page expects a "
                "page an earlier process wrote there"
            )
        if key in self.pages:
            raise InvalidArgumentError(f"page key {key!r} is already stored; expected a new key")
        check_count("position", position)
        check_count("tokens", tokens)
        info = PageInfo(key, nbytes, "disk", position=position, tokens=tokens)
        info.stored_at = info.last_used = self.clock
        self.pages[key] = info

    @_locked
    def copy(self, key: str, tier: str) -> None:
        """Add a copy of ``key`` in ``tier`` (a prefetch); its home does not change."""
        self._check_tier(tier)
        info = self._info(key)
        if tier in self.tiers_of(key):
            return
        source = self.tiers_of(key)[0]
        page = self._read(source, key)
        # (Making room may demote the source page itself meanwhile; the move is counted from
        # where its bytes were read.)
        self._copying[key] += 1
        try:
            self._write(tier, info, page, protect=key)
        finally:
            self._copying[key] -= 1
            if not self._copying[key]:
                del self._copying[key]
        info.copies.add(tier)
        self.bytes_moved[f"{source}->{tier}"] += info.nbytes

    @_locked
    def move(self, key: str, tier: str) -> None:
        """Make ``tier`` the page's home: copy, then switch, then drop the old home's bytes."""
        self._check_tier(tier)
        info = self._info(key)
        if info.home == tier:
            return
        self.copy(key, tier)  # the write that can fail; until it completes nothing changed
        old = info.home
        info.copies.discard(tier)
        info.home = tier
        if old == "disk" and key in self.keep_on_disk:
            info.copies.add(old)  # a save in force reads this file
        else:
            self._erase_old_home(info, old)

    @_locked
    def promote(self, key: str, page: Page) -> str | None:
        """Move the page's home up to the fastest tier with free room for it, from ``page``
        (its bytes, already read), demoting nothing; returns the new home (None: no room). A
        page leaving disk keeps its file as a copy (a later save need not write it again)."""
        info = self._info(key)
        info.nbytes = page_nbytes(page)  # the bytes in hand (a resumed page's are estimated)
        for tier in TIERS[: TIERS.index(info.home)]:
            if tier not in info.copies:
                if self.capacity[tier] == 0 or self.bytes_free(tier) < info.nbytes:
                    continue
                self._write(tier, info, page)
                self.bytes_moved[f"{info.home}->{tier}"] += info.nbytes
            old = info.home
            info.copies.discard(tier)
            info.home = tier
            if old == "disk":
                info.copies.add(old)
            else:
                self._erase_old_home(info, old)
            return tier
        return None

    @_locked
    def promote_all(self, pages: list[tuple[str, Page]]) -> None:
        """``promote`` of every (key, page), in order, under one lock."""
        for key, page in pages:
            self.promote(key, page)

    @_locked
    def drop_copy(self, key: str, tier: str) -> None:
        info = self._info(key)
        if tier in info.copies:
            self._erase(tier, key)  # first: a failed unlink leaves the copy named and whole
            info.copies.discard(tier)

    @_locked
    def delete(self, key: str) -> None:
        """Forget ``key``: its bytes leave every tier (a dropped page's record goes)."""
        if self.dropped.pop(key, None) is not None:  # no tier holds it
            self.keep_on_disk.discard(key)
            return
        info = self._info(key)
        self._erase_everywhere(info)  # may raise (a failed unlink): then nothing changed
        del self.pages[key]
        self.keep_on_disk.discard(key)

    @_locked
    def forget_dropped(self, key: str) -> PageInfo:
        """Take ``key``'s record out of ``dropped`` (its K/V is about to be stored again) and
        return it, for ``restore_dropped`` if that store fails."""
        if key not in self.dropped:
            raise KeyError(f"page {key!r} is not dropped; forget_dropped expects a dropped page")
        return self.dropped.pop(key)

    @_locked
    def restore_dropped(self, info: PageInfo) -> None:
        """Put back a record ``forget_dropped`` returned: the page is dropped again, as before."""
        if info.key in self.pages or info.key in self.dropped:
            raise InvalidArgumentError(
                f"page {info.key!r} is stored or dropped already; restore_dropped expects a "
                "record forget_dropped took out"
            )
        self.dropped[info.key] = info

    @_locked
    def drop(self, key: str) -> None:
        """Remove a KV page from every tier, remembering it in ``dropped`` (``may_drop``
        stores only: their owner recomputes it from its tokens when it is read)."""
        info = self._info(key)
        if not self.may_drop or not info.tokens:
            raise InvalidArgumentError(
                f"page {key!r} cannot be dropped: the store was built with may_drop="
                f"{self.may_drop} and the page holds {info.tokens} tokens; expected may_drop=True "
                "and a KV page (tokens > 0)"
            )
        self._erase_everywhere(info)  # may raise (a failed unlink): then nothing changed
        del self.pages[key]
        info.copies = set()
        self.dropped[key] = info
        self.drops += 1

    @_locked
    def observe_attention(self, key: str, mass: float, decay: float = 0.5) -> None:
        """Fold a step's attention mass on the page's tokens into its running average (a
        dropped page's too: its record is kept)."""
        info = self.dropped[key] if key in self.dropped else self._info(key)
        info.attention = decay * info.attention + (1 - decay) * float(mass)

    @_locked
    def place(self, ranked: list[str]) -> None:
        """Placement by importance (SnapKV-style, at prefill): the pages of ``ranked``, most
        important first, fill the device tier, then host, and the rest stay where they are or
        go lower. Each page that must rise is moved (copy, then switch; one that cannot, because
        the tiers below are too full to take what it displaces, stays whole where it is). While
        this runs, the room a move needs is made by demoting the least important pages first,
        so a page is never pushed down by a less important one. Pages not in ``ranked`` count
        as least important."""
        for key in ranked:
            if key not in self.dropped:
                self._info(key)
        order = {key: index for index, key in enumerate(ranked)}
        rule, self.rule = self.rule, _ByImportance(order)
        try:
            filled = dict.fromkeys(TIERS, 0)
            for key in ranked:
                if key in self.dropped:  # dropped while making room for a page before it
                    continue
                info = self._info(key)
                target = next(
                    (t for t in ("device", "host") if filled[t] + info.nbytes <= self.capacity[t]),
                    None,
                )
                if target is None:  # below host: wherever demotion leaves it
                    continue
                filled[target] += info.nbytes
                if TIERS.index(target) < TIERS.index(info.home):
                    try:
                        self.move(key, target)
                    except TierFull:  # no room below for what it displaces: it stays, whole
                        continue
        finally:
            self.rule = rule

    @_locked
    def make_room(self, tier: str, nbytes: int, protect: str | None = None) -> None:
        """Free ``nbytes`` in ``tier``: drop copies there, then demote homed pages one tier down
        in the rule's order (from the lowest tier on, with ``may_drop``: drop its KV pages).
        Raises ``TierFull`` when even that cannot free them (pages demoted on the way stay
        demoted, whole)."""
        if nbytes > self.capacity[tier]:
            raise TierFull(
                f"{tier} tier: a page of {nbytes} bytes exceeds its capacity of "
                f"{self.capacity[tier]} bytes"
            )
        kept = self.keep_on_disk if tier == "disk" else set()
        for key in [
            k for k, p in self.pages.items() if tier in p.copies and k != protect and k not in kept
        ]:
            if self.bytes_free(tier) >= nbytes:
                return
            self.drop_copy(key, tier)
        if self.bytes_free(tier) >= nbytes:  # the copies were enough: rank nothing
            return
        # Demote to the next tier that is on (a host tier of 0 bytes sends pages to disk).
        lower = next((t for t in TIERS[TIERS.index(tier) + 1 :] if self.capacity[t] > 0), None)
        if lower is None and self.may_drop:
            self._drop_for_room(tier, nbytes, protect)
            return
        if lower is not None:  # None: nowhere to demote to, so nothing to rank
            homed = [p for p in self.pages.values() if p.home == tier and p.key != protect]
            for victim in self.rule.rank(homed, self.clock, lower):
                if self.bytes_free(tier) >= nbytes:
                    break
                self.move(victim.key, lower)
        if self.bytes_free(tier) < nbytes:
            raise TierFull(
                f"{tier} tier: {nbytes} bytes needed, {self.bytes_free(tier)} of "
                f"{self.capacity[tier]} free after demoting what could go"
            )

    def _drop_for_room(self, tier: str, nbytes: int, protect: str | None) -> None:
        """``make_room`` of the lowest tier by dropping KV pages (their tokens recompute them),
        ranked again after each drop: by the rule's ``rank_drops`` where it has one (what a
        drop costs depends on what was dropped), else by its demotion order. Pages a save keeps
        go last: their disk copies first, then the pages (the save then resumes only with
        ``damaged="recompute"``)."""
        rank_drops = getattr(self.rule, "rank_drops", None)
        while self.bytes_free(tier) < nbytes:
            candidates = self._droppable(tier, protect, kept=False)
            if not candidates:
                kept_copy = next(
                    (
                        k
                        for k in sorted(self.keep_on_disk)
                        if k != protect and k in self.pages and tier in self.pages[k].copies
                    ),
                    None,
                )
                if kept_copy is not None:
                    self.keep_on_disk.discard(kept_copy)
                    self.drop_copy(kept_copy, tier)
                    continue
                candidates = self._droppable(tier, protect, kept=True)
            if not candidates:
                raise TierFull(
                    f"{tier} tier: {nbytes} bytes needed, {self.bytes_free(tier)} of "
                    f"{self.capacity[tier]} free after dropping every KV page that could go"
                )
            if rank_drops is not None:
                ranked = rank_drops(candidates, self.clock, list(self.dropped.values()))
            else:
                ranked = self.rule.rank(candidates, self.clock, None)
            self.keep_on_disk.discard(ranked[0].key)
            self.drop(ranked[0].key)

    def _droppable(self, tier: str, protect: str | None, kept: bool) -> list[PageInfo]:
        """KV pages homed in ``tier`` that may be dropped: not ``protect``, not being copied,
        and kept by a save or not (``kept``)."""
        return [
            p
            for p in self.pages.values()
            if p.home == tier
            and p.key != protect
            and p.tokens
            and p.key not in self._copying
            and (p.key in self.keep_on_disk) == kept
        ]

    # ------------------------------------------------------------------ internals
    def _write(self, tier: str, info: PageInfo, page: Page, protect: str | None = None) -> None:
        if tier == "disk":
            if self.disk is None:
                raise TierFull("disk tier: off (disk_bytes=0); the page was not written")
            data = encode_page(info.key, page)
            if self.disk.bytes_free + self.disk.file_bytes_or_zero(info.key) < len(data):
                self.make_room("disk", len(data), protect or info.key)
            self.disk.write_encoded(info.key, data)
            return
        if self.capacity[tier] == 0:
            raise TierFull(f"{tier} tier: off ({tier}_bytes=0); the page was not written")
        # What the tier will hold is what _erase gives back: the tensors' bytes (a page adopted
        # from disk was named with an estimate, from the saved geometry's dtype).
        info.nbytes = page_nbytes(page)
        if self.bytes_free(tier) < info.nbytes:
            self.make_room(tier, info.nbytes, protect or info.key)
        target = self.device if tier == "device" else torch.device("cpu")
        pin = tier == "host" and self.device.type == "cuda"
        stored = {}
        for name, tensor in page.items():
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=target, pin_memory=pin)
            copy.copy_(tensor)
            stored[name] = copy
        self._memory[tier][info.key] = stored
        self._used[tier] += info.nbytes

    def _read(self, tier: str, key: str) -> Page:
        if tier == "disk":
            return self.disk.read(key)  # checksum-verified
        return self._memory[tier][key]

    def _erase(self, tier: str, key: str) -> None:
        if tier == "disk":
            self.disk.delete(key)  # can fail (OSError); the memory tiers' pops cannot
            return
        page = self._memory[tier].pop(key)
        self._used[tier] -= page_nbytes(page)

    def _erase_everywhere(self, info: PageInfo) -> None:
        """Erase the page's bytes from its home and every copy; the caller unnames it after.
        The disk file goes first: it is the only erase that can fail (an unlink's
        ``OSError``), and failing first leaves every tier holding the page as before, never a
        page whose home or copy points at bytes already gone."""
        tiers = (info.home, *info.copies)
        if "disk" in tiers:
            self._erase("disk", info.key)
        for tier in tiers:
            if tier != "disk":
                self._erase(tier, info.key)

    def _erase_old_home(self, info: PageInfo, old: str) -> None:
        """Erase the bytes a move or promotion left at the page's old home (its new home holds
        it already). If that fails (an unlink's ``OSError``), the bytes stay as a copy, named
        and counted, and the error goes on to the caller."""
        try:
            self._erase(old, info.key)
        except BaseException:
            info.copies.add(old)
            raise

    def _info(self, key: str) -> PageInfo:
        try:
            return self.pages[key]
        except KeyError:
            raise KeyError(f"page {key!r} is not stored") from None

    def _check_tier(self, tier: str) -> None:
        if tier not in TIERS:
            raise InvalidArgumentError(f"tier={tier!r}; expected one of {TIERS}")

    def check(self) -> None:
        """The store's invariants (for tests): every page is whole in its home and copies, no
        tier holds a page the store does not name, and no tier is over its budget."""
        for tier in ("device", "host"):
            named = {k for k, p in self.pages.items() if tier == p.home or tier in p.copies}
            assert set(self._memory[tier]) == named, (tier, set(self._memory[tier]), named)
            assert self._used[tier] == sum(page_nbytes(p) for p in self._memory[tier].values())
            assert self._used[tier] <= self.capacity[tier]
        if self.disk is not None:
            named = {k for k, p in self.pages.items() if "disk" == p.home or "disk" in p.copies}
            assert set(self.disk.keys()) == named, (set(self.disk.keys()), named)
            assert self.disk.bytes_used <= self.capacity["disk"]
        for info in self.pages.values():
            assert info.home not in info.copies
        assert not set(self.dropped) & set(self.pages), "a page is both dropped and stored"
        assert all(not info.copies for info in self.dropped.values())


def check_count(name: str, value: object, meaning: str = "") -> None:
    """Raise unless ``value`` (the argument called ``name``) is a whole number >= 0; the error
    adds ``meaning``, what the number means, where given."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(
            f"{name}={value!r}; expected a whole number >= 0" + (f" ({meaning})" if meaning else "")
        )


@dataclass
class _ByImportance:
    """The rule ``TieredStore.place`` demotes by while it runs: the least important page first
    (pages it was not given before all ranked ones)."""

    order: dict[str, int]  # key -> rank, 0 the most important

    def rank(self, pages, now, demote_to):
        unranked = len(self.order)
        return sorted(pages, key=lambda p: (-self.order.get(p.key, unranked), p.key))
