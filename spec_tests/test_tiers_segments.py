"""Multi-segment attention in TieredCache (AsymCache): a layer's keys are attended by where they
came from this step (device-resident with the newest tokens, fetched from host and disk,
recomputed from their tokens), each segment on its own, merged by log-sum-exp. It must equal
attention over their union: the cache under generate against DynamicCache and against its own
gathered path. The adapter alone, without a model, is in test_tiers_segment_attention.py."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import DynamicCache

from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.tiers import ATTENTION_NAME, TieredCache
from kvstack.tiers import attention as tiers_attention
from spec_tests.test_tiered_cache import greedy
from spec_tests.test_tiered_cache import tiers_attention as on_tiers_attention
from spec_tests.tiny import tiny_tiers_llama

PAGE = 2 * 16 * 2 * 16 * 4  # K and V of 16 tokens, 2 KV heads of 16 dims, fp32 (tiny model)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_tiers_llama()


class _Calls(list):
    def __init__(self) -> None:
        super().__init__()
        self.newest: list[str] = []


@contextlib.contextmanager
def spy_on_segments(monkeypatch):
    """Record the sources of every segment_attention call (one per layer and step), and in
    ``newest`` the source of the segment holding the call's newest key."""
    calls = _Calls()
    real = tiers_attention.segment_attention

    def spy(query, segments, seen, scale):
        calls.append(tuple(s.source for s in segments))
        last = {s.source: int(s.positions.max()) for s in segments if s.positions.numel()}
        calls.newest.append(max(last, key=last.get))
        return real(query, segments, seen, scale)

    monkeypatch.setattr(tiers_attention, "segment_attention", spy)
    yield calls


def prompt(length: int, seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(1, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- in the cache
@pytest.mark.parametrize("policy", ["lru", "cost", "attention"])
def test_segments_from_every_tier_make_dynamic_cache_tokens_and_the_gathered_scores(
    tiny_model, tmp_path, policy, monkeypatch
):
    """Pages on device, host and disk: every layer of every step attends its segments
    (device-resident and fetched ones among them), the tokens are DynamicCache's and every
    step's logits are the gathered path's (sdpa over the pages in order) to float rounding."""
    ids = prompt(90, seed=1)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 20)
    logits = {}
    with on_tiers_attention(tiny_model), spy_on_segments(monkeypatch) as calls:
        for merge in (True, False):
            cache = TieredCache(
                tiny_model.config,
                device_budget=3 * PAGE,
                host_budget=3 * PAGE,
                disk_path=tmp_path / str(merge),
                disk_budget="1MiB",
                policy=policy,
                placement="attention" if policy == "attention" else "recency",
                merge_segments=merge,
            )
            out = greedy(
                tiny_model, ids, cache, 20, output_logits=True, return_dict_in_generate=True
            )
            assert torch.equal(out.sequences, expected)
            logits[merge] = torch.stack(out.logits)
            assert cache.stats()["hits"]["disk"] > 0
            cache.store.check()
            cache.close()
            if merge:
                assert len(calls) == 3 * 20  # every layer: the prefill and 19 decode steps
                assert {"device", "fetched"} <= {source for call in calls for source in call}
                # The tail (the newest keys, this step's among them) is attended with the
                # device pages.
                assert calls.newest == ["device"] * len(calls)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


def test_recomputed_pages_are_a_segment_of_their_own(tiny_model, monkeypatch):
    """The tiers hold a third of the KV and drop the rest (lossless recompute): the recomputed
    pages are attended as their own segment and the tokens are DynamicCache's."""
    ids = prompt(60, seed=2)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 12)
    with on_tiers_attention(tiny_model), spy_on_segments(monkeypatch) as calls:
        cache = TieredCache(
            tiny_model.config,
            device_budget=PAGE,
            host_budget=2 * PAGE,
            policy="cost",
            recompute_with=tiny_model,
            merge_segments=True,
        )
        got = greedy(tiny_model, ids, cache, 12)
    assert torch.equal(got, expected)
    assert cache.stats()["recomputes"] > 0
    assert any("recomputed" in call for call in calls)
    cache.close()


