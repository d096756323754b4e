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
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
from kvstack.bench.prompts import FULL_TOKEN_RANGE, Prompt, build_prompts, read_passage
from kvstack.bench.vtoken import (
    FULL,
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

QUICK_SECONDS = 90.0


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run ``kvstack bench vtoken --quick --out DIR`` once; return (DIR, printed, seconds).

    One torch thread meanwhile: on a 2-core machine shared with other jobs, two threads
    oversubscribe the cores and run several times slower. This checks the pipeline, not speed.
    """
    out = tmp_path_factory.mktemp("bench_vtoken")
    printed = io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        with contextlib.redirect_stdout(printed):  # capsys is function-scoped; this is not
            status = main(["bench", "vtoken", "--quick", "--out", str(out)])
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    return out, printed.getvalue(), seconds


def test_quick_run_fits_in_time(quick_run):
    _, _, seconds = quick_run
    assert seconds < QUICK_SECONDS, f"kvstack bench vtoken --quick took {seconds:.0f}s"


def test_quick_figures_are_named_and_in_range(quick_run):
    out, _, _ = quick_run
    figures = json.loads((out / "figures.json").read_text())
    assert all(isinstance(v, float) and math.isfinite(v) for v in figures.values()), figures
    (ratio,) = QUICK.ratios
    for policy in QUICK.policies:
        name = f"vtoken.retained_block_reduction.{policy}.{ratio:g}"
        low, mean, high = figures[f"{name}.min"], figures[name], figures[f"{name}.max"]
        # Half the prompt evicted: reclamation must free blocks, and cannot free them all.
        assert 0.0 < low <= mean <= high < 1.0, (name, low, mean, high)
    worst, mean = figures["vtoken.blocks_over_ideal"], figures["vtoken.blocks_over_ideal.mean"]
    # Never fewer blocks than live tokens need; repacking at waste 0.25 bounds the excess.
    assert 1.0 <= mean <= worst <= 1.0 / (1.0 - QUICK.repack_threshold) + 1e-9
    assert figures["vtoken.generate_speed_ratio"] > 0.0
    assert figures["vtoken.tokens_per_s.dynamic_cache"] > 0.0
    assert figures["vtoken.tokens_per_s.token_table_cache"] > 0.0
    assert 0.0 <= figures["vtoken.repack_time_fraction"] < 1.0
    assert figures["vtoken.repack_time_fraction"] <= figures["vtoken.repack_time_fraction.max"]
    expected = {f"vtoken.retained_block_reduction.{p}.{ratio:g}" for p in QUICK.policies}
    expected |= {f"{n}.{s}" for n in expected for s in ("min", "max")}
    expected |= set(TARGETS) | {
        "vtoken.blocks_over_ideal.mean",
        "vtoken.tokens_per_s.dynamic_cache",
        "vtoken.tokens_per_s.token_table_cache",
        "vtoken.repack_time_fraction.max",
    }
    assert set(figures) == expected


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
    # 3 policies x 1 ratio x 2 modes x 2 prompts, plus 2 + 2 timed requests.
    assert len(runs) == 3 * 2 * 2 + 4
    assert sum(run["timed"] for run in runs) == 4


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
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            max_position_embeddings=512,
            pad_token_id=0,
        )
    ).eval()
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
