"""TokenTableCache: budgets hold, reclamation is lossless against Naive-Evict, StreamingLLM is
exact against a full cache with the evicted positions masked out, and bad input is refused."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.hf import PagedCache, TokenTableCache
from kvstack.policies import H2O, TOVA, RandomEviction, Scissorhands, SnapKV, StreamingLLM
from spec_tests.tiny import TINY_LLAMA

TINY = {**TINY_LLAMA, "max_position_embeddings": 512}
POLICIES = {
    "h2o": lambda: H2O(),
    "scissorhands": lambda: Scissorhands(history=8, recent_tokens=4),
    "random": lambda: RandomEviction(seed=3),
    "streamingllm": lambda: StreamingLLM(sink_tokens=4),
    "snapkv": lambda: SnapKV(window=8, kernel_size=3),
    "tova": lambda: TOVA(),
}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def tiny_llama(attn="kvstack", layers=2):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": layers})).eval()
    model.set_attn_implementation(attn)
    return model


def prompt(length=60, batch=1, seed=1):
    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", 20)
    return model.generate(ids, past_key_values=cache, do_sample=False, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_reclaim_gives_naive_evict_tokens_in_fewer_bytes(name):
    model, ids = tiny_llama(), prompt()
    caches = {
        reclaim: TokenTableCache(
            model.config, POLICIES[name](), budget=24, block_size=4, reclaim=reclaim
        )
        for reclaim in (True, False)
    }
    outputs = {reclaim: generate(model, ids, cache) for reclaim, cache in caches.items()}
    assert torch.equal(outputs[True], outputs[False]), (
        "reclamation must not change what the model reads"
    )
    reclaimed, naive = caches[True].stats(), caches[False].stats()
    assert reclaimed["live_tokens_all_layers"] == naive["live_tokens_all_layers"] == 2 * 24
    assert reclaimed["live_tokens_per_layer"] == 24  # one row at its budget in each layer
    assert reclaimed["bytes_used_kv"] < naive["bytes_used_kv"]
    assert reclaimed["repacks"] > 0 and naive["repacks"] == 0
    for layer in caches[True].paged_layers:
        for table in layer.tables:
            assert table.num_live <= 24
            table.check_invariants()
            # Repacked down to at most one partly filled block beyond ceil(live / block_size)
            # (appends refill holes; a repack runs only when waste exceeds the threshold).
            assert len(table.blocks) <= math.ceil(table.num_live / 4) + 1


def test_budget_by_ratio_follows_each_rows_real_prompt():
    model = tiny_llama()
    ids = prompt(40, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :20] = 0  # row 0 has 20 real tokens, row 1 has 40
    ids[mask == 0] = 0
    cache = TokenTableCache(model.config, StreamingLLM(sink_tokens=2), ratio=0.5, block_size=4)
    generate(model, ids, cache, attention_mask=mask, max_new_tokens=6)
    live = [table.num_live for table in cache.layers[0].tables]
    assert live == [10, 20]


def streaming_reference(model, ids, sinks, budget, steps):
    """Greedy decoding with a full DynamicCache and eager attention, where each decode query
    may see only the sinks and the last ``budget - sinks`` tokens before it (a 4D mask)."""
    model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    logits = model(ids, past_key_values=cache).logits[:, -1]
    tokens = [int(logits.argmax(-1))]
    for _ in range(steps - 1):
        seen = cache.get_seq_length()
        visible = torch.zeros(seen + 1, dtype=torch.bool)
        visible[:sinks] = True
        visible[seen - (budget - sinks) :] = True  # the recent window and the query itself
        mask = torch.zeros(1, 1, 1, seen + 1).masked_fill(~visible, torch.finfo(torch.float32).min)
        out = model(
            torch.tensor([[tokens[-1]]]),
            past_key_values=cache,
            attention_mask=mask,
            position_ids=torch.tensor([[seen]]),
        )
        tokens.append(int(out.logits[:, -1].argmax(-1)))
    return tokens


def test_streamingllm_equals_full_cache_with_evicted_positions_masked():
    model, ids = tiny_llama(layers=3), prompt(50)
    sinks, budget, steps = 4, 16, 24
    expected = streaming_reference(model, ids, sinks, budget, steps)
    model.set_attn_implementation("kvstack")
    cache = TokenTableCache(
        model.config, StreamingLLM(sink_tokens=sinks), budget=budget, block_size=4
    )
    got = generate(model, ids, cache, max_new_tokens=steps)[0, 50:].tolist()
    assert got == expected


def test_token_table_cache_runs_beam_search_and_keeps_budgets():
    model, ids = tiny_llama(), prompt(30, batch=2)
    cache = TokenTableCache(model.config, H2O(), budget=12, block_size=4)
    out = generate(model, ids, cache, num_beams=3, max_new_tokens=10)
    assert out.shape[0] == 2
    assert all(t.num_live <= 12 for layer in cache.paged_layers for t in layer.tables)


# ----------------------------------------------------------------------------- bad input
def test_budget_smaller_than_what_the_policy_must_keep():
    config = tiny_llama().config
    with pytest.raises(InvalidArgumentError, match=r"budget=3 .*StreamingLLM.*>= 5"):
        TokenTableCache(config, StreamingLLM(sink_tokens=4), budget=3)
    with pytest.raises(InvalidArgumentError, match=r"budget=10 .*>= 21"):
        TokenTableCache(config, Scissorhands(recent_tokens=20), budget=10)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({}, "exactly one of budget and ratio"),
        ({"budget": 8, "ratio": 0.5}, "exactly one of budget and ratio"),
        ({"ratio": 1.5}, "ratio must be in (0, 1]"),
        ({"budget": 8, "repack_threshold": 1.0}, "repack_threshold"),
    ],
)
def test_budget_arguments_are_checked(kwargs, words):
    with pytest.raises(
        InvalidArgumentError,
        match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\["),
    ):
        TokenTableCache(tiny_llama().config, H2O(), **kwargs)


def test_policy_that_needs_weights_on_another_attention_says_how_to_switch():
    model = tiny_llama(attn="sdpa")
    cache = TokenTableCache(model.config, H2O(), budget=16)
    with pytest.raises(KVStackError, match=r"set_attn_implementation\('kvstack'\)"):
        generate(model, prompt(), cache)


def test_cache_built_for_another_model_is_refused():
    model = tiny_llama()
    other = LlamaConfig(**{**TINY, "num_key_value_heads": 4})
    for cache in (PagedCache(other), TokenTableCache(other, H2O(), budget=16)):
        with pytest.raises(KVStackError, match="built for a model with 4 KV heads"):
            generate(model, prompt(), cache)
    deeper = tiny_llama(layers=3)
    with pytest.raises(KVStackError, match="built for a model with 2 layers"):
        generate(deeper, prompt(), PagedCache(model.config))


def test_kv_on_another_device_is_refused_and_changes_nothing():
    model = tiny_llama()
    for cache in (PagedCache(model.config), TokenTableCache(model.config, H2O(), budget=16)):
        generate(model, prompt(), cache, max_new_tokens=2)
        before = cache.stats()
        key = torch.zeros(1, TINY["num_key_value_heads"], 1, 16, device="meta")
        with pytest.raises(KVStackError, match="K/V on meta.*pool is on cpu"):
            cache.update(key, key, 0)
        assert cache.stats() == before


def test_policy_must_be_a_policy():
    with pytest.raises(InvalidArgumentError, match="policy must be an EvictionPolicy"):
        TokenTableCache(tiny_llama().config, "h2o", budget=16)


@pytest.mark.parametrize("name", ["h2o", "scissorhands", "snapkv", "tova"])
def test_observing_a_prefill_in_query_chunks_decides_as_at_once(name, monkeypatch):
    """A policy sees a long prefill's weights OBSERVE_CHUNK queries at a time and evicts after
    the last chunk; with 7-query chunks over a 60-token prompt it must keep exactly the tokens
    it keeps when it sees all 60 rows at once (H2O's sums may differ in the last bit only)."""
    import kvstack.hf.attention as kv_attention

    model, ids = tiny_llama(), prompt(length=60, batch=2)
    kept = {}
    for chunk in (7, 1024):
        monkeypatch.setattr(kv_attention, "OBSERVE_CHUNK", chunk)
        cache = TokenTableCache(model.config, POLICIES[name](), budget=24, block_size=4)
        tokens = generate(model, ids, cache, max_new_tokens=8)
        alive = [layer.batch.alive.clone() for layer in cache.paged_layers]
        kept[chunk] = (tokens, alive)
    assert torch.equal(kept[7][0], kept[1024][0])
    for chunked, whole in zip(kept[7][1], kept[1024][1], strict=True):
        assert torch.equal(chunked, whole)


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("prefill_chunk", [None, 16])
def test_a_prefill_computing_weights_of_observed_rows_only_decides_as_with_all(
    name, prefill_chunk, monkeypatch
):
    """A prefill computes attention weights only for the rows the policy reads
    (``observed_queries``) and every output by the fastest path (SDPA over the step's K/V for a
    first prefill, one paged call without weights otherwise). It must keep exactly the tokens,
    and generate exactly the tokens, of a prefill that computes every row's weights and output
    through the paged attention (as before), also when the prompt comes in chunks."""
    from kvstack.hf.token_table_cache import TokenTableLayer

    model, ids = tiny_llama(), prompt(length=60, batch=2)
    runs = {}
    for every_row in (False, True):
        if every_row:  # every query observed: the paged path with weights for all rows
            monkeypatch.setattr(TokenTableLayer, "observed_queries", lambda self, n: n)
        cache = TokenTableCache(
            model.config, POLICIES[name](), budget=24, block_size=4, prefill_chunk=prefill_chunk
        )
        tokens = generate(model, ids, cache, max_new_tokens=8)
        runs[every_row] = (tokens, [layer.batch.alive.clone() for layer in cache.paged_layers])
    assert torch.equal(runs[False][0], runs[True][0])
    for fast, every in zip(runs[False][1], runs[True][1], strict=True):
        assert torch.equal(fast, every)


def test_a_first_prefill_takes_sdpa_and_a_policy_reads_only_its_rows(monkeypatch):
    """The fast path is taken: a first prefill's outputs come from SDPA, and SnapKV (window 8)
    gets the weights of its last 8 + 60 % 8 = 12 queries of a 60-token prompt only."""
    import kvstack.hf.attention as kv_attention

    calls, rows = [], []
    real_sdpa = kv_attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        kv_attention.F,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append(a[0].shape) or real_sdpa(*a, **k),
    )
    real_observe = TokenTableCache.layer_class.observe_attention
    monkeypatch.setattr(
        TokenTableCache.layer_class,
        "observe_attention",
        lambda self, w: rows.append(w.shape[2]) or real_observe(self, w),
    )
    model, ids = tiny_llama(), prompt(length=60, batch=1)
    cache = TokenTableCache(model.config, SnapKV(window=8, kernel_size=3), budget=24)
    generate(model, ids, cache, max_new_tokens=1)
    layers = model.config.num_hidden_layers
    assert [shape[2] for shape in calls] == [60] * layers  # [B, H_q, T_q, D], once per layer
    assert rows == [12] * layers


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("size", [{"budget": 24}, {"ratio": 0.5}])
def test_a_prompt_announced_and_fed_a_chunk_per_call_keeps_what_one_call_keeps(name, size):
    """``expect_prompt`` (a serving engine's prefill, a chunk per step): fed in calls of
    ``prefill_chunk`` tokens, the prompt leaves exactly the tables, bytes and reservation of one
    call of the whole prompt (which the cache chunks itself), and decoding goes on alike."""
    model, ids = tiny_llama(), prompt(length=60, batch=1)
    chunk = 16

    def make():
        return TokenTableCache(
            model.config, POLICIES[name](), block_size=4, prefill_chunk=chunk, **size
        )

    whole, pieces = make(), make()
    pieces.expect_prompt(ids.shape[1])
    with torch.inference_mode():
        logits_whole = model(ids, past_key_values=whole, use_cache=True).logits[:, -1]
        for start in range(0, ids.shape[1], chunk):
            out = model(
                ids[:, start : start + chunk],
                past_key_values=pieces,
                use_cache=True,
                position_ids=torch.arange(start, min(start + chunk, ids.shape[1]))[None],
            )
            if start + chunk < ids.shape[1]:  # not the prompt's end: no budget-sized tables yet
                assert pieces.layers_prefilled == 0
    torch.testing.assert_close(out.logits[:, -1], logits_whole)
    for mine, theirs in zip(pieces.paged_layers, whole.paged_layers, strict=True):
        assert torch.equal(mine.batch.alive, theirs.batch.alive)
        assert mine.budgets == theirs.budgets
    for key in ("bytes_used", "blocks_allocated", "bytes_reserved"):
        assert pieces.stats()[key] == whole.stats()[key], key
    assert pieces.layers_prefilled == whole.layers_prefilled == len(whole.paged_layers)
    following = out.logits[:, -1].argmax(-1, keepdim=True)
    with torch.inference_mode():
        a = model(following, past_key_values=whole, use_cache=True).logits
        b = model(following, past_key_values=pieces, use_cache=True).logits
    torch.testing.assert_close(a, b)


