"""The Tangram benchmark's measures: overallocation by grouping, the planners' balance, the AoT
list's key ranges, the DynamicCache step it divides by, the batched head-wise decode's timing,
and its README table."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from kvstack.bench.tangram import (
    decode_step,
    key_ranges,
    layer_imbalances,
    measure_batched_decode,
    overallocations,
    readme_tables,
    split_fractions,
    uniform_profile,
)
from kvstack.head_groups import group_heads, plan_ahead_of_time
from spec_tests.tiny import tiny_llama_config, tiny_serving_llama

# Two layers of four heads whose budgets pair up when sorted: adjacent pairs mix high and low.
BUDGETS = ((0.9, 0.1, 0.8, 0.2), (0.5, 0.5, 0.25, 0.25))


def test_sorted_groups_reserve_less_than_adjacent_ones():
    result = overallocations(BUDGETS, 2)
    total = sum(map(sum, BUDGETS))
    # sorted: (0.9, 0.8) (0.2, 0.1) | (0.5, 0.5) (0.25, 0.25); adjacent: (0.9, 0.1) (0.8, 0.2) ...
    assert result["sorted"] == pytest.approx((2 * 0.9 + 2 * 0.2 + 1.0 + 0.5) / total - 1)
    assert result["adjacent"] == pytest.approx((2 * 0.9 + 2 * 0.8 + 1.0 + 0.5) / total - 1)
    assert result["sorted"] < result["adjacent"]
    assert overallocations(BUDGETS, 1) == {"sorted": 0.0, "adjacent": 0.0}


def test_equal_budgets_balance_perfectly_on_both_planners():
    budgets = ((0.5,) * 4,) * 2
    groups = group_heads(budgets, 2)
    result = layer_imbalances(groups, [64] * 8, workers=8, block_size=1)
    assert result["aot"] == pytest.approx([1.0, 1.0])
    assert result["per_step"] == pytest.approx([1.0, 1.0])


def test_an_uneven_batch_unbalances_the_one_wave_planner_but_not_the_aot_list():
    groups = group_heads(BUDGETS, 2)
    result = layer_imbalances(groups, [1000, 37, 400, 5], workers=16, block_size=1)
    assert all(value >= 1.0 for values in result.values() for value in values)
    assert max(result["aot"]) < min(result["per_step"])


def test_key_ranges_scale_every_split_by_every_length():
    plan = plan_ahead_of_time(group_heads(BUDGETS, 2), 4)
    fractions = split_fractions(plan)
    lengths = [100, 7]
    ranges = key_ranges(fractions, torch.tensor(lengths))
    expected = [
        [(math.floor(s.start * n), math.floor(s.end * n)) for n in lengths]
        for splits in plan
        for s in splits
    ]
    assert ranges.tolist() == [[list(pair) for pair in row] for row in expected]
    # Each sequence's splits of one group cover its keys exactly once.
    assert ranges[:, 0, 0].min() == 0 and ranges[:, 0, 1].max() == 100


def test_the_timed_decode_step_continues_a_left_padded_batch_greedily():
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    step = decode_step(model, prompts)
    steps = [step().clone() for _ in range(3)]  # [B, 1] each
    # The steps continue each prompt the way greedy generate does (second row unpadded).
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompts[1]]), max_new_tokens=4, do_sample=False, pad_token_id=0
        )
    assert [s[1, 0].item() for s in steps] == out[0, len(prompts[1]) + 1 :].tolist()


def test_the_readme_table_names_the_headline_figures_and_the_calibration():
    figure = {"value": 0.01, "unit": "percent", "target": None, "met": None, "description": ""}
    names = (
        "tangram.overallocation.sorted",
        "tangram.imbalance.aot",
        "tangram.plan_time_fraction.per_step",
        "tangram.calibration.spearman_mean",
        "tangram.calibration.spearman_min",
        "tangram.calibration.mean_budget",
        "tangram.decode_step_ms.dynamic",
        "tangram.memory_ratio.headwise",
        "tangram.max_concurrency_ratio",
        "tangram.quality.headwise_minus_uniform",
        "tangram.batched_headwise_decode",
    )
    results = {
        "figures": {name: dict(figure) for name in names},
        "workload": {
            "model": "m",
            "dtype": "torch.float32",
            "device": "cpu",
            "samples": 50,
            "sample_tokens": 1024,
            "ratio": 0.25,
            "alpha": 2.0,
            "calibration_seconds": 600.0,
            "heads_per_group": 2,
            "workers": 132,
            "batch": 16,
            "trace": "t",
        },
    }
    table = readme_tables(results)["tangram"]
    assert "`tangram.overallocation.sorted`" in table and "`tangram.imbalance.aot`" in table
    assert "`tangram.memory_ratio.headwise`" in table and "`tangram.max_concurrency_ratio`" in table
    assert "`tangram.quality.headwise_minus_uniform`" in table
    assert "`tangram.batched_headwise_decode`" in table
    assert "`tangram.decode_step_ms.dynamic`" not in table  # the record stays in the file
    assert "50 pilot samples of 1024 tokens" in table


def test_the_uniform_profile_shares_the_same_total_evenly():
    from kvstack.calibrate import HeadProfile

    profile = HeadProfile(
        budgets=BUDGETS,
        mean=BUDGETS,
        std=tuple(tuple(0.0 for _ in row) for row in BUDGETS),
        ratio=0.25,
        alpha=2.0,
        model={"num_hidden_layers": 2, "num_key_value_heads": 4, "head_dim": 64},
        calibration={"samples": 3},
    )
    uniform = uniform_profile(profile)
    total = sum(map(sum, BUDGETS))
    assert all(b == pytest.approx(total / 8) for row in uniform.budgets for b in row)
    assert sum(map(sum, uniform.budgets)) == pytest.approx(total)
    assert (uniform.model, uniform.calibration, uniform.ratio) == (
        profile.model,
        profile.calibration,
        profile.ratio,
    )


def test_the_batched_headwise_decode_is_timed_against_the_general_path(monkeypatch):
    from kvstack.serve import headwise_decode
    from spec_tests.test_serve_engine import TINY_PROFILE

    calls = []
    real = headwise_decode.attend_steady_decodes

    def counted(layers, *args):
        calls.append(len(layers))
        return real(layers, *args)

    monkeypatch.setattr(headwise_decode, "attend_steady_decodes", counted)
    model = tiny_serving_llama(max_position_embeddings=1024)  # TINY_PROFILE's model
    gen = torch.Generator().manual_seed(2)
    requests = [(torch.randint(1, 256, (n,), generator=gen).tolist(), 4) for n in (90, 60, 30)]
    figure, workload = measure_batched_decode(model, TINY_PROFILE, requests, True, print)
    # Quick: the first 2 requests, 2 rounds of 2 steps on each path.
    assert workload["prompt_tokens"] == [90, 60]
    assert len(workload["batched_step_s"]) == len(workload["general_step_s"]) == 4
    assert figure.value > 0
    # Only the batched blocks' steps ran batched, both requests in every layer (the shorter
    # prompt's decode steps while the longer one was prefilled ran batched too, alone).
    assert calls.count(2) == 4 * model.config.num_hidden_layers
