"""The Tangram benchmark: a calibrated head profile of SmolLM2 and what it plans.

Workload: SmolLM2-135M-Instruct on CPU, float32, one torch thread. ``kvstack calibrate``'s
method runs on ``SAMPLES`` pilot samples of ``SAMPLE_TOKENS`` tokens (the passages that ship
with the benchmarks) at ratio ``RATIO``: per-layer, per-KV-head budgets B = min(1, mu + 2 sigma).
From that profile:

* ``tangram.overallocation.{sorted,adjacent}``: what head groups of ``HEADS_PER_GROUP`` reserve
  (each group's table sized by its largest budget) beyond the sum of the budgets, as a fraction
  of it, for heads sorted by budget and for adjacent heads (target <= 2 % sorted; Tangram:
  42.7 % -> 2.9 %). A count from the budgets before block rounding: no ragged pages hold these
  groups yet, so these are not bytes. Per group size in ``.hp{n}``.
* ``tangram.imbalance.{aot,per_step}``: max / mean keys per worker when one layer's decode
  attention over the sorted groups runs on ``WORKERS`` workers (an H200's multiprocessors),
  its splits handed out in launch order, averaged over layers. ``aot`` runs Tangram's static
  work list (``head_groups.plan_ahead_of_time``, made once from the profile); ``per_step`` the
  FlashInfer-style planner that cuts the batch's exact work into one wave at every step, at
  the same key granularity (``.block16``: cutting whole pages). The
  batch is the serving trace's ``BATCH`` requests at their full lengths (prompt and output);
  ``.b1`` is one request at a time, averaged over the trace (target <= 1.05 for AoT).
* ``tangram.plan_time_fraction.{aot,per_step}``: planning time per decode step over every
  layer, divided by one decode step of the same batch through ``DynamicCache`` (measured in
  the same run). At step time the AoT plan only turns each split's fractions into key ranges
  of each sequence (one tensor op over the list, made once as a tensor); the per-step
  planner plans anew (kvstack's Python planner).

Also recorded: the profile's head-ranking stability (Spearman of each sample against the mean
of the others) and its mean budget. The memory, concurrency, throughput and quality figures of
the Tangram issue need ``HeadwiseCache`` and ragged pages, which do not exist yet.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstack.bench.suite import Figure, Measured, figure_table, format_value, run_suite
from kvstack.bench.timing import time_interleaved

NAME = "tangram"
DEPENDS_ON = (
    "kvstack/calibrate.py",
    "kvstack/head_groups.py",
    "kvstack/models.py",
    "kvstack/workloads.py",
    "kvstack/data",
    "kvstack/demo.py",  # load_model
    "bench/tangram.py",
    "bench/timing.py",
    "bench/prompts.py",
    "bench/data",
)
MODEL_NAME = "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)"
RATIO = 0.25
SAMPLES, SAMPLE_TOKENS = 50, 1024
QUICK_SAMPLES, QUICK_SAMPLE_TOKENS = 3, 96
HEADS_PER_GROUP = 2  # SmolLM2 has 3 KV heads per layer: groups of 2 and 1
WORKERS = 132  # multiprocessors of an H200
BATCH, MAX_CONTEXT, TRACE_SEED = 16, 2048, 0  # the serve benchmark's trace
QUICK_BATCH = 4
BLOCK_SIZE = 16
REPEATS, QUICK_REPEATS = 20, 2  # interleaved rounds: each plans once and decodes a step


# --------------------------------------------------------------------------- the figures
def overallocations(budgets: Sequence[Sequence[float]], heads_per_group: int) -> dict[str, float]:
    """{order: overallocation} for heads sorted by budget and for adjacent heads."""
    from kvstack.head_groups import ORDERS, group_heads, overallocation

    return {
        order: overallocation(budgets, group_heads(budgets, heads_per_group, order))
        for order in ORDERS
    }


def layer_imbalances(
    groups: Sequence[Sequence[Any]], lengths: Sequence[int], workers: int, block_size: int
) -> dict[str, list[float]]:
    """Per layer, max / mean keys per worker of one decode attention over ``lengths``: with the
    ahead-of-time work list (every split applied to every sequence, in launch order) and with
    the per-step planner."""
    from kvstack.head_groups import (
        imbalance,
        plan_ahead_of_time,
        plan_per_step,
        run_in_launch_order,
    )

    plan = plan_ahead_of_time(groups, workers)
    result: dict[str, list[float]] = {"aot": [], "per_step": []}
    for layer, splits in enumerate(plan):
        works = [split.work(groups, length) for length in lengths for split in splits]
        result["aot"].append(imbalance(run_in_launch_order(works, workers)))
        pieces = plan_per_step(groups[layer], lengths, workers, block_size)
        result["per_step"].append(imbalance(run_in_launch_order(pieces, workers)))
    return result


def split_fractions(plan: Sequence[Sequence[Any]]) -> Any:
    """The AoT work list as the tensor a ragged kernel would take, made once: [S, 2] start and
    end fractions of every split of every layer."""
    import torch

    return torch.tensor([[split.start, split.end] for splits in plan for split in splits])


def key_ranges(fractions: Any, lengths: Any) -> Any:
    """What the AoT list costs at a step: every split's fractions as key ranges of every
    sequence of the batch (the ragged kernel's launch arguments), [S, B, 2]."""
    return (fractions[:, None, :] * lengths[None, :, None]).floor_().long()


def decode_step(model: Any, prompts: Sequence[Sequence[int]]) -> Callable[[], Any]:
    """Prefill ``prompts`` as one left-padded batch into a ``DynamicCache`` (sdpa); return a
    function that runs the batch's next greedy decode step and returns its tokens [B, 1]."""
    import torch
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T], left-padded
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    state = {"token": out.logits[:, -1].argmax(dim=-1, keepdim=True), "mask": mask}

    def step() -> Any:
        with torch.inference_mode():
            ones = torch.ones(len(prompts), 1, dtype=torch.long)
            state["mask"] = torch.cat([state["mask"], ones], dim=1)  # [B, T + 1]
            out = model(
                input_ids=state["token"], attention_mask=state["mask"], past_key_values=cache
            )
            state["token"] = out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
        return state["token"]

    return step


