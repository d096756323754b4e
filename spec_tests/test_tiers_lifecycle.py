"""The tiers' lifecycle edges: a step that fails before its first attention layer, pages
recomputed on another dtype or device path, a save in lossless mode, the disk budget's true
minimum (a page file, not its K/V), resuming without a disk tier, deletes whose unlink fails,
the cost-aware rule's parameters and a turn store's conversation names."""

from __future__ import annotations

import errno
import math
import pathlib

import pytest
import torch
from transformers import DynamicCache

from kvstack.errors import InvalidArgumentError, TierFull
from kvstack.tiers import (
    CostAware,
    DiskTier,
    TieredCache,
    TieredStore,
    TurnStore,
    encode_page,
    page_file_bytes,
    page_nbytes,
)
from spec_tests.test_tiered_cache import greedy
from spec_tests.test_tiers import kv_page, same_page
from spec_tests.test_tiers_recompute import PAGE, disk_file_bytes, prompt
from spec_tests.tiny import tiny_tiers_llama

# Direct forwards pass the cache as past_key_values, which transformers 5.17 needs and 5.24
# deprecates (generate picks the name itself).
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_tiers_llama()


def lossless(model, **budgets) -> TieredCache:
    """A lossless cache of one device page and no host tier (unless ``budgets`` say else)."""
    return TieredCache(
        model.config, **({"device_budget": PAGE, "host_budget": 0} | budgets), recompute_with=model
    )


def model_page(batch: int = 1) -> dict[str, torch.Tensor]:
    """A page of the tiny model: K and V of 16 tokens, [batch, 2 KV heads, 16, 16 dims], fp32."""
    return {name: torch.zeros(batch, 2, 16, 16) for name in ("k", "v")}


def summary(cache: TieredCache) -> dict:
    stats = cache.stats()
    keys = ("seen_tokens", "pages", "pages_dropped", "recomputes", "recomputed_tokens")
    return {key: stats[key] for key in keys}


# --------------------------------------------------------------------------- 1: recompute
def test_pages_recomputed_on_another_dtype_path_join_the_layers_kv_where_it_attends(tiny_model):
    """The recompute's forward hands back its K/V in float64 (as another dtype or device path
    would): each recomputed page is brought to the device and dtype of the layer's own K/V
    before it meets the resident and fetched pages, so attention runs and, float32 -> float64
    -> float32 being exact, the tokens are DynamicCache's."""
    ids = prompt(60)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
    backbone = tiny_model.model
    original = backbone.forward
    recomputes = []

    def forward(*args, **kwargs):
        output = original(*args, **kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if type(cache) is DynamicCache:  # the recompute's forward (generate's has the tiers)
            recomputes.append(cache)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys.double(), layer.values.double()
        return output

    backbone.forward = forward
    try:
        cache = lossless(tiny_model)
        got = greedy(tiny_model, ids, cache, 8)
    finally:
        del backbone.forward  # the class's forward again
    assert recomputes, "the budgets must make the cache recompute"
    assert torch.equal(got, expected)
    cache.store.check()
    cache.close()


# --------------------------------------------------------------------------- 2: step ids
@pytest.mark.parametrize("failure", ["embedding", "refused"])
def test_a_step_that_fails_before_its_first_attention_layer_leaves_no_ids(tiny_model, failure):
    """The step's ids are committed when the first attention layer stores its K/V: a forward
    that fails before (an id the embedding does not have) or is refused by that layer (a batch
    whose page no budget holds) leaves the cache exactly as a cache that never saw it."""
    ids = prompt(50)
    results = {}
    for failed_first in (False, True):
        cache = lossless(tiny_model)
        if failed_first:
            with torch.no_grad():
                if failure == "embedding":
                    with pytest.raises(IndexError):
                        tiny_model(input_ids=torch.full((1, 5), 10_000), past_key_values=cache)
                else:
                    batch = torch.cat([prompt(20), prompt(20, seed=2)])  # [2, 20]: 8 KiB pages
                    with pytest.raises(InvalidArgumentError, match="one page of this batch"):
                        tiny_model(input_ids=batch, past_key_values=cache)
            assert cache.get_seq_length() == 0 and cache.stats()["pages"] == 0
        results[failed_first] = greedy(tiny_model, ids, cache, 8), summary(cache)
        cache.close()
    (plain, plain_stats), (after, after_stats) = results[False], results[True]
    assert torch.equal(after, plain) and after_stats == plain_stats
    assert plain_stats["recomputes"] > 0  # the ids were needed, and were right
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
    assert torch.equal(after, expected)


# --------------------------------------------------------------------------- 3: lossless save
def test_a_save_in_lossless_mode_drops_no_page_and_restores_may_drop(tiny_model, tmp_path):
    """One page on device and five on a disk of six page files: the save's copy fills the disk
    and its tails find no room. The save raises TierFull and drops nothing (lossless mode
    would otherwise drop the pages it is saving), the cache goes on with DynamicCache's
    tokens, and a save with room succeeds; may_drop is back on after either."""
    ids = prompt(40)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
    cache = lossless(tiny_model, disk_path=tmp_path / "tight", disk_budget=disk_file_bytes(6))
    out = greedy(tiny_model, ids, cache, 1)  # 40 tokens: 2 pages per layer, 8 in each tail
    assert cache.stats()["pages_homed"] == {"device": 1, "host": 0, "disk": 5}
    with pytest.raises(TierFull):
        cache.save(out)
    assert cache.store.may_drop is True
    assert cache.store.drops == 0 and not cache.store.dropped
    assert cache.store.disk.read_record("conversation.json") is None
    assert not [key for key in cache.store.pages if "tail" in key]  # the failed save's, gone
    cache.store.check()
    assert torch.equal(greedy(tiny_model, out, cache, 7), expected)
    cache.close()

    roomy = lossless(tiny_model, disk_path=tmp_path / "roomy", disk_budget="1MiB")
    out = greedy(tiny_model, ids, roomy, 4)
    roomy.save(out)
    assert roomy.store.may_drop is True and roomy.store.drops == 0
    assert roomy.store.disk.read_record("conversation.json") is not None
    roomy.close()


# --------------------------------------------------------------------------- 4: page files
@pytest.mark.parametrize(
    "key,page",
    [
        ("L0.B0", kv_page(0)),
        ("L29.B1000000", model_page()),
        ("x" * 200, kv_page(2, tokens=3, dtype=torch.bfloat16)),
        ("state", {"conv0": torch.zeros(1, 7, 3, dtype=torch.float16), "empty": torch.zeros(0)}),
    ],
    ids=["kv", "long-key", "bfloat16", "state"],
)
def test_page_file_bytes_is_the_size_of_the_file_written(tmp_path, key, page):
    disk = DiskTier(tmp_path, 1 << 20)
    written = disk.write(key, page)
    assert page_file_bytes(key, page) == written == disk.file_of(key).stat().st_size
    assert written == len(encode_page(key, page))
    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in page.items()}
    assert page_file_bytes(key, meta) == written  # shapes and dtypes are all it needs


