"""The serving benchmark's pieces on a tiny random model: a trace run counts what it claims, the
arena is sized for the largest request, and the README table keeps every figure."""

from __future__ import annotations

import pytest
import torch

from kvstack.bench.serve import (
    HYBRID_MODELS,
    RecompileLimitWatch,
    _hf_continuous_batching,
    arrival_times,
    batched_decode_steps,
    full_kv_bytes,
    hybrid_config,
    largest_request_bytes,
    percentile,
    readme_tables,
    run_trace,
)
from kvstack.policies import H2O
from kvstack.serve import CacheSpec
from spec_tests.tiny import TINY_LLAMA, tiny_serving_llama

TINY = TINY_LLAMA


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama()


# The specification attention, FutureWarnings silenced (spec_tests/conftest.py).
pytestmark = pytest.mark.usefixtures("reference_attention")


def requests(count: int = 6):
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randint(1, 256, (10 + 7 * i,), generator=gen).tolist(), 12) for i in range(count)
    ]


def test_full_kv_bytes_counts_every_token_of_every_layer(model):
    # 2 layers x 2 KV heads x head_dim 16 x (K, V) x fp32 = 512 bytes a token.
    assert full_kv_bytes(model, [([1] * 10, 5), ([2] * 3, 2)]) == (15 + 5) * 512


def test_a_tight_arena_runs_fewer_requests_at_once_and_finishes_them_all(model):
    trace = requests()
    spec = CacheSpec()
    roomy = run_trace(
        model, 4 * full_kv_bytes(model, trace), spec, trace, max_batch_tokens=64, prefill_chunk=32
    )
    tight_bytes = largest_request_bytes(model, spec, trace)
    tight = run_trace(model, tight_bytes, spec, trace, max_batch_tokens=64, prefill_chunk=32)
    assert roomy.peak_generating == len(trace) and tight.peak_generating < roomy.peak_generating
    assert roomy.output_tokens == tight.output_tokens == 12 * len(trace)
    assert tight.outputs == roomy.outputs  # lossless: the arena size changes no token
    assert tight.steps > roomy.steps


def test_a_reclaiming_cache_never_outgrows_its_admission_while_naive_evict_does(model):
    trace = [(ids, 40) for ids, _ in requests()]
    naive = CacheSpec(policy=H2O(), ratio=0.5, reclaim=False)
    reclaim = CacheSpec(policy=H2O(), ratio=0.5)
    capacity = max(largest_request_bytes(model, s, trace) for s in (naive, reclaim))
    naive_run, reclaim_run = (
        run_trace(model, capacity, s, trace, max_batch_tokens=64, prefill_chunk=32)
        for s in (naive, reclaim)
    )
    assert naive_run.preemptions > 0 and reclaim_run.preemptions == 0
    assert naive_run.outputs == reclaim_run.outputs  # the same evictions, only memory differs


def test_the_batched_decode_is_timed_against_the_general_path_on_one_engine(model, monkeypatch):
    from kvstack.serve import evicting_decode

    calls = []
    real = evicting_decode.attend_steady_decodes

    def counted(layers, *args):
        calls.append(len(layers))
        return real(layers, *args)

    monkeypatch.setattr(evicting_decode, "attend_steady_decodes", counted)
    # A prompt of 3 chunks beside short ones, which decode while it is prefilled.
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=gen).tolist() for n in (12, 300, 20)]
    batched, general = batched_decode_steps(
        model, CacheSpec(policy=H2O(), ratio=0.5), prompts, rounds=2, block=3
    )
    assert len(batched) == len(general) == 6
    assert all(seconds > 0 for seconds in batched + general)
    # Only the batched blocks' steps ran batched: every layer, all three requests at once (the
    # short ones' decode steps while the long prompt was prefilled ran batched too, fewer).
    assert calls.count(3) == 6 * TINY["num_hidden_layers"]


def test_percentile_interpolates_between_order_statistics():
    assert percentile([3.0, 1.0, 2.0, 4.0, 5.0], 0.95) == pytest.approx(4.8)
    assert percentile([2.0], 0.95) == 2.0
    assert percentile([1.0, 9.0], 0.5) == 5.0


def test_arrivals_are_a_seeded_poisson_process_from_zero():
    times = arrival_times(2000, rate=4.0)
    assert times == arrival_times(2000, rate=4.0) and times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps) >= 0
    # Exponential gaps of mean 1/4 s: 1999 of them average within 10% of it.
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)


def test_requests_arriving_over_time_keep_their_tokens_and_the_run_lasts_past_the_last(model):
    trace = requests(4)
    at_once = run_trace(model, 4 * full_kv_bytes(model, trace), CacheSpec(), trace)
    spread = [0.0, 0.05, 0.1, 0.3]
    arriving = run_trace(
        model, 4 * full_kv_bytes(model, trace), CacheSpec(), trace, arrivals=spread
    )
    assert arriving.outputs == at_once.outputs
    assert arriving.wall_seconds >= 0.3
    assert at_once.tpot_p95_s > 0 and arriving.tpot_p95_s > 0
    # The SLA sweep's engines schedule for the SLA: the same tokens, however tight it is.
    targeted = run_trace(
        model, 4 * full_kv_bytes(model, trace), CacheSpec(), trace, tpot_target=1e-6
    )
    assert targeted.outputs == at_once.outputs


