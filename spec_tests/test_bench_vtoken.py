"""``kvstack bench vtoken``: the quick run writes its whole report through the CLI, in time, with
every figure named and in range; the batching it relies on changes no request's blocks; the
prompts are real, long and in range; a reclaim/Naive-Evict mismatch stops the run.

The quick run loads the real model (SmolLM2-135M-Instruct) and runs 2 short prompts x 3
policies x 2 modes with 8 new tokens, once for the module.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics

import pytest
import torch
from transformers import LlamaForCausalLM

import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
from kvstack.bench.prompts import FULL_TOKEN_RANGE, Prompt, build_prompts, read_passage
from kvstack.bench.vtoken import (
    FULL,
    PREFILL_POLICIES,
    QUICK,
    TARGETS,
    _check_same_tokens,
    batches,
    run_vtoken,
    token_table_generate,
)
from kvstack.cli import main
from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.models import load_smollm2
from spec_tests.tiny import tiny_llama_config


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run ``kvstack bench vtoken --quick --out DIR`` once; return (DIR, what it printed).

    One torch thread meanwhile: on a 2-core machine shared with other jobs, two threads
    oversubscribe the cores and run several times slower. This checks the pipeline, not speed.
    """
    out = tmp_path_factory.mktemp("bench_vtoken")
    printed = io.StringIO()
    committed_before = _committed_results()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(printed):  # capsys is function-scoped; this is not
            status = main(["bench", "vtoken", "--quick", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    return out, printed.getvalue(), committed_before


def _committed_results() -> dict[str, bytes]:
    from kvstack.bench.suite import RESULTS_DIR

    return {path.name: path.read_bytes() for path in RESULTS_DIR.glob("*.json")}


def test_quick_figures_are_named_and_in_range(quick_run):
    out, _, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "vtoken" and results["quick"] is True
    figures = {name: f["value"] for name, f in results["figures"].items()}
    assert all(isinstance(v, float) and math.isfinite(v) for v in figures.values()), figures
    (ratio,) = QUICK.ratios
    prompts = results["workload"]["prompts"]
    for policy in QUICK.policies:
        name = f"vtoken.retained_block_reduction.{policy}.{ratio:g}"
        low, mean, high = figures[f"{name}.min"], figures[name], figures[f"{name}.max"]
        # Half the prompt evicted: reclamation must free blocks, and cannot free them all.
        assert 0.0 < low <= mean <= high < 1.0, (name, low, mean, high)
    # The formula figure is what the budget predicts: 1 - r P / (P + N), mean over prompts.
    n = QUICK.new_tokens
    formula = sum(1 - ratio * p / (p + n) for p in prompts.values()) / len(prompts)
    assert figures[f"vtoken.retained_block_reduction.budget_formula.{ratio:g}"] == pytest.approx(
        formula
    )
    worst, mean = figures["vtoken.blocks_over_ideal"], figures["vtoken.blocks_over_ideal.mean"]
    # Never fewer blocks than live tokens need; repacking at waste 0.25 bounds the excess.
    assert 1.0 <= mean <= worst <= 1.0 / (1.0 - QUICK.repack_threshold) + 1e-9
    # PagedCache never evicts: on the real model it gives DynamicCache's greedy tokens.
    assert figures["vtoken.paged_tokens_equal_dynamic"] == 1.0
    assert 0.0 <= figures["vtoken.repack_time_fraction"] < 1.0
    assert figures["vtoken.repack_time_fraction"] <= figures["vtoken.repack_time_fraction.max"]
    # Each speed ratio is the median over prompts of the per-prompt ratio of tokens/s.
    runs = json.loads((out / "runs.json").read_text())
    timed = [run for run in runs if run["timed"]]
    for cache in ("paged", *(p for p in QUICK.policies)):
        per_prompt = []
        for prompt in prompts:
            (dyn,) = [r for r in timed if r["prompt"] == prompt and r["cache"] == "dynamic"]
            (run,) = [
                r
                for r in timed
                if r["prompt"] == prompt and (r["cache"] == cache or r["policy"] == cache)
            ]
            per_prompt.append(dyn["seconds"] / run["seconds"])  # same new tokens on both sides
        name = (
            "vtoken.paged_over_dynamic"
            if cache == "paged"
            else f"vtoken.evicting_over_dynamic.{cache}.{ratio:g}"
        )
        assert figures[name] == pytest.approx(statistics.median(per_prompt)), name
    expected = {f"vtoken.retained_block_reduction.{p}.{ratio:g}" for p in QUICK.policies}
    expected |= {f"{n}.{s}" for n in expected for s in ("min", "max")}
    expected |= set(TARGETS) | {
        f"vtoken.retained_block_reduction.budget_formula.{ratio:g}",
        "vtoken.blocks_over_ideal.mean",
        "vtoken.repack_time_fraction.max",
        *(f"vtoken.evicting_over_dynamic.{p}.{ratio:g}" for p in QUICK.policies),
        *(f"vtoken.tokens_per_s.{c}" for c in ("dynamic", "paged", *QUICK.policies)),
        *(f"vtoken.prefill_seconds.{c}" for c in ("dynamic", *PREFILL_POLICIES)),
    }
    assert set(figures) == expected
    # Each prefill ratio is the median over prompts of the per-prompt ratio of the recorded
    # seconds (same round), and each prefill time the median of its own seconds.
    prefill = results["workload"]["prefill"]
    assert prefill["policies"] == list(PREFILL_POLICIES) == ["snapkv", "tova", "streaming", "h2o"]
    seconds = prefill["seconds"]
    assert set(seconds) == {"dynamic", *PREFILL_POLICIES}
    for name, per_prompt in seconds.items():
        assert set(per_prompt) == set(prompts)
        assert all(s > 0 for s in per_prompt.values())
        assert figures[f"vtoken.prefill_seconds.{name}"] == pytest.approx(
            statistics.median(per_prompt.values())
        )
    for policy in PREFILL_POLICIES:
        ratios = [seconds[policy][p] / seconds["dynamic"][p] for p in prompts]
        assert figures[f"vtoken.prefill_ratio.{policy}"] == pytest.approx(
            statistics.median(ratios)
        ), policy
    for name, (comparison, target) in TARGETS.items():
        assert results["figures"][name]["target"] == {"comparison": comparison, "value": target}


def test_quick_report_plot_and_runs_are_written_and_printed(quick_run):
    out, printed, _ = quick_run
    report = (out / "report.md").read_text()
    assert report.strip() and report.strip() in printed
    assert f"kvstack bench vtoken --quick --out {out}" in report
    for name in TARGETS:
        assert f"`{name}`" in report
    for prompt in ("paging-summary", "serving-summary"):
        assert prompt in report
    assert (out / "vtoken.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads((out / "runs.json").read_text())
    # 3 policies x 1 ratio x 2 modes x 2 prompts, plus (dynamic, paged, 3 policies) x 2 timed.
    assert len(runs) == 3 * 2 * 2 + 5 * 2
    assert sum(run["timed"] for run in runs) == 5 * 2
    assert all(run["seconds"] > 0 for run in runs if run["timed"])


def test_a_quick_run_never_writes_the_committed_results(quick_run):
    *_, committed_before = quick_run
    assert _committed_results() == committed_before


def test_run_vtoken_refuses_a_file_as_out_dir(tmp_path):
    target = tmp_path / "report.md"
    target.write_text("keep me")
    with pytest.raises(InvalidArgumentError, match="out_dir must be a directory"):
        run_vtoken(target, quick=True)
    assert target.read_text() == "keep me"


# --------------------------------------------------------------------------- batching
def _fake_prompt(name: str, length: int, seed: int) -> Prompt:
    ids = torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))
    return Prompt(name, "none", "none", "", ids)


def test_batches_keep_lengths_within_new_tokens():
    prompts = [_fake_prompt(f"p{n}", n, n) for n in (100, 300, 120, 229, 228, 101)]
    groups = batches(prompts, new_tokens=128)
    assert sorted(p.name for g in groups for p in g) == sorted(p.name for p in prompts)
    for group in groups:
        lengths = [p.num_tokens for p in group]
        assert max(lengths) - min(lengths) <= 128
    assert [[p.num_tokens for p in g] for g in groups] == [[100, 101, 120, 228], [229, 300]]
    assert [len(g) for g in batches(prompts, new_tokens=1000, max_batch=4)] == [4, 2]


@pytest.mark.parametrize("policy", ["h2o", "random"])
def test_a_batched_request_holds_the_blocks_it_would_hold_alone(policy):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(max_position_embeddings=512, pad_token_id=0)).eval()
    model.generation_config.pad_token_id = 0
    # Lengths 60 and 90 (30 tokens of padding for the first) with 32 new tokens.
    prompts = [_fake_prompt("short", 60, 1), _fake_prompt("long", 90, 2)]
    config = FULL
    for reclaim in (True, False):
        tokens, together = token_table_generate(model, prompts, config, policy, 0.3, reclaim, 32)
        assert tokens.shape == (2, 32)
        for p, run in zip(prompts, together, strict=True):
            _, (alone,) = token_table_generate(model, [p], config, policy, 0.3, reclaim, 32)
            assert (run.blocks, run.ideal_blocks, run.live_tokens) == (
                alone.blocks,
                alone.ideal_blocks,
                alone.live_tokens,
            ), (p.name, reclaim)
            assert run.batch_size == 2 and alone.batch_size == 1


