"""The tiers' invariants: disk pages round-trip bit for bit, a corrupt or half-written page is
never returned, a full disk or budget leaves everything as it was, and across device / host /
disk every page stays whole in its home through any sequence of moves (a stateful test)."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstack.errors import InvalidArgumentError, KVStackError, PageCorrupted, TierFull
from kvstack.tiers import (
    LRU,
    AttentionAware,
    CostAware,
    DiskTier,
    PageInfo,
    Prefetcher,
    TieredStore,
    decode_page,
    encode_page,
    page_nbytes,
)
from kvstack.tiers import disk as disk_module
from kvstack.tiers.eviction import TIERS

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool)


def kv_page(seed: int, tokens: int = 4, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """A KV block of one layer: [tokens, kv_heads=2, head_dim=8] keys and values."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(tokens, 2, 8, generator=generator).to(dtype),
        "v": torch.randn(tokens, 2, 8, generator=generator).to(dtype),
    }


def same_page(a, b) -> bool:
    return a.keys() == b.keys() and all(
        a[n].dtype == b[n].dtype
        and a[n].shape == b[n].shape
        and torch.equal(a[n].cpu(), b[n].cpu())
        for n in a
    )


# --------------------------------------------------------------------------- page files
@settings(deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=1, max_size=3),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
def test_a_page_file_round_trips_bit_for_bit(shapes, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    page = {
        f"t{i}": (torch.randn(shape, generator=generator) * 100).to(dtype)
        for i, shape in enumerate(shapes)
    }
    key, back = decode_page(encode_page("p0", page), "memory")
    assert key == "p0" and same_page(page, back)


@settings(deadline=None, max_examples=25)
@given(
    dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=4),
    reads=st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1, max_size=30),
)
def test_reads_that_reuse_buffers_equal_what_was_written_and_never_change_a_held_page(
    tmp_path_factory, dtypes, reads
):
    """The disk tier's read path with ``ReadBuffers`` (buffers filled again once no page holds
    them) against the pages as written: any order of reads, any pages kept or dropped, pages of
    every dtype (numpy-backed, and torch-backed for bfloat16) and of equal sizes (so buffers
    are shared between keys)."""
    tier = DiskTier(tmp_path_factory.mktemp("pages"), 1 << 20)
    written = {f"p{i}": kv_page(i, dtype=dtype) for i, dtype in enumerate(dtypes)}
    for key, page in written.items():
        tier.write(key, page)
    held = []
    for index, keep in reads:
        key = f"p{index % len(dtypes)}"
        page = tier.read(key)
        assert same_page(page, written[key])
        if keep:
            held.append((key, page))
        for held_key, held_page in held:  # a later read never wrote into a held page
            assert same_page(held_page, written[held_key])


def test_a_prefetcher_refuses_a_bad_worker_count():
    store = TieredStore(device_bytes=1 << 20, host_bytes=0)
    for workers in (-1, 1.5, True):
        with pytest.raises(InvalidArgumentError, match=f"workers={workers!r}; expected"):
            Prefetcher(store, "cpu", workers=workers)


def test_a_disk_tier_reads_back_what_it_wrote_and_a_new_one_finds_it(tmp_path):
    tier = DiskTier(tmp_path / "pages", 1 << 20)
    page = kv_page(0, dtype=torch.bfloat16)
    size = tier.write("layer0.block3", page)
    assert size == tier.bytes_used == (tmp_path / "pages" / "layer0.block3.page").stat().st_size
    reopened = DiskTier(tmp_path / "pages", 1 << 20)  # a new process on the same directory
    assert reopened.keys() == ["layer0.block3"]
    assert same_page(reopened.read("layer0.block3"), page)


@pytest.mark.parametrize(
    "damage", ["flip_payload_bit", "flip_header_bit", "truncate", "not_a_page"]
)
def test_a_damaged_page_file_raises_page_corrupted_naming_the_file(tmp_path, damage):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write("a", kv_page(1))
    path = tier.file_of("a")
    data = bytearray(path.read_bytes())
    if damage == "flip_payload_bit":
        data[-3] ^= 0x10
    elif damage == "flip_header_bit":
        data[len(disk_module.MAGIC) + disk_module.DIGEST_BYTES + 12] ^= 0x01
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"hello, not a page")
    path.write_bytes(bytes(data))
    with pytest.raises(PageCorrupted, match=str(path)):
        tier.read("a")


# Pages written by earlier formats, each by kvstack before the next: KVSPAGE2 (SHA-256) and
# KVSPAGE3 (zlib's CRC-32): k = arange(8) and v = -arange(8), float32 [2, 1, 4], key "L0.b0".
PAGE_V2 = Path(__file__).parent / "data" / "page_v2_sha256.page"
PAGE_V3 = Path(__file__).parent / "data" / "page_v3_crc32.page"


def test_a_page_file_is_magic_crc32c_and_the_rest_as_the_module_says(tmp_path):
    import crc32c

    tier = DiskTier(tmp_path, 1 << 20)
    tier.write("a", kv_page(1))
    data = tier.file_of("a").read_bytes()
    head = len(disk_module.MAGIC) + disk_module.DIGEST_BYTES
    assert data[: len(disk_module.MAGIC)] == b"KVSPAGE4"
    stored = int.from_bytes(data[len(disk_module.MAGIC) : head], "little")
    assert stored == crc32c.crc32c(data[head:])
    assert crc32c.crc32c(b"123456789") == 0xE3069283  # the Castagnoli check value