# --------------------------------------------------------------------------- the run
def measure(quick: bool, log: Callable[[str], None]) -> Measured:
    import torch

    from kvstack.calibrate import calibrate, pilot_samples
    from kvstack.head_groups import group_heads, plan_ahead_of_time, plan_per_step
    from kvstack.models import load_smollm2
    from kvstack.workloads import draw_trace

    torch.set_num_threads(1)
    model, tokenizer = load_smollm2(progress=False)
    samples_count = QUICK_SAMPLES if quick else SAMPLES
    sample_tokens = QUICK_SAMPLE_TOKENS if quick else SAMPLE_TOKENS
    samples = pilot_samples(tokenizer, samples_count, sample_tokens)
    log(f"calibrating on {samples_count} samples of {sample_tokens} tokens at ratio {RATIO:g}")
    started = time.perf_counter()
    profile = calibrate(
        model, samples, RATIO, progress=lambda done, total: log(f"  sample {done}/{total}")
    )
    calibration_seconds = time.perf_counter() - started
    budgets = profile.budgets
    heads = profile.num_kv_heads
    figures: dict[str, Figure] = {}

    group_sizes = sorted({HEADS_PER_GROUP, *range(2, heads + 1)})
    for size in group_sizes:
        for order, value in overallocations(budgets, size).items():
            suffix = "" if size == HEADS_PER_GROUP else f".hp{size}"
            figures[f"tangram.overallocation.{order}{suffix}"] = Figure(
                value,
                "percent",
                f"head groups of {size} ({order} heads): reservation beyond the sum of the "
                "budgets, from the profile's budgets before block rounding (not bytes)",
                ("<=", 0.02) if (order == "sorted" and not suffix) else None,
            )

    batch = QUICK_BATCH if quick else BATCH
    trace = draw_trace(batch, seed=TRACE_SEED, max_context=MAX_CONTEXT)
    lengths = [r.prompt_tokens + r.output_tokens for r in trace]
    groups = group_heads(budgets, HEADS_PER_GROUP, "sorted")
    # Both planners cut at key granularity (AoT splits are fractions of a sequence); the
    # per-step planner also at the page size, for the record.
    at_once = layer_imbalances(groups, lengths, WORKERS, 1)
    alone = [layer_imbalances(groups, [length], WORKERS, 1) for length in lengths]
    paged = layer_imbalances(groups, lengths, WORKERS, BLOCK_SIZE)
    figures[f"tangram.imbalance.per_step.block{BLOCK_SIZE}"] = Figure(
        statistics.mean(paged["per_step"]),
        "ratio",
        f"the per-step planner cutting whole pages of {BLOCK_SIZE} keys, batch {batch}",
    )
    for kind in ("aot", "per_step"):
        figures[f"tangram.imbalance.{kind}"] = Figure(
            statistics.mean(at_once[kind]),
            "ratio",
            f"max / mean keys per worker, {WORKERS} workers, the trace's {batch} requests in "
            "one decode step, mean over layers",
            ("<=", 1.05) if kind == "aot" else None,
        )
        figures[f"tangram.imbalance.{kind}.b1"] = Figure(
            statistics.mean(statistics.mean(one[kind]) for one in alone),
            "ratio",
            "the same, one request at a time, mean over the trace's requests",
        )
        figures[f"tangram.imbalance.{kind}.worst_layer"] = Figure(
            max(at_once[kind]), "ratio", f"the batch's worst layer ({kind})"
        )

    log("planning time per step, and one DynamicCache decode step of the batch")
    fractions = split_fractions(plan_ahead_of_time(groups, WORKERS))
    batch_lengths = torch.tensor(lengths)
    # Prompts of the trace's lengths, cut from the pilot text (a step's time depends on the
    # lengths only).
    text = samples[0][0].tolist()
    prompts = [[text[i % len(text)] for i in range(r.prompt_tokens)] for r in trace]
    timings = time_interleaved(
        {
            "aot_once": lambda: plan_ahead_of_time(groups, WORKERS),
            "aot_step": lambda: key_ranges(fractions, batch_lengths),
            "per_step": lambda: [plan_per_step(layer, lengths, WORKERS, 1) for layer in groups],
            "decode_step": decode_step(model, prompts),
        },
        repeats=QUICK_REPEATS if quick else REPEATS,
    )
    aot_once, aot_step = timings.median("aot_once"), timings.median("aot_step")
    per_step, step = timings.median("per_step"), timings.median("decode_step")
    for kind, seconds in (("aot", aot_step), ("per_step", per_step)):
        figures[f"tangram.plan_time_fraction.{kind}"] = Figure(
            seconds / step,
            "fraction",
            f"planning per decode step, every layer, batch {batch} / one DynamicCache decode "
            "step of the batch on this CPU",
        )
    figures["tangram.plan_ms.aot_once"] = Figure(
        aot_once * 1e3, "ms", "making the AoT work list from the profile (once, before serving)"
    )
    figures["tangram.plan_ms.per_step"] = Figure(
        per_step * 1e3, "ms", "per-step planner, all layers"
    )
    figures["tangram.decode_step_ms.dynamic"] = Figure(
        step * 1e3, "ms", f"one DynamicCache decode step, batch {batch}"
    )
    stability = profile.calibration
    figures["tangram.calibration.spearman_mean"] = Figure(
        stability["spearman_mean"], "ratio", "head ranking, each sample vs the others' mean"
    )
    figures["tangram.calibration.spearman_min"] = Figure(
        stability["spearman_min"], "ratio", "the least stable sample"
    )
    figures["tangram.calibration.mean_budget"] = Figure(
        stability["mean_budget"], "fraction", f"mean per-head budget at ratio {RATIO:g}"
    )
    workload = {
        "model": MODEL_NAME,
        "dtype": "torch.float32",
        "device": "cpu",
        "threads": 1,
        "ratio": RATIO,
        "alpha": profile.alpha,
        "samples": samples_count,
        "sample_tokens": sample_tokens,
        "calibration_seconds": round(calibration_seconds, 1),
        "heads_per_group": HEADS_PER_GROUP,
        "workers": WORKERS,
        "block_size": BLOCK_SIZE,
        "batch": batch,
        "lengths": lengths,
        "trace": f"kvstack.workloads.draw_trace({batch}, seed={TRACE_SEED}, "
        f"max_context={MAX_CONTEXT}), prompt + output tokens",
        "repeats": QUICK_REPEATS if quick else REPEATS,
        "timer": "kvstack.bench.timing.time_interleaved, median over rounds",
        "budgets": [list(row) for row in budgets],
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack Tangram benchmark: calibrated head budgets, head groups, work lists",
        sections=[_budget_section(budgets)],
    )


