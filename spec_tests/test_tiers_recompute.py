"""Lossless recompute (AsymCache): a ``TieredCache`` whose tiers cannot hold the conversation
drops pages and computes them again from their tokens when a layer reads them, and still makes
exactly ``DynamicCache``'s tokens; the store drops only KV pages, in the rule's order."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvstack.errors import InvalidArgumentError, KVStackError, PageCorrupted, TierFull
from kvstack.tiers import (
    ATTENTION_NAME,
    LRU,
    CostAware,
    PageInfo,
    TieredCache,
    TieredStore,
    encode_page,
)
from spec_tests.test_tiered_cache import greedy, tiny_hybrid
from spec_tests.tiny import tiny_llama_config, tiny_tiers_llama

PAGE = 2 * 16 * 2 * 16 * 4  # K and V of 16 tokens, 2 KV heads of 16 dims, fp32 (tiny model)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_tiers_llama()


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def damage(path) -> None:
    """Flip one bit of a page file's tensor bytes (its checksum no longer matches)."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def disk_file_bytes(pages: int) -> int:
    """Disk bytes of ``pages`` tiny-model page files (a file is its tensors and a header)."""
    one = {"k": torch.zeros(1, 2, 16, 16), "v": torch.zeros(1, 2, 16, 16)}
    return pages * len(encode_page("L0.B0", one))


@contextlib.contextmanager
def attention(model, name):
    model.set_attn_implementation(name)
    try:
        yield model
    finally:
        model.set_attn_implementation("sdpa")


def within_budgets(cache) -> bool:
    stats = cache.stats()
    return all(stats["bytes_used"][t] <= stats["capacity_bytes"][t] for t in stats["bytes_used"])


# --------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("policy", ["lru", "cost", "attention"])
@pytest.mark.parametrize(
    "host_pages,disk_pages", [(2, 2), (0, 0), (1, 0)], ids=["host+disk", "device-only", "host"]
)
def test_tokens_equal_dynamic_cache_when_the_tiers_hold_a_third_of_the_kv(
    tiny_model, tmp_path, policy, host_pages, disk_pages
):
    """60 prompt tokens and 12 new ones in 3 layers are 12 pages; the tiers hold 3 to 5 of
    them. Every step recomputes what was dropped (the prefill too: its later layers drop the
    earlier layers' pages), and the tokens are DynamicCache's."""
    ids = prompt(60)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 12)
    name = ATTENTION_NAME if policy == "attention" else "sdpa"
    with attention(tiny_model, name):
        cache = TieredCache(
            tiny_model.config,
            device_budget=PAGE,
            host_budget=host_pages * PAGE,
            disk_path=tmp_path if disk_pages else None,
            disk_budget=disk_file_bytes(disk_pages),
            policy=policy,
            recompute_with=tiny_model,
        )
        got = greedy(tiny_model, ids, cache, 12)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert stats["seen_tokens"] == 71 and stats["pages_dropped"] > 0 and stats["recomputes"] > 0
    assert stats["pages"] + stats["pages_dropped"] == 3 * (71 // 16)
    assert within_budgets(cache)
    cache.store.check()
    cache.close()


def test_without_recompute_the_same_budgets_raise_tier_full(tiny_model, tmp_path):
    cache = TieredCache(
        tiny_model.config,
        device_budget=PAGE,
        host_budget=2 * PAGE,
        disk_path=tmp_path,
        disk_budget=disk_file_bytes(2),
    )
    with pytest.raises(TierFull):
        greedy(tiny_model, prompt(60), cache, 12)


@settings(deadline=None, max_examples=8)
@given(
    prompt_tokens=st.integers(17, 70),
    new_tokens=st.integers(1, 20),
    pages=st.tuples(st.integers(1, 3), st.integers(0, 2), st.integers(0, 3)),
    policy=st.sampled_from(["lru", "cost"]),
    seed=st.integers(0, 2**16),
)
def test_random_sequences_and_budgets_make_dynamic_cache_tokens(
    tiny_model, tmp_path_factory, prompt_tokens, new_tokens, pages, policy, seed
):
    device, host, disk = pages
    ids = prompt(prompt_tokens, seed)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), new_tokens)
    cache = TieredCache(
        tiny_model.config,
        device_budget=device * PAGE,
        host_budget=host * PAGE,
        disk_path=tmp_path_factory.mktemp("kv") if disk else None,
        disk_budget=disk_file_bytes(disk),
        policy=policy,
        recompute_with=tiny_model,
    )
    assert torch.equal(greedy(tiny_model, ids, cache, new_tokens), expected)
    assert within_budgets(cache)
    cache.store.check()
    cache.close()


