"""The Hugging Face caches on a KVArena: one budget for many caches, real bytes that fall after
eviction, chunked prefill with a bounded peak, exhaustion without damage, and bad input.

Random tiny Llama models (fp32, CPU): fast, and exact enough for token equality."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, LogitsProcessor

from kvstack.arena import DEFAULT_SEGMENT_BYTES, KVArena
from kvstack.errors import ArenaExhausted, InvalidArgumentError
from kvstack.hf import PagedCache, TokenTableCache
from kvstack.policies import H2O, SnapKV
from spec_tests.tiny import TINY_LLAMA, greedy, random_prompt, tiny_kvstack_llama

TINY = {**TINY_LLAMA, "max_position_embeddings": 1024}
HEAD_DIM = 16
BLOCK_BYTES = 16 * 2 * HEAD_DIM * 2 * 4  # block_size x KV heads x head_dim x (K, V) x fp32


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.fixture(scope="module")
def model():
    return tiny_kvstack_llama()


def prompt(length=60, seed=1):
    return random_prompt(length, seed=seed)


def generate(model, ids, cache, **kwargs):
    return greedy(model, ids, cache, **{"max_new_tokens": 12, **kwargs})


def test_caches_on_one_arena_give_their_solo_tokens_and_leave_it_empty(model):
    arena = KVArena("2MiB")
    prompts = [prompt(40 + 17 * i, seed=i) for i in range(3)]
    solo = [generate(model, ids, DynamicCache(config=model.config)) for ids in prompts]
    caches = [PagedCache(model.config, arena=arena) for _ in prompts]
    for ids, cache, expected in zip(prompts, caches, solo, strict=True):
        assert torch.equal(generate(model, ids, cache), expected)
    # All three live at once in the one buffer: the arena's bytes are the sum of theirs.
    used = [cache.stats()["bytes_used"] for cache in caches]
    assert arena.bytes_used == sum(used) > 0
    for cache in caches:
        pool = cache.paged_layers[0].pool
        assert pool.key.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
        assert cache.stats()["bytes_reserved"] == cache.stats()["bytes_used"] + arena.bytes_free
    for cache in caches:
        cache.release()
    assert arena.bytes_used == 0 and not arena.pages
    assert arena.free_extents == [(0, arena.capacity)]
    assert arena.capacity_bytes == 2 * 2**20  # never grew


def test_freed_pages_serve_the_next_cache(model):
    # Room for one cache's prompt at a time: the second only fits after the first is released.
    ids = prompt(200)
    blocks = math.ceil((200 + 12) / 16) * 2  # per layer: tokens in blocks, one table per row
    arena = KVArena(blocks * BLOCK_BYTES + BLOCK_BYTES)
    first = PagedCache(model.config, arena=arena)
    expected = generate(model, ids, first)
    with pytest.raises(ArenaExhausted):
        generate(model, ids, PagedCache(model.config, arena=arena))
    first.release()
    assert torch.equal(generate(model, ids, PagedCache(model.config, arena=arena)), expected)


def test_exhaustion_names_bytes_and_leaves_other_caches_unchanged(model):
    arena = KVArena(20 * BLOCK_BYTES)
    holder = PagedCache(model.config, arena=arena)
    generate(model, prompt(50), holder, max_new_tokens=2)
    layer = holder.paged_layers[0]
    before = layer.pool.read(layer.batch.slots[0].clone())
    pages_before = {page: page.offset for page in arena.pages}
    stats_before = holder.stats()
    with pytest.raises(ArenaExhausted, match=r"need \d+ bytes .* has \d+ bytes free"):
        generate(model, prompt(300, seed=2), PagedCache(model.config, arena=arena))
    # The failed cache's partial prefill (layer 0) holds pages until it is released, so only
    # compare the holder: its pages, their offsets and contents, its stats.
    assert {p: o for p, o in pages_before.items()} == {
        page: page.offset for page in pages_before if page in arena.pages
    }
    after = layer.pool.read(layer.batch.slots[0].clone())
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert holder.stats() == stats_before


def test_a_private_arena_gives_segments_back_after_eviction(model):
    ids, segment = prompt(700), 32 * 2**10
    paged = PagedCache(model.config, arena=KVArena.private(segment_bytes=segment))
    generate(model, ids, paged, max_new_tokens=4)
    arena = KVArena.private(segment_bytes=segment)
    evicting = TokenTableCache(model.config, policy=H2O(), budget=64, arena=arena)
    generate(model, ids, evicting, max_new_tokens=4)
    stats = evicting.stats()
    # During prefill one layer held the whole prompt; afterwards whole segments went back.
    assert stats["peak_bytes_used"] >= 700 * 2 * HEAD_DIM * 2 * 4  # one layer's full prompt
    real = evicting.arena.buffer.untyped_storage().nbytes()
    assert real == stats["bytes_reserved"] == evicting.arena.capacity_bytes
    assert real < paged.arena.buffer.untyped_storage().nbytes() / 2
    assert real % segment == 0
    assert real - stats["bytes_used"] < 2 * segment  # at most two segments idle
    # Without arena=, a cache's private arena grows by the documented segment.
    default = PagedCache(model.config)
    generate(model, prompt(20), default, max_new_tokens=1)
    assert (
        default.arena.growable
        and default.arena.segment * default.arena.itemsize == DEFAULT_SEGMENT_BYTES
    )


def test_a_compaction_mid_generation_keeps_tokens(model):
    ids = prompt(90)
    expected = generate(model, ids, TokenTableCache(model.config, policy=H2O(), budget=40))
    arena = KVArena("1MiB")
    # A hole at the bottom of the arena that compaction will close, moving the cache's blocks.
    filler = PagedCache(model.config, arena=arena)
    generate(model, prompt(40, seed=5), filler, max_new_tokens=1)
    cache = TokenTableCache(model.config, policy=H2O(), budget=40, arena=arena)

    class CompactOnce(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            CompactOnce.calls += 1
            if CompactOnce.calls == 4:
                filler.release()
                arena.compact()
            return scores

    out = model.generate(
        ids,
        past_key_values=cache,
        do_sample=False,
        pad_token_id=0,
        max_new_tokens=12,
        logits_processor=[CompactOnce()],
    )
    assert arena.compactions >= 1
    assert torch.equal(out, expected)


@pytest.mark.parametrize("policy", [H2O, SnapKV])
def test_chunked_prefill_holds_at_most_budget_plus_chunk(model, policy, monkeypatch):
    ids, budget, chunk = prompt(300), 48, 64
    cache = TokenTableCache(model.config, policy=policy(), budget=budget, prefill_chunk=chunk)
    most = {"live": 0}
    after_attention = type(cache.paged_layers[0]).after_attention

    def watch(layer):
        most["live"] = max(most["live"], max(layer.batch.num_live))
        after_attention(layer)

    monkeypatch.setattr(type(cache.paged_layers[0]), "after_attention", watch)
    out = generate(model, ids, cache)
    assert budget < most["live"] <= budget + chunk
    assert max(layer.batch.num_live[0] for layer in cache.paged_layers) == budget
    assert out.shape[1] == 300 + 12


def test_chunked_prefill_completes_on_an_arena_smaller_than_the_prompt(model):
    ids, budget, chunk = prompt(600), 48, 64
    full_kv = 600 * 2 * (2 * HEAD_DIM * 2 * 4)  # tokens x layers x one token's K and V
    arena = KVArena(full_kv // 3)
    expected = generate(
        model, ids, TokenTableCache(model.config, policy=H2O(), budget=budget, prefill_chunk=chunk)
    )
    cache = TokenTableCache(
        model.config, policy=H2O(), budget=budget, prefill_chunk=chunk, arena=arena
    )
    assert torch.equal(generate(model, ids, cache), expected)
    assert arena.stats()["peak_bytes_used"] < full_kv // 3
    with pytest.raises(ArenaExhausted):  # without chunks the prefill does not fit
        generate(
            model, ids, TokenTableCache(model.config, policy=H2O(), budget=budget, arena=arena)
        )


def test_stats_are_real_bytes_of_the_private_arena(model):
    cache = PagedCache(model.config)
    generate(model, prompt(100), cache)
    stats = cache.stats()
    blocks = stats["blocks_allocated"]
    assert stats["bytes_used"] == stats["bytes_used_kv"] == blocks * BLOCK_BYTES
    assert stats["bytes_used_state"] == 0
    assert stats["bytes_reserved"] == cache.arena.buffer.untyped_storage().nbytes()
    assert stats["peak_bytes_reserved"] >= stats["bytes_reserved"]
    assert set(cache.STATS_UNITS) == set(stats)
    assert cache.arena.stats()["bytes_used"] == stats["bytes_used"]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("capacity", [-1, "lots", "2 GiBs", True, 1.5])
def test_bad_capacity_is_refused(capacity):
    with pytest.raises((InvalidArgumentError, TypeError), match="capacity"):
        KVArena(capacity)


def test_an_arena_smaller_than_one_block_is_refused(model):
    arena = KVArena(BLOCK_BYTES - 4)
    with pytest.raises(InvalidArgumentError, match=f"smaller than one KV block.*{BLOCK_BYTES}"):
        PagedCache(model.config, arena=arena)
    # Per-head tables (H2O) need only one KV head per block.
    TokenTableCache(model.config, policy=H2O(), budget=32, arena=KVArena(BLOCK_BYTES // 2))


def test_an_arena_of_another_dtype_is_refused(model):
    config = LlamaConfig(**TINY)
    config.dtype = torch.float16
    with pytest.raises(InvalidArgumentError, match="float16"):
        PagedCache(config, arena=KVArena("1MiB", dtype=torch.float32))
    # A config without a dtype is checked at the first step, before anything is stored.
    arena = KVArena("1MiB", dtype=torch.bfloat16)
    cache = PagedCache(model.config, arena=arena)
    with pytest.raises(InvalidArgumentError, match="bfloat16"):
        generate(model, prompt(20), cache)
    assert arena.bytes_used == 0 and not arena.pages


def test_an_arena_on_another_device_is_refused(model):
    arena = KVArena("1MiB", device="meta")
    cache = PagedCache(model.config, arena=arena)
    with pytest.raises(InvalidArgumentError, match="meta"):
        generate(model, prompt(20), cache)
    assert not arena.pages


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_arena_bytes_are_cuda_memory_allocated():
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    arena = KVArena("64MiB", device="cuda")
    assert torch.cuda.memory_allocated() - before == 64 * 2**20 == arena.stats()["bytes_reserved"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).cuda().eval()
    model.set_attn_implementation("kvstack")
    ids = prompt(200).cuda()
    allocated = torch.cuda.memory_allocated()
    cache = TokenTableCache(model.config, policy=H2O(), budget=64, arena=arena)
    generate(model, ids, cache)
    torch.cuda.synchronize()
    # The arena never grows: the cache's KV adds no CUDA memory beyond its small tables.
    assert torch.cuda.memory_allocated() - allocated < 2**20
    assert cache.stats()["bytes_used"] == arena.stats()["bytes_used"] > 0
    private = TokenTableCache(model.config, policy=H2O(), budget=64)
    start = torch.cuda.memory_allocated()
    generate(model, ids, private)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - start
    assert private.stats()["bytes_reserved"] <= held < private.stats()["bytes_reserved"] + 2**20