def test_a_disk_budget_of_one_pages_kv_but_not_its_file_is_refused(tiny_model, tmp_path):
    page = model_page()
    assert page_nbytes(page) == PAGE
    file = page_file_bytes("L0.B0", page)
    assert file > PAGE
    directory = tmp_path / "kv"
    with pytest.raises(
        InvalidArgumentError,
        match=f"disk_budget={PAGE} cannot hold one page of {file} bytes \\(a page file",
    ):
        TieredCache(tiny_model.config, device_budget=PAGE, host_budget=0,
                    disk_path=directory, disk_budget=PAGE)  # fmt: skip
    assert not directory.exists()  # refused before the tier made its directory
    cache = TieredCache(tiny_model.config, device_budget=PAGE, host_budget=0,
                        disk_path=directory, disk_budget=file)  # fmt: skip
    assert cache.page_file_bytes == file
    cache.close()


def test_a_batchs_first_step_is_refused_when_the_disk_holds_its_kv_but_not_its_file(
    tiny_model, tmp_path
):
    batch = torch.cat([prompt(20), prompt(20, seed=2)])  # [2, 20]: pages of 2 * PAGE bytes
    file = page_file_bytes("L0.B0", model_page())  # one row's file
    two_rows = page_file_bytes("L0.B0", model_page(batch=2))
    assert file < 2 * PAGE < two_rows
    cache = TieredCache(tiny_model.config, device_budget=4 * PAGE, host_budget=0,
                        disk_path=tmp_path, disk_budget=2 * PAGE)  # fmt: skip
    with (
        torch.no_grad(),
        pytest.raises(
            InvalidArgumentError,
            match=f"disk_budget={2 * PAGE} cannot hold one page of this batch \\({two_rows} bytes",
        ),
    ):
        tiny_model(input_ids=batch, past_key_values=cache)
    assert cache.get_seq_length() == 0 and cache.stats()["pages"] == 0
    cache.close()


