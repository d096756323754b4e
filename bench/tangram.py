"""The Tangram benchmark: a calibrated head profile of SmolLM2 and what it plans.

Workload: SmolLM2-135M-Instruct on CPU, float32, one torch thread. ``kvstack calibrate``'s
method runs on ``SAMPLES`` pilot samples of ``SAMPLE_TOKENS`` tokens (the passages that ship
with the benchmarks) at ratio ``RATIO``: per-layer, per-KV-head budgets B = min(1, mu + 2 sigma).
From that profile:

* ``tangram.overallocation.{sorted,adjacent}``: what head groups of ``HEADS_PER_GROUP`` reserve
  (each group's table sized by its largest budget) beyond the sum of the budgets, as a fraction
  of it, for heads sorted by budget and for adjacent heads (target <= 2 % sorted; Tangram:
  42.7 % -> 2.9 %). A count from the budgets before block rounding: no ragged pages hold these
  groups yet, so these are not bytes. Per group size in ``.hp{n}``; a group of every head of a
  layer is one figure, ``tangram.overallocation.hp{n}`` (order cannot change it).
* ``tangram.imbalance.{aot,per_step}``: max / mean keys per worker when one layer's decode
  attention over the sorted groups runs on ``WORKERS`` workers (an H200's multiprocessors),
  its splits handed out in launch order, averaged over layers. ``aot`` runs Tangram's static
  work list (``head_groups.plan_ahead_of_time``, made once from the profile), each split
  reading its share of a table in whole keys as the ragged attention cuts it
  (``Split.keys``); ``per_step`` the FlashInfer-style planner that cuts the batch's exact work
  into one wave at every step. Both count whole keys of the same tables (``.block16``: tables
  in whole pages of 16 keys). The
  batch is the serving trace's ``BATCH`` requests at their full lengths (prompt and output);
  ``.b1`` is one request at a time, averaged over the trace (target <= 1.05 for AoT).
* ``tangram.plan_time_fraction.{aot,per_step}``: planning time per decode step over every
  layer, divided by one decode step of the same batch through ``DynamicCache`` (measured in
  the same run). At step time the AoT plan only turns each split's fractions into key ranges
  of each sequence (one tensor op over the list, made once as a tensor); the per-step
  planner plans anew (kvstack's Python planner).

* ``tangram.memory_ratio.{headwise,masked}``: real bytes one request's cache holds after its
  prompt (the benchmark prompts, ``MEMORY_NEW_TOKENS`` greedy tokens each), over the bytes of
  ``DynamicCache``'s K/V for the same request (full KV), mean over the prompts. ``headwise``:
  ``HeadwiseCache`` with the calibrated profile, its private arena's real storage after the run
  (trimmed to whole 1 MiB segments). ``masked``: the kvpress way, a full ``DynamicCache`` whose
  attention masks per head the entries that head did not keep (``kvstack.hf.headwise.
  masked_attention``); it holds every entry. ``tangram.tokens_equal_masked``: the fraction of
  prompts whose tokens are the same under both (target 1: the cache frees exactly what the mask
  hides). Target headwise <= 0.3.
* ``tangram.max_concurrency_ratio`` and ``tangram.throughput_ratio``: the serve benchmark's
  trace (``kvstack.bench.serve``: 16 ShareGPT-length requests, every one arriving at once) on
  the engine with one fixed arena of a quarter of the trace's full KV: peak requests generating
  at once and output tokens/s, ``CacheSpec(profile=...)`` over ``CacheSpec()`` (lossless). What
  differs besides the cache: the lossless engine keeps every request's K/V in one stacked block
  table (one scatter and one attention call per layer for all requests); the head-wise one runs
  each request's own cache (per-request tables, each KV head its own; past their prompts, a
  step's decodes are stored and viewed per layer for all requests at once,
  ``kvstack.serve.headwise_decode``, and attended by one ragged op call run from the profile's
  ahead-of-time work list for torch's CPU threads). Target >= 2.6 for
  both (Tangram: up to 2.6x). ``.long_context``: the same on a trace of long prompts, the eight
  benchmark prompts (1.2-1.3k tokens) with ``LONG_NEW_TOKENS`` new tokens each, all at once,
  on an arena of a quarter of their full KV: the serve trace's prompts are short (median ~130
  tokens), where SnapKV's observation window and the decode tokens, which every head keeps,
  are much of what a request holds.

* ``tangram.batched_headwise_decode``: the time of a decode step of
  ``serve.BATCHED_DECODE_REQUESTS`` of the long prompts at once on one engine, head-wise,
  ``serve_attention``'s general path (each request's cache stores its token and builds its live
  view, then one ragged call) ÷ the batched one (``kvstack.serve.headwise_decode``: per layer,
  one copy of every request's K/V, one sort for every table's view, one ragged call). Blocks of
  steps on each path alternate on the one engine (``serve.batched_decode_steps``); medians.

* ``tangram.quality.accuracy.{headwise,uniform,full}``: accuracy on the quality benchmark's
  long-context retrieval set (``kvstack.bench.quality``: passkey, needle and QA items of 695-1317
  tokens, greedy answers of at most 12 tokens, right when an answer string appears).
  ``headwise``: ``HeadwiseCache`` with the calibrated profile; ``uniform``: the same cache with
  every head at the profile's mean budget, so the same total number of prompt tokens is kept
  (up to rounding) and only how it is shared between heads differs; ``full``: ``DynamicCache``.
  ``tangram.quality.headwise_minus_uniform``: target >= 0.

Also recorded: the profile's head-ranking stability (Spearman of each sample against the mean
of the others) and its mean budget.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstack.bench.suite import CACHE_CODE, Figure, Measured, figure_table, format_value, run_suite
from kvstack.bench.timing import time_interleaved

NAME = "tangram"
DEPENDS_ON = (
    *CACHE_CODE,  # HeadwiseCache
    "kvstack/arena.py",
    "kvstack/serve",  # the engine
    "bench/serve.py",  # its trace and runs
    "bench/quality.py",  # the long-context set and how an answer is scored
    "bench/quality_data.py",
    "bench/data/quality",
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
MEMORY_NEW_TOKENS, QUICK_MEMORY_NEW_TOKENS = 32, 4
ENGINE_REPEATS = 3  # timed engine runs of each cache, alternating: wall times are medians
LONG_NEW_TOKENS, QUICK_LONG_NEW_TOKENS = 32, 4  # the long-context trace's outputs
RECOMPILE_LIMIT = 64  # graphs dynamo may compile per function here (see measure)


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
    the per-step planner. Both count the whole keys a piece reads, tables rounded up to
    ``block_size`` keys the same way: the AoT split's share of its table as the ragged attention
    cuts it (``Split.keys``), the per-step planner's pieces of the same tables."""
    from kvstack.head_groups import (
        imbalance,
        plan_ahead_of_time,
        plan_per_step,
        run_in_launch_order,
    )

    plan = plan_ahead_of_time(groups, workers)
    result: dict[str, list[float]] = {"aot": [], "per_step": []}
    for layer, splits in enumerate(plan):
        works = [split.keys(groups, length, block_size) for length in lengths for split in splits]
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

    from kvstack.bench.serve import RecompileLimitWatch

    # The engine and quality runs meet many prompt lengths and batch sizes; past dynamo's
    # default of 8 graphs per function it would run a kernel eagerly, and a run timed after that
    # would time the uncompiled path. The limit is raised, and any hit is recorded.
    with (
        torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT),
        RecompileLimitWatch() as watch,
    ):
        measured = _measure(quick, log)
    measured.workload["recompile_limit"] = RECOMPILE_LIMIT
    measured.workload["recompile_limit_hits"] = watch.hits
    for hit in watch.hits:
        log(f"warning: {hit}")
    return measured