def test_padded_rows_fall_back_to_the_gathered_keys_and_stay_exact(tiny_model, monkeypatch):
    """A left-padded batch has an attention mask the segments cannot express: those steps
    gather the pages and run sdpa under the mask; the tokens are DynamicCache's."""
    ids = prompt(40, seed=3, rows=2)
    mask = torch.ones_like(ids)
    ids[1, :7], mask[1, :7] = 0, 0  # row 1 is left-padded by 7
    expected = greedy(
        tiny_model, ids, DynamicCache(config=tiny_model.config), 6, attention_mask=mask
    )
    with on_tiers_attention(tiny_model), spy_on_segments(monkeypatch) as calls:
        cache = TieredCache(
            tiny_model.config, device_budget=4 * PAGE, host_budget="1MiB", merge_segments=True
        )
        got = greedy(tiny_model, ids, cache, 6, attention_mask=mask)
        # Its layers handed over segments (returning only each step's K/V), so the exact
        # tokens say the attention gathered them back.
        assert cache.attends_by_segments()
    assert torch.equal(got, expected)
    assert calls == []  # every step had padding: none attended by segments
    assert cache.stats()["pages_homed"]["host"] > 0
    cache.close()


def test_a_cache_whose_config_is_not_the_models_says_so(tiny_model):
    """Built from a copy of the config that names the tiers attention while the model runs
    sdpa: the layer hands over segments nobody reads, and the next layer refuses the step."""
    config = copy.deepcopy(tiny_model.config)
    config._attn_implementation = ATTENTION_NAME
    cache = TieredCache(config, device_budget="1MiB", host_budget=0, merge_segments=True)
    with pytest.raises(KVStackError, match="no 'kvstack_tiers' attention call read them"):
        greedy(tiny_model, prompt(20, seed=4), cache, 2)
    tiers_attention.pending().clear()


def test_merge_segments_off_the_default_or_another_attention_gathers(tiny_model, monkeypatch):
    ids = prompt(30, seed=5)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 4)
    with spy_on_segments(monkeypatch) as calls:
        sdpa = TieredCache(
            tiny_model.config, device_budget=2 * PAGE, host_budget="1MiB", merge_segments=True
        )
        assert torch.equal(greedy(tiny_model, ids, sdpa, 4), expected)  # the model runs sdpa
        with on_tiers_attention(tiny_model):
            off = TieredCache(tiny_model.config, device_budget=2 * PAGE, host_budget="1MiB")
            assert not off.merge_segments  # the default
            assert torch.equal(greedy(tiny_model, ids, off, 4), expected)
    assert calls == []
    with pytest.raises(InvalidArgumentError, match="merge_segments=1; expected a bool"):
        TieredCache(tiny_model.config, device_budget="1MiB", host_budget=0, merge_segments=1)


def test_a_segment_without_keys_never_reaches_the_op():
    """The cache leaves out a source with no pages; the device segment always holds the step's
    tokens. An empty list is the op's error, named."""
    query = torch.randn(1, 2, 1, 8)
    with pytest.raises(InvalidArgumentError, match="segments must name at least one segment"):
        tiers_attention.segment_attention(query, [], 1, None)


def test_what_an_update_hands_its_attention_call_is_seen_only_on_its_own_thread():
    """Two models generating on two threads: each attention call sees the update of its own
    thread's layer, never the other's."""
    import threading

    mine = tiers_attention.pending()
    mine.layer, mine.key = "this thread's layer", torch.zeros(1)
    seen = []
    other = threading.Thread(target=lambda: seen.append(tiers_attention.pending().layer))
    other.start()
    other.join()
    assert seen == [None] and tiers_attention.pending().layer == "this thread's layer"
    mine.clear()