@pytest.mark.parametrize("saved", [PAGE_V2, PAGE_V3], ids=["v2_sha256", "v3_crc32"])
def test_a_page_file_of_an_earlier_format_still_reads(tmp_path, saved):
    shutil.copy(saved, tmp_path / "L0.b0.page")
    page = DiskTier(tmp_path, 1 << 20).read("L0.b0")
    expected = torch.arange(8, dtype=torch.float32).reshape(2, 1, 4)
    assert same_page(page, {"k": expected, "v": -expected})


def test_a_page_file_of_format_3_is_magic_and_zlib_crc32(tmp_path):
    data = PAGE_V3.read_bytes()
    head = len(disk_module.CRC32_MAGIC) + disk_module.DIGEST_BYTES
    assert data[: len(disk_module.CRC32_MAGIC)] == b"KVSPAGE3"
    assert int.from_bytes(data[len(disk_module.CRC32_MAGIC) : head], "little") == zlib.crc32(
        data[head:]
    )


def test_without_the_crc32c_package_pages_are_written_in_format_3_and_format_4_is_refused(
    tmp_path, monkeypatch
):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write("new", kv_page(1))  # format 4, while crc32c is there
    monkeypatch.setattr(disk_module, "_crc32c_module", None)
    monkeypatch.setattr(disk_module, "MAGIC", disk_module.CRC32_MAGIC)  # what import chooses
    tier.write("old", kv_page(2))
    assert tier.file_of("old").read_bytes()[:8] == b"KVSPAGE3"
    assert same_page(tier.read("old"), kv_page(2))
    with pytest.raises(KVStackError, match="needs the crc32c package"):
        tier.read("new")