def _measure(quick: bool, log: Callable[[str], None]) -> Measured:
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
        suffix = "" if size == HEADS_PER_GROUP else f".hp{size}"
        if size >= heads:
            # One group holds every head of a layer: in whatever order, it is the same group,
            # so one figure, not a sorted and an adjacent one equal by construction.
            figures[f"tangram.overallocation{suffix}"] = Figure(
                overallocations(budgets, size)["sorted"],
                "percent",
                f"one group of all {heads} heads per layer (order cannot matter): reservation "
                "beyond the sum of the budgets, before block rounding (not bytes)",
            )
            continue
        for order, value in overallocations(budgets, size).items():
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
    # Both planners count whole keys (an AoT split reads its share of a table cut at whole
    # keys, as the ragged attention cuts it); also with tables in whole pages, for the record.
    at_once = layer_imbalances(groups, lengths, WORKERS, 1)
    alone = [layer_imbalances(groups, [length], WORKERS, 1) for length in lengths]
    paged = layer_imbalances(groups, lengths, WORKERS, BLOCK_SIZE)
    for kind in ("aot", "per_step"):
        figures[f"tangram.imbalance.{kind}.block{BLOCK_SIZE}"] = Figure(
            statistics.mean(paged[kind]),
            "ratio",
            f"the same with every table in whole pages of {BLOCK_SIZE} keys ({kind}), batch "
            f"{batch}",
        )
    for kind in ("aot", "per_step"):
        figures[f"tangram.imbalance.{kind}"] = Figure(
            statistics.mean(at_once[kind]),
            "ratio",
            f"max / mean whole keys per worker, {WORKERS} workers, the trace's {batch} requests "
            "in one decode step, mean over layers",
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
    log("memory: HeadwiseCache, DynamicCache and the masked full cache on the benchmark prompts")
    memory_figures, memory_workload = measure_memory(model, tokenizer, profile, quick, log)
    figures.update(memory_figures)
    log("engine: two traces on one fixed arena each, lossless and head-wise")
    eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # every request makes its whole output
    engine_figures, engine_workload = measure_engine(model, tokenizer, profile, quick, log)
    model.generation_config.eos_token_id = eos  # the quality items stop at it
    figures.update(engine_figures)
    log("quality: the long-context set, head-wise, uniform at the same total and full")
    quality_figures, quality_workload = measure_quality(model, tokenizer, profile, quick, log)
    figures.update(quality_figures)

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
        "memory": memory_workload,
        "engine": engine_workload,
        "quality": quality_workload,
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack Tangram benchmark: calibrated head budgets, head groups, work lists",
        sections=[_budget_section(budgets)],
    )