def test_a_reset_cache_recomputes_a_second_prompt_from_its_own_tokens(tiny_model):
    cache = TieredCache(tiny_model.config, device_budget=2 * PAGE, host_budget=0,
                        recompute_with=tiny_model)  # fmt: skip
    for seed in (1, 2):
        ids = prompt(50, seed)
        expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
        assert torch.equal(greedy(tiny_model, ids, cache, 8), expected)
        assert cache.stats()["recomputes"] > 0
        cache.reset()
        assert cache.stats()["pages_dropped"] == 0 and cache.get_seq_length() == 0
    cache.close()


def test_smollm2_with_a_tenth_of_its_kv_in_the_tiers_makes_dynamic_cache_tokens():
    from kvstack.models import load_smollm2
    from spec_tests.test_hf_smollm2 import PROMPT, chat_ids

    model, tokenizer = load_smollm2(progress=False)
    model.set_attn_implementation("sdpa")
    ids = chat_ids(tokenizer, [PROMPT])["input_ids"]
    new = 12
    expected = greedy(model, ids, DynamicCache(config=model.config), new)
    kv_bytes = 30 * 2 * (ids.shape[1] + new - 1) * 3 * 64 * 4  # 30 layers, 3 KV heads of 64
    cache = TieredCache(
        model.config,
        device_budget=kv_bytes // 20,
        host_budget=kv_bytes // 20,
        policy="cost",
        recompute_with=model,
    )
    got = greedy(model, ids, cache, new)
    assert torch.equal(got, expected), tokenizer.decode(got[0, ids.shape[1] :])
    stats = cache.stats()
    assert stats["pages_dropped"] > 0 and within_budgets(cache)
    cache.close()


def test_a_damaged_page_is_dropped_and_recomputed_never_attended_to(tiny_model, tmp_path):
    """In a running conversation, a page file that fails its checksum is dropped (its file
    deleted, with a warning) and recomputed from its tokens: the tokens stay DynamicCache's.
    Without recompute_with the same damage raises PageCorrupted."""
    ids = prompt(60)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 12)
    for lossless in (True, False):
        cache = TieredCache(
            tiny_model.config,
            device_budget=PAGE,
            host_budget=0,
            disk_path=tmp_path / str(lossless),
            disk_budget="1MiB",
            recompute_with=tiny_model if lossless else None,
        )
        out = greedy(tiny_model, ids, cache, 6)
        damaged = cache.store.disk.file_of("L2.B1")  # read in the next step, not prefetched yet
        damage(damaged)
        if not lossless:
            with pytest.raises(PageCorrupted, match="L2.B1"):
                greedy(tiny_model, out, cache, 6)
            cache.close()
            continue
        with pytest.warns(UserWarning, match="'L2.B1' is damaged"):
            got = greedy(tiny_model, out, cache, 6)
        assert torch.equal(got, expected)
        stats = cache.stats()
        assert stats["damaged_pages_recomputed"] == 1 and not damaged.exists()
        cache.store.check()
        cache.close()


class LatestFirst:
    """A rule that drops the latest positions first: recomputes then need the pages before
    them (a prefix read from the tiers)."""

    def rank(self, pages, now, demote_to):
        return sorted(pages, key=lambda p: (-p.position, p.key))


def test_a_damaged_page_before_a_recomputed_span_is_recomputed_with_it(tiny_model, tmp_path):
    ids = prompt(60)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 12)
    cache = TieredCache(
        tiny_model.config,
        device_budget=PAGE,
        host_budget=0,
        disk_path=tmp_path,
        disk_budget=disk_file_bytes(6),
        policy=LatestFirst(),
        recompute_with=tiny_model,
    )
    out = greedy(tiny_model, ids, cache, 6)
    assert cache.stats()["pages_dropped"] > 0
    before = [k for k in ("L1.B0", "L2.B0", "L1.B1") if k in cache.store.disk]
    damaged = cache.store.disk.file_of(before[0])
    damage(damaged)
    recomputed_before = cache.stats()["recomputed_tokens"]
    with pytest.warns(UserWarning, match="is damaged"):
        got = greedy(tiny_model, out, cache, 6)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert stats["damaged_pages_recomputed"] == 1 and stats["recomputed_tokens"] > recomputed_before
    cache.store.check()
    cache.close()


# --------------------------------------------------------------------------- the store's drops
def kv(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(1, 2, 4, 8, generator=generator), "v": torch.randn(1, 2, 4, 8)}


