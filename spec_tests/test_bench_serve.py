"""The serving benchmark's pieces on a tiny random model: a trace run counts what it claims, the
arena is sized for the largest request, and the README table keeps every figure."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvstack.bench.serve import full_kv_bytes, largest_request_bytes, readme_tables, run_trace
from kvstack.policies import H2O
from kvstack.serve import CacheSpec

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    model.generation_config.eos_token_id = None
    return model


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


def test_the_readme_table_keeps_every_figure():
    figure = {"value": 1.0, "unit": "ratio", "description": "", "target": None, "met": None}
    run = {
        "peak_generating": 3,
        "mean_generating": 2.5,
        "output_tokens": 30,
        "wall_seconds": 2.0,
        "steps": 9,
        "preemptions": 1,
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
        },
    }
    table = readme_tables(results)["serve"]
    assert "serve.batched_over_sequential" in table and "serve.tokens_equal_sequential" in table
    assert "| `full` | 3 | 2.5 | 15 | 9 | 1 |" in table