def test_a_reclaim_naive_mismatch_stops_the_run():
    prompts = [_fake_prompt("a", 4, 0), _fake_prompt("b", 4, 1)]
    same = torch.tensor([[5, 6, 7], [8, 9, 10]])
    _check_same_tokens(prompts, "h2o", 0.5, same, same.clone())
    other = same.clone()
    other[1, 2] = 11
    with pytest.raises(
        KVStackError, match=r"prompt 'b', h2o at ratio 0.5: .* new token 2: 10 vs 11"
    ):
        _check_same_tokens(prompts, "h2o", 0.5, same, other)


# --------------------------------------------------------------------------- prompts
def test_full_prompts_are_eight_distinct_chat_prompts_in_range():
    _, tokenizer = load_smollm2(progress=False)
    prompts = build_prompts(tokenizer)
    assert len(prompts) == 8
    assert len({p.passage for p in prompts}) == 8 and len({p.name for p in prompts}) == 8
    low, high = FULL_TOKEN_RANGE
    for p in prompts:
        assert low <= p.num_tokens <= high, (p.name, p.num_tokens)
        assert p.text.startswith("<|im_start|>") and p.text.endswith("<|im_start|>assistant\n")
        assert p.instruction in p.text and read_passage(p.passage)[:200] in p.text
    # The full run needs a single batch: every prompt within new_tokens of the others.
    assert len(batches(prompts, FULL.new_tokens)) == 1


def test_read_passage_names_what_exists():
    with pytest.raises(InvalidArgumentError, match="passage 'no_such' not found"):
        read_passage("no_such")