def test_the_cost_rule_drops_the_page_cheapest_to_recompute_first():
    """Equal reuse probability, so recompute cost decides: the earliest position goes first."""
    size = sum(t.nbytes for t in kv(0).values())
    store = TieredStore(device_bytes=3 * size, host_bytes=0, rule=CostAware(), may_drop=True,
                        min_page_bytes=size)  # fmt: skip
    for index, position in enumerate([512, 0, 256]):
        store.put(f"p{index}", kv(index), position=position, tokens=4)
    for key in ("p0", "p1", "p2"):
        store.get(key)  # each read once since they were stored together
    store.put("p3", kv(3), position=768, tokens=4)
    assert set(store.dropped) == {"p1"}  # position 0
    store.get("p3")  # read once since it was stored: more likely to be read again than p0, p2
    store.put("p4", kv(4), position=1024, tokens=4)
    assert set(store.dropped) == {"p1", "p2"}  # then position 256
    assert store.stats()["pages_dropped"] == store.stats()["drops"] == 2
    with pytest.raises(KeyError):
        store.peek("p1")
    assert store.dropped_among(["p0", "p1", "p2"]) == {"p1", "p2"}
    store.check()


def test_the_cost_rule_drops_what_the_recomputed_span_covers_before_it_extends_the_span():
    """A dropped page is recomputed in one span with every other, in every layer: the same block
    of another layer costs nothing more, however often it is read; the next block a little, a
    far one more. LRU drops by use alone, so its second drop reaches further."""
    size = sum(t.nbytes for t in kv(0).values())
    dropped = {}
    for rule in (CostAware(), LRU()):
        store = TieredStore(device_bytes=6 * size, host_bytes=0, rule=rule, may_drop=True,
                            min_page_bytes=size)  # fmt: skip
        keys = [f"L{layer}.B{block}" for layer in range(2) for block in range(4)]
        for key in keys:
            if key == "L1.B2":  # the tier is full: read L1.B0 often before the drops start
                for _ in range(3):
                    store.get("L1.B0")
            block = int(key[-1])
            store.put(key, kv(block), position=4 * block, tokens=4)
        dropped[type(rule).__name__] = set(store.dropped)
        store.check()
    assert dropped == {"CostAware": {"L0.B0", "L1.B0"}, "LRU": {"L0.B0", "L0.B1"}}
    rule, info = CostAware(), {}
    for key, position in [("L0.B0", 0), ("L1.B0", 0), ("L0.B1", 64), ("L0.B5", 320)]:
        info[key] = PageInfo(key, size, "device", position=position, tokens=64)
    ranked = rule.rank_drops([info["L0.B5"], info["L0.B1"], info["L1.B0"]], 0, [info["L0.B0"]])
    assert [p.key for p in ranked] == ["L1.B0", "L0.B1", "L0.B5"]


def test_the_cost_rule_keeps_a_page_just_stored_for_the_read_that_follows_it():
    """A layer stores a step's new page and reads it at once: a page not read yet counts as
    about to be, so a page read once long ago goes first, even at an earlier position."""
    size = sum(t.nbytes for t in kv(0).values())
    store = TieredStore(device_bytes=2 * size, host_bytes=0, rule=CostAware(), may_drop=True,
                        min_page_bytes=size)  # fmt: skip
    store.put("old", kv(0), position=0, tokens=4)
    store.get("old")
    store.clock += 40  # other pages' reads since
    store.put("fresh", kv(1), position=64, tokens=4)
    store.put("next", kv(2), position=128, tokens=4)  # before anything read "fresh"
    assert set(store.dropped) == {"old"}


def test_only_kv_pages_are_dropped_and_a_store_without_may_drop_drops_nothing():
    size = sum(t.nbytes for t in kv(0).values())
    store = TieredStore(device_bytes=2 * size, host_bytes=0, may_drop=True, min_page_bytes=size)
    store.put("state", kv(0), tokens=0)  # not KV: nothing could recompute it
    store.put("a", kv(1), tokens=4)
    store.put("b", kv(2), tokens=4)
    assert set(store.dropped) == {"a"}
    big = {"k": torch.zeros(2, 2, 4, 8), "v": torch.zeros(2, 2, 4, 8)}  # two pages' bytes
    with pytest.raises(TierFull):  # dropping every KV page leaves the state page: no room
        store.put("c", big, tokens=4)
    assert set(store.dropped) == {"a", "b"} and set(store.pages) == {"state"}  # dropped on the way
    with pytest.raises(InvalidArgumentError, match="already stored"):
        store.put("a", kv(1), tokens=4)  # a dropped key is still taken
    store.delete("a")  # forgotten
    assert set(store.dropped) == {"b"}
    store.check()
    plain = TieredStore(device_bytes=size, host_bytes=0, min_page_bytes=size)
    plain.put("a", kv(1), tokens=4)
    with pytest.raises(InvalidArgumentError, match="may_drop"):
        plain.drop("a")
    with pytest.raises(TierFull):
        plain.put("b", kv(2), tokens=4)
    assert "a" in plain.pages and not plain.dropped
    with pytest.raises(InvalidArgumentError, match="may_drop"):
        TieredStore(device_bytes=size, host_bytes=0, may_drop=1)