def _generate(model: Any, ids: Any, cache: Any, attention: str, new_tokens: int) -> list[int]:
    import torch

    model.set_attn_implementation(attention)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
        )
    return out[0, ids.shape[1] :].tolist()


def measure_memory(
    model: Any, tokenizer: Any, profile: Any, quick: bool, log: Callable[[str], None]
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """Real bytes of one request's cache: HeadwiseCache, the masked full cache, DynamicCache."""
    from transformers import AttentionInterface, DynamicCache

    from kvstack.bench.prompts import build_prompts
    from kvstack.hf import HeadwiseCache
    from kvstack.hf.headwise import kept_prompt_entries, masked_attention

    def dynamic_bytes(cache: Any) -> int:
        return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)

    new_tokens = QUICK_MEMORY_NEW_TOKENS if quick else MEMORY_NEW_TOKENS
    masked_name = "kvstack_bench_masked_heads"
    rows = []
    for prompt in build_prompts(tokenizer, quick=quick):
        ids, length = prompt.input_ids, prompt.num_tokens
        headwise = HeadwiseCache(model.config, profile)  # a private arena: its own real bytes
        tokens = _generate(model, ids, headwise, "kvstack", new_tokens)
        real = headwise.arena.buffer.untyped_storage().nbytes()
        full = DynamicCache(config=model.config)
        _generate(model, ids, full, "sdpa", new_tokens)
        AttentionInterface.register(
            masked_name, masked_attention(kept_prompt_entries(headwise, length), length)
        )
        masked = DynamicCache(config=model.config)
        masked_tokens = _generate(model, ids, masked, masked_name, new_tokens)
        rows.append(
            {
                "prompt": prompt.name,
                "prompt_tokens": length,
                "headwise_real_bytes": real,
                "headwise_page_bytes": int(headwise.stats()["bytes_used"]),
                "full_kv_bytes": dynamic_bytes(full),
                "masked_bytes": dynamic_bytes(masked),
                "tokens_equal": tokens == masked_tokens,
            }
        )
        log(
            f"  {prompt.name}: {length} tokens, head-wise {real / 2**20:.1f} MiB real, full "
            f"{rows[-1]['full_kv_bytes'] / 2**20:.1f} MiB, same tokens as masked: "
            f"{rows[-1]['tokens_equal']}"
        )
    model.set_attn_implementation("sdpa")
    figures = {
        "tangram.memory_ratio.headwise": Figure(
            statistics.mean(r["headwise_real_bytes"] / r["full_kv_bytes"] for r in rows),
            "ratio",
            "HeadwiseCache's real bytes (its private arena, trimmed) / DynamicCache's K/V, one "
            f"request of a benchmark prompt and {new_tokens} tokens, mean over prompts",
            ("<=", 0.3),
        ),
        "tangram.memory_ratio.headwise_pages": Figure(
            statistics.mean(r["headwise_page_bytes"] / r["full_kv_bytes"] for r in rows),
            "ratio",
            "the same, counting the arena pages its tables hold (no segment rounding)",
        ),
        "tangram.memory_ratio.masked": Figure(
            statistics.mean(r["masked_bytes"] / r["full_kv_bytes"] for r in rows),
            "ratio",
            "the masked full cache's K/V bytes (kvpress-style head-wise masking) / DynamicCache's",
        ),
        "tangram.tokens_equal_masked": Figure(
            sum(r["tokens_equal"] for r in rows) / len(rows),
            "fraction",
            "prompts whose greedy tokens are the same with HeadwiseCache and the masked full cache",
            (">=", 1.0),
        ),
    }
    return figures, {"new_tokens": new_tokens, "prompts": rows}