def test_a_read_fills_the_buffer_of_a_page_nobody_holds_and_never_one_still_held(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    for seed in range(6):
        tier.write(f"p{seed}", kv_page(seed))
    held = tier.read("p0")  # kept: its buffer must never be filled again
    held_pointer = held["k"].data_ptr()
    for _ in range(3):
        for seed in range(1, 6):
            page = tier.read(f"p{seed}")
            assert same_page(page, kv_page(seed))
            assert page["k"].data_ptr() != held_pointer
            del page  # dropped: its buffer is free for the next read
    assert same_page(held, kv_page(0))
    assert tier.read_buffers.reused >= 10  # after the first reads, reads reuse buffers
    # A pool of one buffer's bytes keeps one; reads beyond it allocate and still decode.
    tier.read_buffers = disk_module.ReadBuffers(max_bytes=len(tier.file_of("p1").read_bytes()))
    pages = [tier.read(f"p{seed}") for seed in range(1, 6)]  # all held at once
    assert all(
        same_page(page, kv_page(seed)) for seed, page in zip(range(1, 6), pages, strict=True)
    )
    assert len(tier.read_buffers._pool) == 1


def test_the_store_reports_the_host_bytes_its_disk_reads_keep_outside_the_budgets(tmp_path):
    store = TieredStore(device_bytes=1 << 20, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20)
    assert store.stats()["disk_read_buffer_bytes"] == 0  # nothing read yet
    for seed in range(4):
        store.put(f"p{seed}", kv_page(seed), tier="disk")
    held = [store.peek(f"p{seed}")[0] for seed in range(4)]  # four buffers, all in use
    file_bytes = sum(store.disk.file_of(f"p{seed}").stat().st_size for seed in range(4))
    assert store.stats()["disk_read_buffer_bytes"] == file_bytes  # each buffer holds a file
    del held
    for seed in range(4):
        store.peek(f"p{seed}")  # read again into the same buffers: nothing more is kept
    assert store.stats()["disk_read_buffer_bytes"] == file_bytes
    store.disk.read_buffers = disk_module.ReadBuffers(max_bytes=file_bytes // 2)
    pages = [store.peek(f"p{seed}")[0] for seed in range(4)]  # held at once, beyond the pool
    assert store.stats()["disk_read_buffer_bytes"] <= file_bytes // 2
    assert all(same_page(page, kv_page(seed)) for seed, page in enumerate(pages))
    assert TieredStore(device_bytes=1 << 20, host_bytes=0).stats()["disk_read_buffer_bytes"] == 0


def test_a_damaged_page_file_of_the_previous_format_raises_page_corrupted(tmp_path):
    data = bytearray(PAGE_V2.read_bytes())
    data[-33] ^= 0x04  # a bit of v's last value (the file ends with 32 bytes of padding)
    (tmp_path / "L0.b0.page").write_bytes(bytes(data))
    with pytest.raises(PageCorrupted, match="checksum mismatch"):
        DiskTier(tmp_path, 1 << 20).read("L0.b0")


def test_a_page_file_deleted_behind_the_tier_raises_page_corrupted_naming_it(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write("a", kv_page(1))
    tier.file_of("a").unlink()
    with pytest.raises(PageCorrupted, match=f"{tier.file_of('a')}: the page file is missing"):
        tier.read("a")


def test_a_page_file_under_another_key_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write("a", kv_page(1))
    tier.write("b", kv_page(2))
    os.replace(tier.file_of("a"), tier.file_of("b"))  # b's name now holds a's page
    with pytest.raises(PageCorrupted, match="holds page 'a', expected 'b'"):
        tier.read("b")


def test_a_full_disk_raises_tier_full_and_leaves_the_old_page(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, 1 << 20)
    old = kv_page(1)
    tier.write("a", old)
    used = tier.bytes_used

    def disk_full(handle, data):
        handle.write(data[: len(data) // 3])  # part of it reached the disk, then ENOSPC
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_all", disk_full)
    with pytest.raises(TierFull, match="disk is full writing page 'a'"):
        tier.write("a", kv_page(2))
    with pytest.raises(TierFull, match="disk is full writing page 'b'"):
        tier.write("b", kv_page(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.page"]  # no temporary file left
    assert tier.keys() == ["a"] and tier.bytes_used == used
    assert same_page(tier.read("a"), old)


def test_a_page_over_the_budget_raises_tier_full_and_writes_nothing(tmp_path):
    page = kv_page(0)
    size = len(encode_page("a", page))
    tier = DiskTier(tmp_path, size + 10)
    tier.write("a", page)
    with pytest.raises(TierFull, match=f"page 'b' needs {size} bytes, 10 of capacity_bytes"):
        tier.write("b", kv_page(1))
    assert tier.keys() == ["a"] and not tier.file_of("b").exists()
    tier.write("a", kv_page(2))  # replacing a page reuses its own bytes


KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from kvstack.tiers import disk
    tier = disk.DiskTier(sys.argv[1], 1 << 20)
    tier.write("a", {"k": torch.arange(64, dtype=torch.float32)})  # the last good state

    def killed_mid_write(handle, data):
        handle.write(data[: len(data) // 2])
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 with half the page on disk

    disk._write_all = killed_mid_write
    tier.write("a", {"k": torch.zeros(64)})
    tier.write("b", {"k": torch.ones(64)})
    """
)


def test_a_process_killed_during_a_page_write_leaves_the_last_good_state(tmp_path):
    result = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], check=False)
    assert result.returncode == -signal.SIGKILL
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(disk_module.TEMP_SUFFIX)]
    assert len(leftovers) == 1  # the half-written page, never renamed
    tier = DiskTier(tmp_path, 1 << 20)  # reopening
    assert tier.keys() == ["a"]
    assert torch.equal(tier.read("a")["k"], torch.arange(64, dtype=torch.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.page"]  # the leftover is gone


def test_a_disk_path_that_is_not_a_writable_directory_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(InvalidArgumentError, match="disk_path=.*a_file/pages.*writable directory"):
        DiskTier(blocker / "pages", 1 << 20)
    with pytest.raises(InvalidArgumentError, match="disk_path=.*a_file.*not a writable directory"):
        DiskTier(blocker, 1 << 20)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(InvalidArgumentError, match="not a writable directory"):
            DiskTier(locked, 1 << 20)


@pytest.mark.parametrize("key", ["", ".hidden", "a/b", "../up", "x" * 201, 3])
def test_a_page_key_that_is_no_file_name_is_refused(tmp_path, key):
    tier = DiskTier(tmp_path, 1 << 20)
    with pytest.raises(InvalidArgumentError, match="page key"):
        tier.write(key, kv_page(0))
    assert tier.keys() == [] and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- the store
def test_budgets_that_cannot_hold_one_page_are_refused(tmp_path):
    page_bytes = page_nbytes(kv_page(0))
    with pytest.raises(
        InvalidArgumentError, match=f"host_bytes=10 cannot hold one page of {page_bytes}"
    ):
        TieredStore(device_bytes=page_bytes, host_bytes=10, min_page_bytes=page_bytes)
    with pytest.raises(InvalidArgumentError, match="device_bytes=-1"):
        TieredStore(device_bytes=-1, host_bytes=0)
    with pytest.raises(InvalidArgumentError, match="disk_bytes=100 needs a disk_path"):
        TieredStore(device_bytes=100, host_bytes=0, disk_bytes=100)
    with pytest.raises(InvalidArgumentError, match="host_bytes=True; expected a non-negative"):
        TieredStore(device_bytes=100, host_bytes=True)
    with pytest.raises(InvalidArgumentError, match="capacity_bytes=True; expected a positive"):
        DiskTier(tmp_path, True)


def test_a_full_device_tier_demotes_the_least_recently_used_page_whole(tmp_path):
    size = page_nbytes(kv_page(0))
    store = TieredStore(
        device_bytes=2 * size, host_bytes=1 * size, disk_path=tmp_path, disk_bytes=1 << 20
    )
    pages = {f"p{i}": kv_page(i) for i in range(4)}
    store.put("p0", pages["p0"])
    store.put("p1", pages["p1"])
    store.get("p0")  # p1 is now the least recently used
    store.put("p2", pages["p2"])  # device full: p1 goes to host
    assert store.tiers_of("p1") == ["host"]
    store.put("p3", pages["p3"])  # device full: p0 to host, host full: p1 to disk
    assert [store.pages[k].home for k in pages] == ["host", "disk", "device", "device"]
    for key, page in pages.items():
        got, _ = store.get(key)
        assert same_page(got, page)
    assert store.stats()["bytes_moved"] == {"device->host": 2 * size, "host->disk": size}
    store.check()


def test_a_move_that_fails_on_a_full_disk_keeps_the_page_at_its_home(tmp_path, monkeypatch):
    store = TieredStore(
        device_bytes=1 << 20, host_bytes=1 << 20, disk_path=tmp_path, disk_bytes=1 << 20
    )
    page = kv_page(5)
    store.put("a", page, tier="host")

    def disk_full(handle, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_module, "_write_all", disk_full)
    with pytest.raises(TierFull):
        store.move("a", "disk")
    assert store.tiers_of("a") == ["host"] and store.stats()["bytes_moved"] == {}
    assert same_page(store.get("a")[0], page)
    store.check()


def test_a_prefetched_copy_serves_reads_and_is_dropped_before_any_home(tmp_path):
    size = page_nbytes(kv_page(0))
    store = TieredStore(device_bytes=2 * size, host_bytes=4 * size)
    store.put("cold", kv_page(0), tier="host")
    store.put("hot", kv_page(1))
    store.copy("cold", "device")  # a prefetch: home stays host
    assert store.get("cold")[1] == "device" and store.pages["cold"].home == "host"
    store.put("new", kv_page(2))  # device full: the copy goes, the homed page stays
    assert store.tiers_of("cold") == ["host"] and store.tiers_of("hot") == ["device"]
    assert store.stats()["hits"] == {"device": 1, "host": 0, "disk": 0}
    store.check()


class RankCounter(LRU):
    """LRU that counts its rankings."""

    def __init__(self) -> None:
        self.calls = 0

    def rank(self, pages, now, demote_to):
        self.calls += 1
        return super().rank(pages, now, demote_to)


def test_making_room_ranks_homed_pages_only_when_it_demotes_one(tmp_path):
    size = page_nbytes(kv_page(0))
    rule = RankCounter()
    store = TieredStore(device_bytes=2 * size, host_bytes=4 * size, rule=rule)
    store.put("cold", kv_page(0), tier="host")
    store.put("hot", kv_page(1))
    store.copy("cold", "device")
    store.put("new", kv_page(2))  # dropping the copy makes the room: nothing is ranked
    assert rule.calls == 0 and store.tiers_of("cold") == ["host"]
    store.put("newer", kv_page(3))  # now a homed page must go down: one ranking
    assert rule.calls == 1 and store.pages["hot"].home == "host"
    alone = TieredStore(device_bytes=size, host_bytes=0, rule=RankCounter())
    alone.put("a", kv_page(4))
    with pytest.raises(TierFull, match="device tier"):  # no lower tier: nothing to rank
        alone.put("b", kv_page(5))
    assert alone.rule.calls == 0 and alone.tiers_of("a") == ["device"]
    store.check()
    alone.check()


def test_the_attention_and_cost_rules_rank_as_their_papers_say():
    pages = [
        PageInfo(
            "sink", 1024, "device", position=0, tokens=16, uses=50, attention=0.6, last_used=2
        ),
        PageInfo(
            "stale", 1024, "device", position=4000, tokens=16, uses=1, attention=0.01, last_used=5
        ),
        PageInfo(
            "recent", 1024, "device", position=4016, tokens=16, uses=5, attention=0.2, last_used=9
        ),
    ]
    by_key = lambda ranked: [p.key for p in ranked]  # noqa: E731
    assert by_key(LRU().rank(pages, 10, "host")) == ["sink", "stale", "recent"]  # by last use
    assert by_key(AttentionAware().rank(pages, 10, "host")) == ["stale", "recent", "sink"]
    cost = CostAware()
    # Bringing a page back from host is cheaper than recomputing it; from nowhere (dropped),
    # a late page costs more to recompute than an early one of the same use.
    assert cost.restore_seconds(pages[1], "host") < cost.restore_seconds(pages[1], None)
    early, late = (
        PageInfo("e", 1, "disk", position=0, tokens=16),
        PageInfo("l", 1, "disk", position=8000, tokens=16),
    )
    assert cost.restore_seconds(early, None) < cost.restore_seconds(late, None)
    assert by_key(cost.rank(pages, 10, "host")) == ["stale", "recent", "sink"]


# --------------------------------------------------------------------------- stateful
class TieredStoreMachine(RuleBasedStateMachine):
    """Random puts (pages of two sizes), reads, copies, moves, promotions, placements, deletes
    and pages kept on disk for a save, under each eviction rule, on small budgets, against a
    dict of what each key should hold: every read returns its page bit for bit, and
    ``TieredStore.check`` holds after every step (including steps that raise ``TierFull``).
    With ``may_drop`` (lossless recompute), a full disk drops KV pages, never others, and a
    dropped page is named in ``dropped`` until it is deleted; without it nothing is dropped.
    A page kept on disk keeps its file until it is deleted."""

    @initialize(rule_name=st.sampled_from(["lru", "attention", "cost"]), may_drop=st.booleans())
    def start(self, rule_name, may_drop):
        import tempfile

        from kvstack.tiers import RULES

        self.directory = tempfile.TemporaryDirectory()
        size = page_nbytes(kv_page(0))
        file_size = len(encode_page("p00", kv_page(0)))
        self.store = TieredStore(
            device_bytes=2 * size,
            host_bytes=3 * size,
            disk_path=self.directory.name,
            disk_bytes=4 * file_size,
            rule=RULES[rule_name](),
            min_page_bytes=size,
            may_drop=may_drop,
        )
        self.model: dict[str, dict[str, torch.Tensor]] = {}
        self.kv_pages: set[str] = set()  # keys stored with tokens > 0
        self.dropped: set[str] = set()
        self.next_seed = 0

    def sync_dropped(self):
        """Pages the last operation dropped leave the model: they hold no bytes any more."""
        for key in [k for k in self.model if k in self.store.dropped]:
            del self.model[key]
            self.dropped.add(key)

    def teardown(self):
        self.directory.cleanup()

    @rule(tier=st.sampled_from(["device", "host", "disk"]), kv=st.booleans(), long=st.booleans())
    def put(self, tier, kv, long):
        # Pages of 4 and 8 tokens: a page's room-making can then move pages of another size.
        key, page = f"p{self.next_seed:02d}", kv_page(self.next_seed, tokens=8 if long else 4)
        self.next_seed += 1
        try:
            self.store.put(
                key, page, tier=tier, position=16 * self.next_seed, tokens=4 if kv else 0
            )
        except TierFull:
            assert key not in self.store.pages
            return
        finally:
            self.sync_dropped()
        self.model[key] = page
        if kv:
            self.kv_pages.add(key)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def get(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        page, tier = self.store.get(key)
        assert tier == self.store.tiers_of(key)[0]
        assert same_page(page, self.model[key])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from(["device", "host", "disk"]), as_copy=st.booleans())
    def move_or_copy(self, data, tier, as_copy):
        key = data.draw(st.sampled_from(sorted(self.model)))
        home = self.store.pages[key].home
        try:
            (self.store.copy if as_copy else self.store.move)(key, tier)
        except TierFull:
            # Never lost or dropped: whole at its home, or lower if making room for its own
            # copy demoted it (what is demoted on the way stays demoted).
            info = self.store.pages[key]
            assert TIERS.index(info.home) >= TIERS.index(home)
            assert same_page(self.store.peek(key)[0], self.model[key])
        finally:
            self.sync_dropped()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def promote(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        home = self.store.pages[key].home
        page, _ = self.store.peek(key)
        new_home = self.store.promote(key, page)
        assert self.store.pages[key].home == (new_home or home)
        if new_home is not None:
            assert TIERS.index(new_home) < TIERS.index(home)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def place(self, data):
        ranked = data.draw(st.permutations(sorted(self.model)))
        try:
            self.store.place(list(ranked))
        finally:
            self.sync_dropped()

    @rule(data=st.data())
    def keep_on_disk(self, data):
        """What a save does: name pages whose disk files must stay."""
        on_disk = sorted(k for k in self.model if "disk" in self.store.tiers_of(k))
        kept = data.draw(st.lists(st.sampled_from(on_disk), unique=True)) if on_disk else []
        self.store.keep_on_disk = set(kept)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), mass=st.floats(0, 1))
    def observe(self, data, mass):
        self.store.observe_attention(data.draw(st.sampled_from(sorted(self.model))), mass)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def delete(self, data):
        key = data.draw(st.sampled_from(sorted(self.model)))
        self.store.delete(key)
        del self.model[key]

    @precondition(lambda self: self.dropped)
    @rule(data=st.data())
    def delete_dropped(self, data):
        key = data.draw(st.sampled_from(sorted(self.dropped)))
        self.store.delete(key)
        self.dropped.remove(key)

    @invariant()
    def consistent(self):
        if hasattr(self, "store"):
            self.store.check()
            assert set(self.store.pages) == set(self.model)
            assert set(self.store.dropped) == self.dropped <= self.kv_pages
            assert self.store.may_drop or not self.dropped
            for key in self.store.keep_on_disk:
                assert key in self.store.pages and "disk" in self.store.tiers_of(key), key


TestTieredStoreMachine = TieredStoreMachine.TestCase


# --------------------------------------------------------------------------- prefetch
def test_a_prefetched_page_is_taken_only_once_its_copy_completed_and_hides_its_transfer(tmp_path):
    import threading
    import time

    from kvstack.tiers import Prefetcher

    store = TieredStore(device_bytes=1 << 20, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20)
    pages = {f"p{i}": kv_page(i) for i in range(3)}
    for key, page in pages.items():
        store.put(key, page, tier="disk")
    release = threading.Event()
    peek = store.peek

    def slow_peek(key):  # a transfer that lasts until the test lets it finish
        release.wait(timeout=10)
        time.sleep(0.05)
        return peek(key)

    store.peek = slow_peek
    prefetcher = Prefetcher(store, "cpu")
    prefetcher.prefetch(list(pages))
    taken: list[dict] = []
    taker = threading.Thread(target=lambda: taken.append(prefetcher.take("p0")[0]))
    taker.start()
    taker.join(timeout=0.2)
    assert taker.is_alive() and not taken  # its copy has not completed: take waits
    release.set()
    taker.join(timeout=10)
    assert same_page(taken[0], pages["p0"])
    assert prefetcher.stall_seconds >= 0.2  # p0's wait
    # "Compute" until p1 and p2 have arrived: however long the worker takes on a loaded
    # machine, a fixed sleep could end first and count its wait as a stall.
    for key in ("p1", "p2"):
        prefetcher._pending[key].result(timeout=10)  # waits; raises if the fetch failed
    stall, transfer = prefetcher.stall_seconds, prefetcher.transfer_seconds
    for key in ("p1", "p2"):
        assert same_page(prefetcher.take(key)[0], pages[key])
    # p1 and p2 took at least 50 ms each to fetch, all of it hidden behind the "compute".
    assert prefetcher.transfer_seconds - transfer >= 0.1
    assert prefetcher.stall_seconds - stall < 0.05
    assert store.stats()["hits"]["disk"] == 3
    assert prefetcher.bytes_fetched["disk"] == 3 * page_nbytes(pages["p0"])
    assert 0.0 < prefetcher.overlap_fraction < 1.0
    prefetcher.close()


def test_a_page_demoted_while_room_is_made_for_its_own_copy_is_never_dropped(tmp_path):
    """Pages of two sizes on small tiers (the case the state machine found): moving p02 to the
    device demotes pages down to a full disk, which the cost rule empties by dropping KV pages;
    room made for p02's own copy demotes p02 too, and it must not be dropped meanwhile (its
    bytes would land on the device under no name)."""
    size = page_nbytes(kv_page(0))
    store = TieredStore(
        device_bytes=2 * size,
        host_bytes=3 * size,
        disk_path=tmp_path,
        disk_bytes=4 * len(encode_page("p00", kv_page(0))),
        rule=CostAware(),
        min_page_bytes=size,
        may_drop=True,
    )
    store.put("p00", kv_page(0, tokens=8), tier="device", position=16, tokens=0)
    store.put("p01", kv_page(1, tokens=8), tier="device", position=32, tokens=0)
    store.put("p02", kv_page(2, tokens=4), tier="device", position=48, tokens=4)
    store.put("p03", kv_page(3, tokens=8), tier="device", position=64, tokens=0)
    try:
        store.move("p02", "device")
    except TierFull:
        pass
    store.check()
    assert "p02" in store.pages or "p02" in store.dropped


def test_disk_copies_a_save_keeps_are_not_dropped_to_make_room(tmp_path):
    """Pages a save names live on device, their files on disk as copies: a full disk raises
    TierFull rather than drop those copies (without the keep, they go first)."""
    size = page_nbytes(kv_page(0))
    file_size = len(encode_page("p0", kv_page(0)))
    for keep in (False, True):
        directory = tmp_path / f"keep{keep}"
        store = TieredStore(
            device_bytes=4 * size, host_bytes=0, disk_path=directory, disk_bytes=3 * file_size
        )
        for i in range(2):
            store.put(f"p{i}", kv_page(i), tier="device")
            store.copy(f"p{i}", "disk")
        if keep:
            store.keep_on_disk = {"p0", "p1"}
        store.put("n0", kv_page(5), tier="disk")  # the disk is full now
        if keep:
            with pytest.raises(TierFull, match="disk tier"):
                store.put("n1", kv_page(6), tier="disk")
            assert "n1" not in store.pages
            assert all(store.tiers_of(f"p{i}") == ["device", "disk"] for i in range(2))
        else:
            store.put("n1", kv_page(6), tier="disk")
            assert any(store.tiers_of(f"p{i}") == ["device"] for i in range(2))
        store.check()


def test_a_page_adopted_with_a_wrong_size_is_counted_at_its_real_bytes(tmp_path):
    """A resumed page is named with its size from the saved geometry; if its tensors are
    bigger (another dtype), promotion and moves count what the tensors hold, so the device
    tier never goes over its budget and its bytes come back exactly."""
    size = page_nbytes(kv_page(0))
    TieredStore(device_bytes=0, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20).put(
        "old", kv_page(0), tier="disk"
    )  # written by an earlier process
    store = TieredStore(
        device_bytes=size + size // 2, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20
    )
    store.put("busy", kv_page(1), tier="device")  # half a page free
    store.adopt_disk_page("old", size // 2)  # the estimate: half its real bytes
    page, tier = store.peek("old")
    assert tier == "disk" and store.promote("old", page) is None  # no room for its real bytes
    store.check()
    store.move("old", "device")  # makes room for its real bytes: "busy" goes to disk
    store.check()
    assert store.bytes_used("device") == size <= store.capacity["device"]
    store.move("old", "disk")
    assert store.bytes_used("device") == 0
    store.check()


def test_a_host_tier_that_is_off_sends_demoted_pages_to_disk(tmp_path):
    size = page_nbytes(kv_page(0))
    store = TieredStore(device_bytes=size, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20)
    store.put("a", kv_page(0))
    store.put("b", kv_page(1))
    assert store.tiers_of("a") == ["disk"] and store.tiers_of("b") == ["device"]
    assert same_page(store.get("a")[0], kv_page(0))
    store.check()


@pytest.mark.parametrize("page", [{}, {"k": [1, 2]}, [torch.zeros(2)], {3: torch.zeros(2)}])
def test_a_page_that_is_no_dict_of_tensors_is_refused_and_nothing_changes(page):
    store = TieredStore(device_bytes=1 << 20, host_bytes=0)
    store.put("a", kv_page(0))
    with pytest.raises(InvalidArgumentError, match="page for 'b'.*expected a non-empty dict"):
        store.put("b", page)
    assert list(store.pages) == ["a"]
    store.check()


@pytest.mark.parametrize("argument,value", [("position", -1), ("tokens", -4), ("tokens", 1.5)])
def test_a_negative_or_fractional_page_position_or_token_count_is_refused(argument, value):
    store = TieredStore(device_bytes=1 << 20, host_bytes=0)
    with pytest.raises(InvalidArgumentError, match=f"{argument}={value!r}; expected a whole"):
        store.put("a", kv_page(0), **{argument: value})
    assert not store.pages
    store.check()


def test_deleting_or_forgetting_an_unknown_page_names_it(tmp_path):
    store = TieredStore(device_bytes=1 << 20, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20)
    with pytest.raises(KeyError, match="page 'x' is not stored"):
        store.delete("x")
    with pytest.raises(KeyError, match="page 'x' is not dropped; forget_dropped expects"):
        store.forget_dropped("x")
    with pytest.raises(KeyError, match="page 'x' has no file on the disk tier .in '"):
        store.adopt_disk_page("x", 10)


def test_take_all_returns_every_page_in_order_from_whichever_tier_holds_it(tmp_path):
    from kvstack.tiers import Prefetcher

    size = page_nbytes(kv_page(0))
    store = TieredStore(
        device_bytes=2 * size, host_bytes=size, disk_path=tmp_path, disk_bytes=1 << 20
    )
    pages = {f"p{i}": kv_page(i) for i in range(5)}
    for key, page in pages.items():
        store.put(key, page)  # the first ones are demoted to host, then disk
    prefetcher = Prefetcher(store, "cpu")
    prefetcher.prefetch(["p1"])
    keys = ["p4", "p0", "p1", "p3", "p2"]
    taken = prefetcher.take_all(keys)
    assert [tier for _, tier in taken] == [store.tiers_of(k)[0] for k in keys]
    assert {tier for _, tier in taken} == {"device", "host", "disk"}
    assert all(same_page(page, pages[k]) for (page, _), k in zip(taken, keys, strict=True))
    assert sum(store.stats()["hits"].values()) == 5
    prefetcher.close()


def test_take_all_counts_reads_as_take_page_by_page_with_the_fetched_pages_first(tmp_path):
    """``take_all`` counts a layer's reads under one lock: the same hits per tier, and the
    same recency order the rules see, as taking the fetched pages one by one and then the
    resident ones."""
    from kvstack.tiers import Prefetcher

    size = page_nbytes(kv_page(0))

    def filled(directory):
        store = TieredStore(
            device_bytes=2 * size, host_bytes=size, disk_path=directory, disk_bytes=1 << 20
        )
        for i in range(5):
            store.put(f"p{i}", kv_page(i))  # p3, p4 on device, p2 on host, p0, p1 on disk
        return store

    keys = ["p4", "p0", "p1", "p3", "p2"]
    batched, single = filled(tmp_path / "a"), filled(tmp_path / "b")
    prefetchers = [Prefetcher(batched, "cpu"), Prefetcher(single, "cpu")]
    for prefetcher in prefetchers:
        prefetcher.prefetch(keys)
    prefetchers[0].take_all(keys)
    resident = [k for k in keys if single.tiers_of(k)[0] == "device"]
    for key in [k for k in keys if k not in resident] + resident:
        prefetchers[1].take(key)
    for store in (batched, single):
        store.check()
    assert batched.stats()["hits"] == single.stats()["hits"]
    assert [batched.pages[k].last_used for k in keys] == [single.pages[k].last_used for k in keys]
    assert [batched.pages[k].uses for k in keys] == [1] * 5
    for prefetcher in prefetchers:
        prefetcher.close()


def test_a_corrupt_page_in_a_prefetched_batch_fails_only_its_own_take(tmp_path):
    """A layer's pages are fetched as one batch: a damaged file fails its page's take with
    ``PageCorrupted`` and the pages after it in the batch still arrive whole."""
    from kvstack.tiers import Prefetcher

    store = TieredStore(device_bytes=1 << 20, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20)
    pages = {f"p{i}": kv_page(i) for i in range(3)}
    for key, page in pages.items():
        store.put(key, page, tier="disk")
    path = store.disk.file_of("p1")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a payload bit
    path.write_bytes(bytes(data))
    prefetcher = Prefetcher(store, "cpu")
    prefetcher.prefetch(["p0", "p1", "p2"])
    assert same_page(prefetcher.take("p0")[0], pages["p0"])
    with pytest.raises(PageCorrupted, match="p1.page: checksum mismatch"):
        prefetcher.take("p1")
    assert same_page(prefetcher.take("p2")[0], pages["p2"])
    prefetcher.close()


def test_pages_on_the_device_are_not_prefetched_but_read_in_place(tmp_path):
    from kvstack.tiers import Prefetcher

    size = page_nbytes(kv_page(0))
    store = TieredStore(device_bytes=size, host_bytes=size, disk_path=tmp_path, disk_bytes=1 << 20)
    for i in range(3):
        store.put(f"p{i}", kv_page(i))  # p2 on device, p1 on host, p0 on disk
    prefetcher = Prefetcher(store, "cpu")
    prefetcher.prefetch(["p0", "p1", "p2"])
    taken = prefetcher.take_all(["p0", "p1", "p2"])
    assert [tier for _, tier in taken] == ["disk", "host", "device"]
    assert taken[2][0] is store.device_pages(["p2"])["p2"]  # the tier's own tensors: no copy
    assert prefetcher.bytes_fetched == {"disk": size, "host": size}
    prefetcher.close()


@pytest.mark.parametrize("key", ["a", "layer.7", "a-much-longer-page-key.with.parts"])
def test_decoded_tensors_start_at_aligned_offsets_of_the_buffer_they_were_read_into(key):
    """Tensors are decoded in place: their bytes must start at a multiple of ALIGN, whatever the
    header's length, or typed loads would read misaligned addresses."""
    page = {"k": kv_page(1)["k"], "odd": torch.arange(3, dtype=torch.int8), "v": kv_page(2)["v"]}
    buffer = bytearray(encode_page(key, page))
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    _, back = decode_page(buffer, "memory")
    for name, tensor in back.items():
        assert (tensor.data_ptr() - base) % disk_module.ALIGN == 0, name
        assert torch.equal(tensor, page[name])


def test_a_prefetch_after_close_raises_and_leaves_nothing_pending(tmp_path):
    from kvstack.tiers import Prefetcher

    store = TieredStore(device_bytes=1 << 20, host_bytes=0, disk_path=tmp_path, disk_bytes=1 << 20)
    store.put("p0", kv_page(0), tier="disk")
    prefetcher = Prefetcher(store, "cpu")
    prefetcher.close()
    with pytest.raises(RuntimeError, match="shutdown"):
        prefetcher.prefetch(["p0"])
    prefetcher.drain()  # returns: no future waits for a worker that will never run
    assert same_page(prefetcher.take("p0")[0], kv_page(0))  # fetched by the caller instead


# --------------------------------------------------------------------------- placement
@settings(deadline=None, max_examples=25)
@given(
    order=st.permutations(list(range(9))),
    homes=st.lists(st.sampled_from(["device", "host", "disk"]), min_size=9, max_size=9),
)
def test_placement_puts_the_most_important_pages_highest_and_loses_none(order, homes):
    import tempfile

    size = page_nbytes(kv_page(0))
    with tempfile.TemporaryDirectory() as path:
        store = TieredStore(
            device_bytes=3 * size, host_bytes=3 * size, disk_path=path, disk_bytes=1 << 20
        )
        pages = {f"p{i}": kv_page(i) for i in range(9)}
        # Homes as drawn, as far as the tiers hold them (put demotes when one is full).
        for (key, page), home in zip(pages.items(), homes, strict=True):
            store.put(key, page, tier=home)
        ranked = [f"p{i}" for i in order]
        store.place(ranked)
        assert [store.pages[k].home for k in ranked] == 3 * ["device"] + 3 * ["host"] + 3 * ["disk"]
        for key, page in pages.items():
            assert same_page(store.get(key)[0], page)
        assert isinstance(store.rule, LRU)  # the store's own rule is back
        store.check()


def test_placement_of_an_unknown_page_is_refused_before_anything_moves(tmp_path):
    size = page_nbytes(kv_page(0))
    store = TieredStore(device_bytes=size, host_bytes=size, disk_path=tmp_path, disk_bytes=1 << 20)
    store.put("a", kv_page(0))
    store.put("b", kv_page(1))  # a goes to host
    with pytest.raises(KeyError, match="'nope' is not stored"):
        store.place(["a", "nope"])
    assert store.homes(["a", "b"]) == {"a": "host", "b": "device"}
    store.check()


@pytest.mark.parametrize("q_heads,kv_heads,t_q,t_k", [(4, 2, 1, 9), (6, 3, 7, 7), (2, 2, 40, 45)])
def test_key_attention_mass_is_the_window_queries_mean_attention_per_key(
    q_heads, kv_heads, t_q, t_k
):
    from kvstack.tiers import key_attention_mass

    generator = torch.Generator().manual_seed(q_heads * t_k)
    query = torch.randn(2, q_heads, t_q, 8, generator=generator)
    key = torch.randn(2, kv_heads, t_k, 8, generator=generator)
    window = 32
    got = key_attention_mass(query, key, 0.3, window)
    # One query at a time: query i (position t_k - t_q + i) of head h attends to KV head
    # h // (q_heads / kv_heads) over keys up to its position.
    expected = torch.zeros(2, t_k)
    observed = range(max(0, t_q - window), t_q)
    for b in range(2):
        for h in range(q_heads):
            for i in observed:
                position = t_k - t_q + i
                keys = key[b, h // (q_heads // kv_heads), : position + 1]
                probs = torch.softmax(keys @ query[b, h, i] * 0.3, dim=0)
                expected[b, : position + 1] += probs
    expected /= q_heads * len(observed)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(-1), torch.ones(2))