# --------------------------------------------------------------------------- bad input
def test_recompute_with_must_be_a_model_of_attention_layers(tmp_path):
    from transformers import LlamaConfig

    config = tiny_llama_config(num_hidden_layers=2)
    assert isinstance(config, LlamaConfig)
    with pytest.raises(InvalidArgumentError, match="recompute_with"):
        TieredCache(config, device_budget="1MiB", host_budget=0, recompute_with="model")
    hybrid = tiny_hybrid("jamba")
    with pytest.raises(KVStackError, match="recurrent state"):
        TieredCache(hybrid.config, device_budget="1MiB", host_budget=0, recompute_with=hybrid)


def test_steps_it_could_not_recompute_are_refused_before_anything_changes(tiny_model):
    cache = TieredCache(tiny_model.config, device_budget=2 * PAGE, host_budget=0,
                        recompute_with=tiny_model)  # fmt: skip
    ids = torch.cat([prompt(30), prompt(30, seed=2)])  # [2, 30]
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a padded row
    with torch.no_grad():
        with pytest.raises(InvalidArgumentError, match="padding"):
            tiny_model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        assert cache.get_seq_length() == 0
        embeds = tiny_model.get_input_embeddings()(ids)
        with pytest.raises(InvalidArgumentError, match="inputs_embeds"):
            tiny_model(inputs_embeds=embeds, past_key_values=cache)
        assert cache.get_seq_length() == 0
        positions = torch.arange(3, 33)[None].expand(2, 30)
        with pytest.raises(InvalidArgumentError, match="position_ids"):
            tiny_model(input_ids=ids, position_ids=positions, past_key_values=cache)
        assert cache.get_seq_length() == 0
        # Through the backbone, the hook on the model does not see the step's ids ...
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            tiny_model.model(input_ids=ids[:, :10], past_key_values=cache)
            # ... and the next step through the model is refused: its pages could not be
            # recomputed.
            with pytest.raises(KVStackError, match="another module"):
                tiny_model(input_ids=ids[:, 10:], past_key_values=cache)
    assert cache.get_seq_length() == 10
    cache.close()


def test_save_refuses_a_conversation_with_dropped_pages_and_keeps_the_cache(tiny_model, tmp_path):
    cache = TieredCache(
        tiny_model.config,
        device_budget=PAGE,
        host_budget=0,
        disk_path=tmp_path,
        disk_budget=disk_file_bytes(2),
        recompute_with=tiny_model,
    )
    ids = prompt(60)
    out = greedy(tiny_model, ids, cache, 4)
    with pytest.raises(InvalidArgumentError, match="dropped"):
        cache.save(out)
    assert cache.store.disk.read_record("conversation.json") is None
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
    assert torch.equal(greedy(tiny_model, out, cache, 4), expected)  # it goes on
    cache.close()


def test_a_resumed_conversation_recomputes_its_saved_pages_from_the_saved_tokens(
    tiny_model, tmp_path
):
    """Saved with room for every page; resumed with a disk that holds only them, so the next
    turn's pages drop saved ones, which are recomputed from the saved token ids."""
    ids = prompt(40)
    first = TieredCache(tiny_model.config, device_budget=PAGE, host_budget=0,
                        disk_path=tmp_path, disk_budget="1MiB")  # fmt: skip
    out = greedy(tiny_model, ids, first, 10)
    first.save(out)
    saved_bytes = first.store.disk.bytes_used
    first.close()
    ids = torch.cat([out, prompt(20, seed=9)], dim=1)
    expected = greedy(tiny_model, ids, DynamicCache(config=tiny_model.config), 8)
    cache = TieredCache.resume(
        tiny_model.config,
        disk_path=tmp_path,
        token_ids=ids,
        device_budget=PAGE,
        host_budget=0,
        disk_budget=saved_bytes,
        recompute_with=tiny_model,
    )
    assert torch.equal(greedy(tiny_model, ids, cache, 8), expected)
    stats = cache.stats()
    assert stats["pages_dropped"] > 0 and stats["recomputes"] > 0 and stats["hits"]["disk"] > 0
    cache.store.check()
    cache.close()