def test_expect_prompt_refuses_what_breaks_the_announcement_and_changes_nothing():
    model, ids = tiny_llama(), prompt(length=40, batch=1)
    with pytest.raises(InvalidArgumentError, match="prefill_chunk=N"):
        TokenTableCache(model.config, H2O(), budget=16).expect_prompt(40)
    cache = TokenTableCache(model.config, H2O(), budget=16, prefill_chunk=8)
    with pytest.raises(InvalidArgumentError, match="prompt_tokens"):
        cache.expect_prompt(0)
    cache.expect_prompt(40)
    with pytest.raises(InvalidArgumentError, match="once, before"):
        cache.expect_prompt(40)
    with (
        pytest.raises(InvalidArgumentError, match="at most prefill_chunk=8"),
        torch.inference_mode(),
    ):
        model(ids[:, :9], past_key_values=cache, use_cache=True)  # more than a chunk
    assert cache.get_seq_length() == 0
    assert cache.stats()["bytes_used"] == 0
    with torch.inference_mode():  # the announced prompt, a chunk at a time, still goes in
        for start in range(0, 40, 8):
            model(
                ids[:, start : start + 8],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.arange(start, start + 8)[None],
            )
    assert cache.layers_prefilled == len(cache.paged_layers)


def test_stats_keys_are_the_documented_ones_with_their_units():
    from kvstack.hf import paged, token_table_cache

    layers, budget, new_tokens = 3, 12, 6
    model, ids = tiny_llama(layers=layers), prompt(length=40, batch=2)
    seen = ids.shape[1] + new_tokens - 1  # the last generated token is never fed back
    # (cache, its units, live tokens per layer over the 2 rows): PagedCache keeps every token
    # seen; H2O keeps one table per row and KV head, each at the budget (1/heads a token).
    cases = [
        (lambda: PagedCache(model.config, block_size=4), paged.STATS_UNITS, 2 * seen),
        (
            lambda: TokenTableCache(model.config, H2O(), budget=budget, block_size=4),
            token_table_cache.STATS_UNITS,
            2 * budget,
        ),
    ]
    for make, units, per_layer in cases:
        empty = make()
        assert set(empty.stats()) == set(units), type(empty).__name__
        for key in units:
            assert f"``{key}``: {units[key]}" in type(empty).stats.__doc__, key
        cache = make()
        generate(model, ids, cache, max_new_tokens=new_tokens)
        stats = cache.stats()
        assert set(stats) == set(units)
        assert stats["seen_tokens_per_sequence"] == seen
        assert stats["live_tokens_per_layer"] == per_layer
        assert stats["live_tokens_all_layers"] == per_layer * layers
    assert token_table_cache.STATS_UNITS.keys() - paged.STATS_UNITS.keys() == {"repack_seconds"}