def test_a_turn_store_refuses_a_disk_budget_below_a_page_file_before_making_its_directory(
    tiny_model, tmp_path
):
    kv = torch.zeros(3, 16, 2, 16)  # one page: [L, block, H_kv, D] keys and values
    file = page_file_bytes("c.0", {"k": kv, "v": kv})  # the shortest key: the smallest file
    assert file > page_nbytes({"k": kv, "v": kv})
    directory = tmp_path / "turns"
    with pytest.raises(
        InvalidArgumentError, match=f"disk_bytes={file - 1} cannot hold one page file of {file}"
    ):
        TurnStore(tiny_model, host_bytes=1 << 20, disk_path=directory, disk_bytes=file - 1)
    assert not directory.exists()
    store = TurnStore(tiny_model, host_bytes=1 << 20, disk_path=directory, disk_bytes=file)
    assert store.store.capacity["disk"] == file


# --------------------------------------------------------------------------- 5: resume
def test_a_resume_without_a_disk_tier_is_refused_naming_the_argument(tiny_model, tmp_path):
    saved = tmp_path / "saved"
    first = TieredCache(tiny_model.config, device_budget=PAGE, host_budget=0,
                        disk_path=saved, disk_budget="1MiB")  # fmt: skip
    out = greedy(tiny_model, prompt(40), first, 4)
    first.save(out)
    first.close()
    files = sorted((p.name, p.stat().st_size) for p in saved.iterdir())
    budgets = {"device_budget": PAGE, "host_budget": 0}
    with pytest.raises(InvalidArgumentError, match="disk_budget=0; resume"):
        TieredCache.resume(tiny_model.config, disk_path=saved, token_ids=out, **budgets)
    with pytest.raises(InvalidArgumentError, match="disk_budget='0B'; resume"):
        TieredCache.resume(
            tiny_model.config, disk_path=saved, token_ids=out, disk_budget="0B", **budgets
        )
    with pytest.raises(InvalidArgumentError, match="disk_path=None; resume"):
        TieredCache.resume(
            tiny_model.config, disk_path=None, token_ids=out, disk_budget="1MiB", **budgets
        )
    missing = tmp_path / "missing"
    with pytest.raises(InvalidArgumentError, match="holds no saved conversation \\(it is not a"):
        TieredCache.resume(
            tiny_model.config, disk_path=missing, token_ids=out, disk_budget="1MiB", **budgets
        )
    assert not missing.exists()
    assert sorted((p.name, p.stat().st_size) for p in saved.iterdir()) == files  # untouched
    resumed = TieredCache.resume(
        tiny_model.config, disk_path=saved, token_ids=out, disk_budget="1MiB", **budgets
    )
    assert resumed.get_seq_length() == out.shape[1] - 1
    resumed.close()


# --------------------------------------------------------------------------- 6: CostAware
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    "arguments,named",
    [
        ({"bandwidth": {"host": -1.0, "disk": 1e9}}, "bandwidth\\['host'\\]=-1.0"),
        ({"bandwidth": {"host": 1e10, "disk": NAN}}, "bandwidth\\['disk'\\]=nan"),
        ({"bandwidth": {"host": 1e10, "disk": 0}}, "bandwidth\\['disk'\\]=0"),
        ({"bandwidth": {"host": INF, "disk": 1e9}}, "bandwidth\\['host'\\]=inf"),
        ({"bandwidth": {"host": True, "disk": 1e9}}, "bandwidth\\['host'\\]=True"),
        ({"bandwidth": {"host": "fast", "disk": 1e9}}, "bandwidth\\['host'\\]='fast'"),
        ({"bandwidth": {"host": 1e10}}, "bandwidth=.*exactly the keys"),
        ({"bandwidth": {"host": 1e10, "disk": 1e9, "device": 1e12}}, "exactly the keys"),
        ({"bandwidth": [1e10, 1e9]}, "bandwidth=\\[.*expected a dict"),
        ({"seconds_per_token": -1e-4}, "seconds_per_token=-0.0001"),
        ({"seconds_per_token": NAN}, "seconds_per_token=nan"),
        ({"seconds_per_token": "2e-4"}, "seconds_per_token='2e-4'"),
        ({"seconds_per_token_per_context": -1e-9}, "seconds_per_token_per_context=-1e-09"),
        ({"seconds_per_token_per_context": INF}, "seconds_per_token_per_context=inf"),
    ],
)
def test_the_cost_aware_rule_refuses_nonsense_parameters(arguments, named):
    with pytest.raises(InvalidArgumentError, match=named):
        CostAware(**arguments)


def test_the_cost_aware_rule_takes_zero_costs_and_copies_its_bandwidths():
    bandwidth = {"host": 1e10, "disk": 1e9}
    rule = CostAware(bandwidth=bandwidth, seconds_per_token=0, seconds_per_token_per_context=0)
    bandwidth["disk"] = -1.0  # the caller's dict changing later does not reach the rule
    assert rule.bandwidth == {"host": 1e10, "disk": 1e9}