def test_transformers_continuous_batching_baseline_makes_generates_tokens(model):
    # The baseline of serve.over_hf_continuous_batching: each request's own length, greedy, and
    # the tokens of our lossless engine (which equal generate's), on a cache of the given bytes.
    trace = requests(3)
    capacity = 2 * full_kv_bytes(model, trace)
    engine_run = run_trace(model, capacity, CacheSpec(), trace)
    wall, outputs, cache_bytes = _hf_continuous_batching(model, trace, capacity)
    assert wall > 0 and outputs == engine_run.outputs
    # Its paged cache holds the bytes asked for, rounded to its sectors, and two spare sectors.
    assert capacity <= cache_bytes <= 1.25 * capacity


def test_the_tiny_hybrids_keep_the_real_models_page_proportions():
    from kvstack.reference import arena_layouts
    from kvstack.serve.layouts import hybrid_geometry

    real = {
        "jamba_like": arena_layouts.jamba_1_5_mini(),
        "qwen3_next_like": arena_layouts.qwen3_next_80b_a3b(),
    }
    for name in HYBRID_MODELS:
        tiny, model = hybrid_geometry(hybrid_config(name), 4), real[name]
        # A state page in KV tokens of one attention layer: vLLM's block size follows from it.
        tokens = tiny.state_page_bytes / tiny.kv_token_bytes
        assert tokens == pytest.approx(model.state_page_bytes / model.kv_token_bytes, rel=0.03)
        assert tiny.state_layers / tiny.attention_layers == (
            model.state_layers / model.attention_layers
        )


def test_the_readme_table_keeps_every_figure():
    figure = {"value": 1.0, "unit": "ratio", "description": "", "target": None, "met": None}
    run = {
        "peak_generating": 3,
        "mean_generating": 2.5,
        "output_tokens": 30,
        "wall_seconds": 2.0,
        "steps": 9,
        "preemptions": 1,
        "tpot_p95_s": 0.25,
    }
    results = {
        "figures": {
            "serve.batched_over_sequential": figure,
            "serve.tokens_equal_sequential": figure,
        },
        "workload": {
            "model": "m",
            "dtype": "float32",
            "device": "cpu",
            "requests": 4,
            "trace": "t",
            "arena_bytes": 2**20,
            "arena_fraction_of_full_kv": 0.25,
            "ratio": 0.5,
            "max_batch_tokens": 512,
            "prefill_chunk": 128,
            "runs": {"full": run},
            "hybrid": {
                "models": {
                    "jamba_like": {
                        "arena_bytes": 2**20,
                        "runs": {
                            "kvstack": {
                                "goodput": 12.0,
                                "preemptions": 2,
                                "effective_batch": 3.5,
                                "peak_generating": 5,
                            }
                        },
                    }
                },
                "trace": "t",
                "arena_fraction_of_footprint": 0.3,
                "repeats": 3,
            },
        },
    }
    results["figures"]["serve.hybrid.goodput.kvstack"] = figure
    results["figures"]["serve.hybrid.goodput.kvstack.jamba_like"] = figure
    table = readme_tables(results)["serve"]
    assert "| jamba_like | `kvstack` | 12 | 2 | 3.5 | 5 | 1 MiB |" in table
    # Per-model hybrid figures are in the hybrid table, not the figures table.
    assert "serve.hybrid.goodput.kvstack`" in table
    assert "serve.hybrid.goodput.kvstack.jamba_like" not in table
    assert "serve.batched_over_sequential" in table and "serve.tokens_equal_sequential" in table
    assert "| `full` | 3 | 2.5 | 15 | 250 | 9 | 1 |" in table


def test_the_recompile_watch_sees_dynamo_fall_back_to_eager():
    """The serve results record every hit of dynamo's recompile limit (a run timed after one
    may have measured an uncompiled kernel): the watch must see a real hit, and nothing when
    a function stays within the limit."""

    def double(x):
        return x * 2

    within = torch.compile(double, dynamic=False)
    with RecompileLimitWatch() as watch:
        within(torch.ones(3))
        within(torch.ones(3))
    assert watch.hits == []

    beyond = torch.compile(lambda x: x + 1, dynamic=False)
    # The spec tests make a hit an error (conftest); the benchmarks run with dynamo's default.
    limit = dict(recompile_limit=1, fail_on_recompile_limit_hit=False)
    with torch._dynamo.config.patch(**limit), RecompileLimitWatch() as watch:
        for size in (2, 3, 4):  # static shapes: each size is a new graph
            beyond(torch.ones(size))
    assert watch.hits and "recompile_limit" in watch.hits[0]