def long_context_requests(tokenizer: Any, quick: bool) -> list[tuple[list[int], int]]:
    """The long-context trace: every benchmark prompt (1.2-1.3k tokens) with
    ``LONG_NEW_TOKENS`` new tokens each, all arriving at once."""
    from kvstack.bench.prompts import build_prompts

    new = QUICK_LONG_NEW_TOKENS if quick else LONG_NEW_TOKENS
    return [(p.input_ids[0].tolist(), new) for p in build_prompts(tokenizer, quick=quick)]


def measure_engine(
    model: Any, tokenizer: Any, profile: Any, quick: bool, log: Callable[[str], None]
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """Two traces on one fixed arena each: HeadwiseCache over the lossless cache."""
    from kvstack.bench import serve as serve_bench

    figures, workload = {}, {}
    traces = {
        "": ("the serve trace", serve_bench.build_requests(tokenizer, quick)),
        ".long_context": ("the benchmark prompts", long_context_requests(tokenizer, quick)),
    }
    for suffix, (what, requests) in traces.items():
        log(f"  trace: {what}")
        trace_figures, workload[suffix.lstrip(".") or "serve"] = measure_engine_trace(
            model, profile, requests, quick, log
        )
        for name, figure in trace_figures.items():
            figures[name + suffix] = dataclasses.replace(
                figure, description=figure.description.replace("TRACE", what)
            )
    figures["tangram.batched_headwise_decode"], workload["batched_decode"] = measure_batched_decode(
        model, profile, traces[".long_context"][1], quick, log
    )
    return figures, workload


def measure_batched_decode(
    model: Any,
    profile: Any,
    requests: list[tuple[list[int], int]],
    quick: bool,
    log: Callable[[str], None],
) -> tuple[Figure, dict[str, Any]]:
    """``tangram.batched_headwise_decode``: decode steps of the first of ``requests`` at once,
    head-wise, on the general path ÷ on the batched one."""
    from kvstack.bench import serve as serve_bench
    from kvstack.serve import CacheSpec

    count, rounds, block = (
        serve_bench.QUICK_BATCHED_DECODE
        if quick
        else (
            serve_bench.BATCHED_DECODE_REQUESTS,
            serve_bench.BATCHED_DECODE_ROUNDS,
            serve_bench.BATCHED_DECODE_BLOCK,
        )
    )
    log(f"  batched head-wise decode: {count} requests, {rounds} x {block} steps a path")
    prompts = [ids for ids, _ in requests[:count]]
    batched, general = serve_bench.batched_decode_steps(
        model, CacheSpec(profile=profile), prompts, rounds, block
    )
    figure = Figure(
        statistics.median(general) / statistics.median(batched),
        "ratio",
        f"decode step time of {count} of the benchmark prompts at once, HeadwiseCache: "
        "serve_attention's general path ÷ the batched one (kvstack.serve.headwise_decode), one "
        f"engine, {rounds} alternating blocks of {block} steps on each, medians",
    )
    workload = {
        "requests": count,
        "prompt_tokens": [len(ids) for ids in prompts],
        "batched_step_s": batched,
        "general_step_s": general,
    }
    return figure, workload


def measure_engine_trace(
    model: Any,
    profile: Any,
    requests: list[tuple[list[int], int]],
    quick: bool,
    log: Callable[[str], None],
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """``requests`` on one fixed arena of a quarter of their full KV: HeadwiseCache over the
    lossless cache."""
    from kvstack.bench import serve as serve_bench
    from kvstack.serve import CacheSpec

    specs = {"full": CacheSpec(), "headwise": CacheSpec(profile=profile)}
    total_kv = serve_bench.full_kv_bytes(model, requests)
    largest = max(
        serve_bench.largest_request_bytes(model, spec, requests) for spec in specs.values()
    )
    capacity = max(int(serve_bench.ARENA_FRACTION * total_kv), largest)
    # Untimed: compile the attention for each cache kind and small batch sizes.
    warm = [(ids, 2 * (i + 1)) for i, (ids, _) in enumerate(requests[:4])]
    for label, spec in specs.items():
        log(f"  warm-up: {label}")
        for _ in range(2):
            serve_bench.run_trace(
                model, 2 * serve_bench.full_kv_bytes(model, warm) + largest, spec, warm
            )
    tries: dict[str, list[Any]] = {label: [] for label in specs}
    labels = list(specs)
    for repeat in range(1 if quick else ENGINE_REPEATS):
        # Each repeat starts with the other cache: neither always runs first, after the
        # other's allocations or on a machine that has just been idle.
        for label in labels[repeat % 2 :] + labels[: repeat % 2]:
            run = serve_bench.run_trace(model, capacity, specs[label], requests)
            tries[label].append(run)
            log(
                f"  {label} {repeat + 1}: {run.peak_generating} at most generating, "
                f"{run.tokens_per_second:.1f} tok/s, {run.preemptions} preemptions"
            )
    runs = {
        label: {
            "peak_generating": t[0].peak_generating,
            "mean_generating": t[0].mean_generating,
            "output_tokens": t[0].output_tokens,
            "preemptions": t[0].preemptions,
            "wall_seconds": statistics.median(r.wall_seconds for r in t),
            "wall_seconds_of_repeats": [r.wall_seconds for r in t],
        }
        for label, t in tries.items()
    }
    throughput = {label: r["output_tokens"] / r["wall_seconds"] for label, r in runs.items()}
    figures = {
        "tangram.max_concurrency_ratio": Figure(
            runs["headwise"]["peak_generating"] / runs["full"]["peak_generating"],
            "ratio",
            "peak requests generating at once, HeadwiseCache / lossless, TRACE on "
            f"one {capacity / 2**20:.1f} MiB arena",
            (">=", 2.6),
        ),
        "tangram.throughput_ratio": Figure(
            throughput["headwise"] / throughput["full"],
            "ratio",
            "output tokens/s, the same runs (medians of repeats, each starting with the other "
            "cache)",
            (">=", 2.6),
        ),
    }
    workload = {
        "arena_bytes": capacity,
        "arena_fraction_of_full_kv": serve_bench.ARENA_FRACTION,
        "requests": len(requests),
        "prompt_tokens": [len(ids) for ids, _ in requests],
        "new_tokens": [n for _, n in requests],
        "max_batch_tokens": serve_bench.MAX_BATCH_TOKENS,
        "prefill_chunk": serve_bench.PREFILL_CHUNK,
        "runs": runs,
    }
    return figures, workload


def uniform_profile(profile: Any) -> Any:
    """``profile`` with every head at its mean budget: the same total, shared evenly."""
    import dataclasses

    mean = profile.mean_budget
    uniform = tuple(tuple(mean for _ in row) for row in profile.budgets)
    return dataclasses.replace(profile, budgets=uniform)


def measure_quality(
    model: Any, tokenizer: Any, profile: Any, quick: bool, log: Callable[[str], None]
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """Accuracy on the long-context set: head-wise budgets, uniform ones of the same total,
    and the full cache."""
    from transformers import DynamicCache

    from kvstack.bench import quality, quality_data
    from kvstack.hf import HeadwiseCache
    from kvstack.models import greedy_generation_config

    config = quality.QUICK if quick else quality.FULL
    items = quality_data.build_items(config.counts, seed=config.seed, words=config.words)
    item_ids = [quality.prompt_ids(tokenizer, item) for item in items]
    generation = greedy_generation_config(model, tokenizer, config.max_new_tokens)
    even = uniform_profile(profile)
    cases = {
        "headwise": ("kvstack", lambda: HeadwiseCache(model.config, profile)),
        "uniform": ("kvstack", lambda: HeadwiseCache(model.config, even)),
        "full": ("sdpa", lambda: DynamicCache(config=model.config)),
    }
    correct: dict[str, list[bool]] = {}
    kept: dict[str, list[float]] = {"headwise": [], "uniform": []}
    for name, (attention, make) in cases.items():
        model.set_attn_implementation(attention)
        correct[name] = []
        for item, ids in zip(items, item_ids, strict=True):
            cache = make()
            text = quality.generate_answer(model, tokenizer, ids, cache, generation)
            correct[name].append(item.is_correct(text))
            if name in kept:  # prompt tokens kept over all heads, as a fraction
                prompt = ids.shape[1]
                entries = sum(
                    int(layer.batch.alive[:, :prompt].sum()) for layer in cache.paged_layers
                )
                heads = cache.expected_kv_heads
                kept[name].append(entries / (prompt * len(cache.paged_layers) * heads))
        log(f"  {name}: {sum(correct[name])}/{len(items)} right")
    model.set_attn_implementation("sdpa")
    accuracy = {name: sum(c) / len(c) for name, c in correct.items()}
    figures = {
        f"tangram.quality.accuracy.{name}": Figure(
            value,
            "fraction",
            f"items right on the long-context set ({len(items)} items), {name}",
        )
        for name, value in accuracy.items()
    }
    figures["tangram.quality.headwise_minus_uniform"] = Figure(
        accuracy["headwise"] - accuracy["uniform"],
        "fraction",
        "accuracy, head-wise budgets minus every head at their mean (the same total kept)",
        (">=", 0.0),
    )
    workload = {
        "items": {kind: sum(i.kind == kind for i in items) for kind in quality_data.KINDS},
        "prompt_tokens": {
            "min": min(int(i.shape[1]) for i in item_ids),
            "max": max(int(i.shape[1]) for i in item_ids),
        },
        "max_new_tokens": config.max_new_tokens,
        "uniform_budget": even.budgets[0][0],
        "kept_prompt_fraction": {name: statistics.mean(v) for name, v in kept.items()},
    }
    return figures, workload


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
        if name.startswith(
            (
                "tangram.overallocation",
                "tangram.imbalance",
                "tangram.plan_time",
                "tangram.memory_ratio",
                "tangram.tokens_equal",
                "tangram.max_concurrency",
                "tangram.throughput",
                "tangram.quality",
                "tangram.batched_headwise_decode",
            )
        )
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
