"""HeadwiseCache (Tangram's per-head budgets): what it computes, what it holds, what it refuses.

* every budget 1.0: exactly ``PagedCache``'s tokens (nothing is evicted);
* budgets below 1: exactly a full cache whose attention masks, per KV head, the prompt entries
  that head did not keep (the kvpress way of head-wise compression, which frees nothing), while
  the cache holds only the kept entries' blocks;
* a profile made for another model, an unreadable one, a policy that is not per-head: refused
  at construction, with the arena untouched.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AttentionInterface, DynamicCache, LlamaForCausalLM

import kvstack.hf  # noqa: F401  (registers the "kvstack" attention)
from kvstack.arena import KVArena
from kvstack.calibrate import HeadProfile, ProfileError, model_identity
from kvstack.errors import InvalidArgumentError
from kvstack.hf import HeadwiseCache, PagedCache
from kvstack.hf.headwise import kept_prompt_entries, masked_attention
from kvstack.policies import SnapKV, StreamingLLM

from .tiny import tiny_llama_config

MASKED = "kvstack_test_headwise_masked"
WINDOW = 8
PROMPT, NEW = 48, 10


def profile_for(config, budgets) -> HeadProfile:
    return HeadProfile(
        budgets=tuple(tuple(row) for row in budgets),
        mean=tuple(tuple(row) for row in budgets),
        std=tuple(tuple(0.0 for _ in row) for row in budgets),
        ratio=0.25,
        alpha=2.0,
        model=model_identity(config),
        calibration={},
    )


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = tiny_llama_config(num_hidden_layers=3, max_position_embeddings=256)
    return LlamaForCausalLM(config).eval()


def prompt_ids(length: int = PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, attn: str, new: int = NEW):
    model.set_attn_implementation(attn)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, ids.shape[1] :].tolist(), torch.stack(out.scores)


def test_every_budget_at_one_gives_paged_cache_tokens(tiny_model):
    config, ids = tiny_model.config, prompt_ids()
    ones = profile_for(config, [[1.0, 1.0]] * 3)
    cache = HeadwiseCache(config, ones, policy=SnapKV(window=WINDOW))
    tokens, scores = greedy(tiny_model, ids, cache, "kvstack")
    paged_tokens, paged_scores = greedy(tiny_model, ids, PagedCache(config), "kvstack")
    assert tokens == paged_tokens
    torch.testing.assert_close(scores, paged_scores, rtol=1e-4, atol=1e-4)
    for layer in cache.paged_layers:  # nothing evicted
        assert layer.batch.num_live == [PROMPT + NEW - 1] * 2


BUDGETS = [[0.3, 0.7], [0.5, 0.15], [1.0, 0.4]]


def test_budgets_below_one_equal_a_full_cache_with_those_entries_masked(tiny_model):
    config, ids = tiny_model.config, prompt_ids()
    cache = HeadwiseCache(config, profile_for(config, BUDGETS), policy=SnapKV(window=WINDOW))
    tokens, scores = greedy(tiny_model, ids, cache, "kvstack")
    kept = kept_prompt_entries(cache, PROMPT)
    for row, layer in zip(BUDGETS, cache.paged_layers, strict=True):
        for head, share in enumerate(row):
            # SnapKV's window, and ceil(B x the rest) of the other prompt tokens.
            expected = WINDOW + math.ceil(share * (PROMPT - WINDOW))
            assert int(kept[layer.layer_idx][head].sum()) == expected
            assert kept[layer.layer_idx][head, PROMPT - WINDOW :].all()  # the window is kept
            # Decode tokens are all kept: the table holds its prompt share and every new token.
            assert layer.batch.num_live[head] == expected + NEW - 1
    AttentionInterface.register(MASKED, masked_attention(kept, PROMPT))
    dense_tokens, dense_scores = greedy(tiny_model, ids, DynamicCache(config=config), MASKED)
    assert tokens == dense_tokens
    torch.testing.assert_close(scores, dense_scores, rtol=1e-4, atol=1e-4)
    # Without the mask the full cache answers differently: the test can tell them apart.
    _, full_scores = greedy(tiny_model, ids, DynamicCache(config=config), "eager")
    assert not torch.allclose(scores, full_scores, rtol=1e-4, atol=1e-4)


def test_decode_steps_run_the_ragged_attention_from_the_ahead_of_time_work_list(
    tiny_model, monkeypatch
):
    """Every decode step of every layer is one ragged attention call with the cache's static
    plan for that layer (sorted groups of one head, Tangram's splits for ``workers``); how many
    splits the plan makes does not change a token."""
    from kvstack import ops
    from kvstack.head_groups import group_heads, plan_ahead_of_time, work_list

    config, ids = tiny_model.config, prompt_ids()
    op = ops.operations()["ragged_decode_attention"]
    calls = []
    for backend, implementation in list(op.implementations.items()):

        def spy(*args, _run=implementation, **kwargs):
            calls.append((args[5].tolist(), args[6].tolist()))  # members, work
            return _run(*args, **kwargs)

        monkeypatch.setitem(op.implementations, backend, spy)
    results = {}
    for workers in (1, 7):
        calls.clear()
        cache = HeadwiseCache(
            config, profile_for(config, BUDGETS), policy=SnapKV(window=WINDOW), workers=workers
        )
        results[workers] = greedy(tiny_model, ids, cache, "kvstack")
        assert len(calls) == (NEW - 1) * len(BUDGETS)  # decode steps x attention layers
        groups = group_heads(BUDGETS, 1, "sorted")
        plan = plan_ahead_of_time(groups, workers)
        for step in range(NEW - 1):
            for row in range(len(BUDGETS)):
                members, work = calls[step * len(BUDGETS) + row]
                assert members == [list(group.heads) for group in groups[row]]
                assert work == [list(w) for w in work_list(plan[row])]
    assert max(len(w) for _, w in calls) > len(BUDGETS[0])  # 7 workers: some head is split
    assert results[1][0] == results[7][0]
    torch.testing.assert_close(results[1][1], results[7][1], rtol=1e-4, atol=1e-4)


def test_caches_of_one_profile_share_its_plans_until_the_profile_goes(tiny_model):
    """Plans are made once per profile object and shared (the engine batches the head-wise
    requests whose layers return the same plan); they go with the profile."""
    import gc

    from kvstack.hf import headwise

    config = tiny_model.config
    profile = profile_for(config, [[0.5, 0.25]] * config.num_hidden_layers)
    first, second = HeadwiseCache(config, profile), HeadwiseCache(config, profile)
    cpu = torch.device("cpu")
    assert first.ragged_plan(0, cpu) is second.ragged_plan(0, cpu)
    again = profile_for(config, [[0.5, 0.25]] * config.num_hidden_layers)  # equal, not the same
    other = HeadwiseCache(config, again).ragged_plan(0, cpu)
    assert other is not first.ragged_plan(0, cpu)
    assert all(torch.equal(a, b) for a, b in zip(other, first.ragged_plan(0, cpu), strict=True))
    key = id(profile)
    assert key in headwise._PLANS
    del first, second, profile
    gc.collect()
    assert key not in headwise._PLANS


def test_workers_that_are_not_a_positive_int_are_refused(tiny_model):
    for workers in (0, -1, 2.0, True):
        with pytest.raises(InvalidArgumentError, match="workers must be an int >= 1"):
            HeadwiseCache(
                tiny_model.config, profile_for(tiny_model.config, BUDGETS), workers=workers
            )


@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budgets=st.lists(
        st.lists(st.sampled_from([0.05, 0.2, 0.37, 0.5, 0.81, 1.0]), min_size=2, max_size=2),
        min_size=3,
        max_size=3,
    ),
    prompt=st.integers(3, 70),
    window=st.integers(1, 6),
    new=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_any_budgets_equal_the_masked_full_cache_and_keep_what_the_formula_says(
    tiny_model, budgets, prompt, window, new, seed
):
    """Random budgets, prompt lengths (shorter than the window too), windows and outputs."""
    config, ids = tiny_model.config, prompt_ids(prompt, seed)
    policy = SnapKV(window=window, kernel_size=3)
    cache = HeadwiseCache(config, profile_for(config, budgets), policy=policy)
    tokens, scores = greedy(tiny_model, ids, cache, "kvstack", new=new)
    kept = kept_prompt_entries(cache, prompt)
    for row, layer in zip(budgets, cache.paged_layers, strict=True):
        for head, share in enumerate(row):
            protected = min(prompt, window)
            budget = max(window + 1, protected + math.ceil(share * (prompt - protected)))
            assert int(kept[layer.layer_idx][head].sum()) == min(prompt, budget)
    AttentionInterface.register(MASKED, masked_attention(kept, prompt))
    dense_tokens, dense_scores = greedy(tiny_model, ids, DynamicCache(config=config), MASKED, new)
    assert tokens == dense_tokens
    torch.testing.assert_close(scores, dense_scores, rtol=1e-4, atol=1e-4)


def test_the_cache_holds_only_the_kept_entries_blocks(tiny_model):
    config, ids = tiny_model.config, prompt_ids(96)
    arena = KVArena("4MiB", dtype=torch.float32)
    cache = HeadwiseCache(
        config, profile_for(config, BUDGETS), arena=arena, policy=SnapKV(window=WINDOW)
    )
    greedy(tiny_model, ids, cache, "kvstack", new=1)  # the prompt only: evicted and repacked
    block_bytes = cache.min_page_bytes(arena.itemsize)  # 16 tokens of one KV head, K and V
    blocks = [len(b) for layer in cache.paged_layers for b in layer.batch.blocks]
    live = [n for layer in cache.paged_layers for n in layer.batch.num_live]
    # Repacked: each head's table holds at most its live tokens' blocks and the token a decode
    # step appends; the arena's bytes in use are exactly those blocks.
    assert all(b <= math.ceil((n + 1) / 16) for b, n in zip(blocks, live, strict=True))
    assert cache.stats()["bytes_used"] == arena.bytes_used == sum(blocks) * block_bytes
    paged = PagedCache(config, arena=KVArena("4MiB", dtype=torch.float32))
    greedy(tiny_model, ids, paged, "kvstack", new=1)
    mean_budget = sum(map(sum, BUDGETS)) / 6
    assert arena.bytes_used < (mean_budget + 0.2) * paged.stats()["bytes_used"]


# --------------------------------------------------------------------------- bad input
def test_a_profile_for_another_model_is_refused_and_the_arena_untouched(tiny_model):
    arena = KVArena("1MiB", dtype=torch.float32)
    other = tiny_llama_config(num_hidden_layers=4)
    with pytest.raises(ProfileError, match="num_hidden_layers=4.*this model has.*=3"):
        HeadwiseCache(tiny_model.config, profile_for(other, [[0.5, 0.5]] * 4), arena=arena)
    heads = tiny_llama_config(num_hidden_layers=3, num_key_value_heads=4)
    with pytest.raises(ProfileError, match="num_key_value_heads=4.*this model has.*=2"):
        HeadwiseCache(tiny_model.config, profile_for(heads, [[0.5] * 4] * 3), arena=arena)
    assert arena.bytes_used == 0 and not arena.pages


def test_a_corrupt_or_truncated_profile_file_is_refused(tiny_model, tmp_path):
    path = tmp_path / "profile.json"
    profile_for(tiny_model.config, BUDGETS).save(path)
    assert HeadwiseCache(tiny_model.config, path).profile.budgets == tuple(map(tuple, BUDGETS))
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ProfileError, match="not valid JSON"):
        HeadwiseCache(tiny_model.config, path)
    data = json.loads(text)
    data["budgets"][1][0] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"budgets\[1\]\[0\] = 1.5; expected a fraction"):
        HeadwiseCache(tiny_model.config, path)
    with pytest.raises(ProfileError, match="cannot be read"):
        HeadwiseCache(tiny_model.config, tmp_path / "missing.json")


def test_a_policy_that_is_not_per_head_or_a_profile_of_another_type_is_refused(tiny_model):
    profile = profile_for(tiny_model.config, BUDGETS)
    with pytest.raises(InvalidArgumentError, match="per-head.*StreamingLLM"):
        HeadwiseCache(tiny_model.config, profile, policy=StreamingLLM())
    with pytest.raises(InvalidArgumentError, match="HeadProfile or the path.*got dict"):
        HeadwiseCache(tiny_model.config, {"budgets": BUDGETS})


# --------------------------------------------------------------------------- the real model
def test_smollm2_tokens_equal_a_full_cache_with_the_same_entries_masked():
    """SmolLM2 (fp32, a chat prompt of ~150 tokens): head-wise budgets spread over (0, 1] give
    exactly the masked full cache's tokens, while the cache holds far fewer blocks."""
    from kvstack.models import load_smollm2

    model, tokenizer = load_smollm2(progress=False, fresh=True)  # fresh: we switch attention
    config = model.config
    generator = torch.Generator().manual_seed(0)
    budgets = (0.1 + 0.9 * torch.rand(30, 3, generator=generator)).tolist()  # [layer][kv head]
    text = (
        "Summarise in two sentences: the storage team moved the KV cache into fixed-size blocks "
        "so memory is allocated on demand. Token tables map each logical token to a physical "
        "slot, which lets an eviction policy drop single tokens; repacking moves the survivors "
        "into fewer blocks and returns the rest to the pool. Early measurements show fewer "
        "blocks per request, but answer quality on long documents is not yet measured."
    )
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(rendered, return_tensors="pt").input_ids
    prompt = ids.shape[1]
    cache = HeadwiseCache(config, profile_for(config, budgets))
    tokens, _ = greedy(model, ids, cache, "kvstack", new=24)
    kept = kept_prompt_entries(cache, prompt)
    AttentionInterface.register(MASKED, masked_attention(kept, prompt))
    dense_tokens, _ = greedy(model, ids, DynamicCache(config=config), MASKED, new=24)
    assert tokens == dense_tokens
    kept_fraction = sum(int(k.sum()) for k in kept.values()) / (30 * 3 * prompt)
    assert kept_fraction < 0.7
    paged = PagedCache(config)
    greedy(model, ids, paged, "kvstack", new=24)
    assert cache.stats()["bytes_used"] < 0.8 * paged.stats()["bytes_used"]