# --------------------------------------------------------------------------- 7: TurnStore names
@pytest.mark.parametrize(
    "name",
    ["", "a/b", "../up", ".hidden", "two words", "x" * 191, 7, None],
    ids=["empty", "separator", "parent", "hidden", "space", "too-long", "int", "none"],
)
def test_a_turn_store_refuses_a_conversation_name_its_page_keys_could_not_use(tiny_model, name):
    """Names are checked against the key of the largest page index (10**9 - 1), before the
    store reads or writes anything: a name that passes gives usable keys for every page."""
    store = TurnStore(tiny_model, host_bytes=1 << 20)
    kv = torch.zeros(3, 16, 2, 16)  # [L, n, H_kv, D]
    with pytest.raises(InvalidArgumentError, match="conversation="):
        store.save(name, list(range(1, 17)), (kv, kv))
    with pytest.raises(InvalidArgumentError, match="conversation="):
        store.prefix_kv(name, list(range(1, 18)))
    with pytest.raises(InvalidArgumentError, match="conversation="):
        store.forget(name)
    assert not store.conversations and not store.store.pages and store.stats.lookups == 0


def test_a_turn_store_takes_the_longest_name_whose_page_keys_are_usable(tiny_model):
    store = TurnStore(tiny_model, host_bytes=1 << 20)
    kv = torch.zeros(3, 16, 2, 16)  # [L, n, H_kv, D]
    name = "x" * 190  # with ".999999999": the 200 characters a page key may have
    assert store.save(name, list(range(1, 17)), (kv, kv)) == 1
    assert store.prefix_kv(name, list(range(1, 18)))[0].shape == (3, 16, 2, 16)


# --------------------------------------------------------------------------- 8: deletes
@pytest.fixture
def failing_unlink(monkeypatch):
    """Page files cannot be unlinked (an I/O error); everything else can."""
    original = pathlib.Path.unlink

    def unlink(self, missing_ok=False):
        if self.suffix == ".page":
            raise OSError(errno.EIO, "simulated I/O error", str(self))
        return original(self, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", unlink)
    return monkeypatch


def test_a_disk_delete_whose_unlink_fails_keeps_the_page_named_counted_and_readable(
    tmp_path, failing_unlink
):
    disk = DiskTier(tmp_path, 1 << 20)
    page = kv_page(0)
    nbytes = disk.write("p", page)
    with pytest.raises(OSError, match="simulated"):
        disk.delete("p")
    assert "p" in disk and disk.bytes_used == nbytes and disk.file_of("p").exists()
    assert same_page(disk.read("p"), page)
    failing_unlink.undo()
    disk.delete("p")
    assert "p" not in disk and disk.bytes_used == 0 and not disk.file_of("p").exists()


def store_with_a_disk_copy(tmp_path, **options) -> tuple[TieredStore, dict]:
    page = kv_page(0)
    size = page_nbytes(page)
    store = TieredStore(device_bytes=4 * size, host_bytes=0, disk_path=tmp_path,
                        disk_bytes=1 << 20, min_page_bytes=size, **options)  # fmt: skip
    store.put("p", page, tokens=4)
    store.copy("p", "disk")
    assert store.tiers_of("p") == ["device", "disk"]
    return store, page


@pytest.mark.parametrize("erase", ["delete", "drop"])
def test_erasing_a_page_everywhere_erases_its_disk_copy_first(tmp_path, failing_unlink, erase):
    """A failed unlink of the disk copy comes before any other tier lets go: the page keeps
    its home and copies, whole, and nothing is dropped or forgotten."""
    store, page = store_with_a_disk_copy(tmp_path, may_drop=True)
    with pytest.raises(OSError, match="simulated"):
        getattr(store, erase)("p")
    store.check()
    assert "p" in store.pages and not store.dropped and store.drops == 0
    assert store.tiers_of("p") == ["device", "disk"]
    assert same_page(store.get("p")[0], page)
    failing_unlink.undo()
    getattr(store, erase)("p")
    store.check()
    assert "p" not in store.pages and ("p" in store.dropped) == (erase == "drop")


def test_a_move_whose_old_file_cannot_be_unlinked_keeps_it_as_a_copy(tmp_path, failing_unlink):
    store, page = store_with_a_disk_copy(tmp_path)
    store.move("p", "disk")  # its home is now the file; the device copy went
    with pytest.raises(OSError, match="simulated"):
        store.move("p", "device")
    store.check()
    assert store.pages["p"].home == "device" and store.tiers_of("p") == ["device", "disk"]
    assert same_page(store.get("p")[0], page)
    with pytest.raises(OSError, match="simulated"):
        store.drop_copy("p", "disk")
    store.check()
    assert store.tiers_of("p") == ["device", "disk"]