def _budget_section(budgets: Sequence[Sequence[float]]) -> str:
    rows = ["| layer | " + " | ".join(f"head {h}" for h in range(len(budgets[0]))) + " |"]
    rows.append("|---|" + "---:|" * len(budgets[0]))
    for layer, row in enumerate(budgets):
        rows.append(f"| {layer} | " + " | ".join(f"{b:.3f}" for b in row) + " |")
    return "## Per-head budgets\n\n" + "\n".join(rows)


def run_tangram(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the Tangram benchmark into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def readme_tables(results: dict) -> dict[str, str]:
    """The README's Tangram table, from a results file."""
    w = results["workload"]
    names = [
        name
        for name in results["figures"]
        if name.startswith(("tangram.overallocation", "tangram.imbalance", "tangram.plan_time"))
    ]
    calibration = {
        k: results["figures"][f"tangram.calibration.{k}"]["value"]
        for k in ("spearman_mean", "spearman_min", "mean_budget")
    }
    workload = (
        f"Workload: {w['model']}, {w['dtype']} on {w['device']}; calibrated on {w['samples']} "
        f"pilot samples of {w['sample_tokens']} tokens at ratio {w['ratio']:g} (alpha "
        f"{w['alpha']:g}) in {format_value(w['calibration_seconds'] / 60, 'min')} min: mean "
        f"budget {format_value(calibration['mean_budget'], 'fraction')}, head ranking Spearman "
        f"{format_value(calibration['spearman_mean'], 'ratio')} (least stable sample "
        f"{format_value(calibration['spearman_min'], 'ratio')}). Groups of "
        f"{w['heads_per_group']} heads; {w['workers']} workers; batch {w['batch']} from "
        f"{w['trace']}."
    )
    return {"tangram": figure_table(results, names) + "\n\n" + workload}


__all__ = ["DEPENDS_ON", "NAME", "measure", "readme_tables", "run_tangram"]