@pytest.mark.parametrize("name", ["h2o", "snapkv"])
@pytest.mark.parametrize("announced", [False, True])
def test_a_chunked_prefill_leaves_every_table_within_its_reservation(name, announced):
    """Each prefill chunk's evictions leave as many holes as the chunk has tokens, more than
    a decode ever refills; the cache repacks such a table at once, so that every table holds
    no more blocks than its budget and one decode token need (what ``blocks_to_reserve``
    counts), even where the holes are too few for the waste threshold to repack it (budget
    150, chunks of 32: 10 blocks hold it and one decode token, 11 would leave 26 holes, under a
    sixth of their slots), and decode steps keep it so."""
    model, ids = tiny_llama(), prompt(300)
    cache = TokenTableCache(
        model.config, POLICIES[name](), ratio=0.5, block_size=16, prefill_chunk=32
    )
    if announced:  # a serving engine's prefill: a chunk per call
        cache.expect_prompt(ids.shape[1])
        with torch.inference_mode():
            for start in range(0, ids.shape[1], 32):
                model(ids[:, start : start + 32], past_key_values=cache, use_cache=True)
    else:
        generate(model, ids, cache, max_new_tokens=40)
    for layer in cache.paged_layers:
        batch = layer.batch
        for index in range(batch.num_tables):
            assert batch.num_live[index] == layer.budgets[index] == 150
            assert cache.steady_blocks_per_table(150) == 10  # 150 live tokens and one appended
            assert len(batch.blocks[index]) <= 10, (layer.layer_idx, index)
