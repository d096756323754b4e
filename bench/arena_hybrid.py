"""Hybrid-model memory layouts: waste and concurrency of vLLM's, SGLang's and ours.

Three real hybrid models (``kvstack.reference.arena_layouts``: Jamba-1.5-Mini, Nemotron-H-8B,
Qwen3-Next-80B-A3B, geometry from their configs, states as vLLM/SGLang store them: conv window
kernel - 1, SSM state in the dtype vLLM resolves), each served by the three layouts of that
module on the same seeded trace and the same arena capacity:

    padded_unified  vLLM: one pool of P-byte pages, attention blocks enlarged to a state page
                    (Jamba 80, Nemotron-H 1040, Qwen3-Next 544 tokens), states padded to P
    fixed_dual      SGLang: state and KV pools split at start-up by --mamba-full-memory-ratio
                    0.9 (state / KV bytes), token-granular KV
    kvstack         one arena, 16-token KV blocks and exact state pages, shared free space

Capacity per model: what a single GPU leaves for the cache with vLLM's default
gpu_memory_utilization 0.9 after the weights, times ``BUDGET_SCALE`` (``CAPACITIES``). The
scale is 1/4 in the full run because the reference arena's compaction walks every page, so a
whole budget takes minutes of CPU; every figure but ``max_sequences`` is a per-byte quantity
that does not depend on the budget to first order (``max_sequences`` grows with it), and
``measure_hybrid(quick, budget_scale=1.0)`` runs the whole budget.

Trace (``kvstack.workloads.draw_trace``): ShareGPT-like lengths (the shipped distribution, max
context 2048), Poisson arrivals at 3x the rate the kvstack layout could serve (its estimated
concurrency over the mean output length), ``2.5 x`` that concurrency requests, seed 0; the same
trace for the three layouts of a model. ``run_trace`` serves it first come, first served, with
vLLM-style recompute preemption when a decode block cannot be had.

Figures (per model ``.{model}``, and aggregated without the suffix):

    arena.hybrid.waste.{layout}           unit fraction: at the peak, bytes reserved but unused
        (capacity - bytes holding live K/V of the tokens held and exact states: partly filled
        blocks, state padding, free space, and for fixed_dual the idle part of the pool the
        workload is not short of) / capacity. The peak is the first step, among those at which
        admission stopped because the next request did not fit, with the most resident
        sequences. Aggregate: worst model.                       kvstack: <= 0.05
    arena.hybrid.max_sequences.{layout}   unit sequences: resident sequences at that peak, the
        most that fit at once while requests were waiting. Aggregate: sum over the three models
        (each on its own arena).
    arena.hybrid.max_sequences_ratio.kvstack_over_{other}   kvstack's max_sequences / the other
        layout's; aggregate: worst model.                         >= 1
    arena.hybrid.waste_ratio.padded_unified_over_kvstack    record: AVMP (arXiv 2605.22416)
        reports unified padding wasting up to 7.3x.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvstack.bench.suite import Figure, Target
from kvstack.reference import arena_layouts as layouts
from kvstack.reference.arena_layouts import HybridGeometry, TraceResult
from kvstack.workloads import draw_trace, load_length_distribution

DEPENDS_ON = (
    "reference/arena.py",
    "reference/arena_layouts.py",
    "kvstack/workloads.py",
    "kvstack/data/sharegpt_lengths.json",
    "bench/arena_hybrid.py",
)
GB = 10**9
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default fraction of device memory it may use
# model -> (geometry, device memory in bytes, weight bytes, how that was chosen)
DEPLOYMENTS: dict[str, tuple[Callable[[], HybridGeometry], int, int, str]] = {
    "jamba_1_5_mini": (
        layouts.jamba_1_5_mini,
        141 * GB,
        52 * GB * 2,
        "one H200 (141 GB); 52B parameters in bf16 (104 GB) do not fit an 80 GB GPU",
    ),
    "nemotron_h_8b": (
        layouts.nemotron_h_8b,
        80 * GB,
        int(8.1 * GB) * 2,
        "one H100 80 GB; 8.1B parameters in bf16",
    ),
    "qwen3_next_80b_a3b": (
        layouts.qwen3_next_80b_a3b,
        141 * GB,
        80 * GB,
        "one H200 (141 GB) with the FP8 weights (80B parameters x 1 byte)",
    ),
}
BUDGET_SCALE = {False: 0.25, True: 0.025}  # full run, quick run
MAX_CONTEXT = 2048  # the ShareGPT filter's bound: lengths are not rescaled
OVERLOAD = 3.0  # arrival rate / the rate kvstack could serve
REQUESTS_PER_CONCURRENCY = 2.5
SEED = 0

TARGETS: dict[str, Target] = {
    "arena.hybrid.waste.kvstack": ("<=", 0.05),
    "arena.hybrid.max_sequences_ratio.kvstack_over_padded_unified": (">=", 1.0),
    "arena.hybrid.max_sequences_ratio.kvstack_over_fixed_dual": (">=", 1.0),
}
AVMP_REPORTED_PADDING_WASTE = 7.3  # "up to 7.3x", AVMP (arXiv 2605.22416)


def capacity_bytes(model: str, budget_scale: float) -> int:
    """The arena capacity for ``model``: GPU_MEMORY_UTILIZATION x device memory - weights,
    times ``budget_scale``, in whole KiB."""
    _, device, weights, _ = DEPLOYMENTS[model]
    return int((GPU_MEMORY_UTILIZATION * device - weights) * budget_scale) // 1024 * 1024


def trace_for(geometry: HybridGeometry, capacity: int) -> tuple[list[Any], dict[str, Any]]:
    """The model's trace (see the module doc) and its parameters."""
    dist = load_length_distribution("sharegpt")
    mean_prompt, mean_output = dist.published_prompt_mean, dist.published_output_mean
    # What kvstack could hold: exact states plus K/V of a sequence halfway through its output.
    per_sequence = geometry.state_bytes_per_sequence + (
        geometry.kv_token_bytes * geometry.attention_layers * (mean_prompt + mean_output / 2)
    )
    concurrency = capacity / per_sequence
    rate = OVERLOAD * concurrency / mean_output  # requests per decode step
    n = max(8, round(REQUESTS_PER_CONCURRENCY * concurrency))
    trace = draw_trace(n, seed=SEED, max_context=MAX_CONTEXT, arrival_rate=rate)
    return trace, {
        "requests": n,
        "seed": SEED,
        "distribution": dist.name,
        "max_context": MAX_CONTEXT,
        "arrival": f"Poisson, {rate:.4g} requests per decode step ({OVERLOAD:g}x kvstack's "
        f"estimated service rate: {concurrency:.0f} sequences / {mean_output:g} output tokens)",
        "arrival_rate_per_step": rate,
        "mean_prompt_tokens": statistics.fmean(r.prompt_tokens for r in trace),
        "mean_output_tokens": statistics.fmean(r.output_tokens for r in trace),
    }


def _run(
    geometry: HybridGeometry, capacity: int, trace: list[Any]
) -> dict[str, tuple[TraceResult, layouts.HybridLayout, float]]:
    runs = {}
    for name in layouts.LAYOUTS:
        layout = layouts.make_layout(name, geometry, capacity)
        started = time.perf_counter()
        result = layouts.run_trace(layout, trace)
        seconds = time.perf_counter() - started
        if not result.saturated:
            raise RuntimeError(
                f"{geometry.name}, {name}: the trace never filled the layout (no memory-bound "
                f"step), so it has no peak; raise OVERLOAD or REQUESTS_PER_CONCURRENCY"
            )
        if result.finished != len(trace) or layout.running:
            raise RuntimeError(
                f"{geometry.name}, {name}: {result.finished} of {len(trace)} requests finished"
            )
        layout.close()
        if layout.arena.pages:  # L4: a finished trace leaves the arena empty
            raise RuntimeError(f"{geometry.name}, {name}: pages left after the trace")
        runs[name] = (result, layout, seconds)
    return runs


def measure_hybrid(
    quick: bool, budget_scale: float | None = None, log: Callable[[str], None] | None = None
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """Figures and workload of the hybrid-layout benchmark (see the module doc)."""
    scale = BUDGET_SCALE[bool(quick)] if budget_scale is None else budget_scale
    log = log or (lambda message: None)
    figures: dict[str, Figure] = {}
    workload: dict[str, Any] = {
        "budget": f"capacity = ({GPU_MEMORY_UTILIZATION:g} x device memory - weights) x "
        f"{scale:g}; arena on device='meta', bf16 elements",
        "budget_scale": scale,
        "layouts": {
            "padded_unified": "vLLM unified pages: attention block = "
            f"{layouts.VLLM_KERNEL_BLOCK_ALIGNMENT} x cdiv(state page, "
            f"{layouts.VLLM_KERNEL_BLOCK_ALIGNMENT} x per-token KV page), states padded",
            "fixed_dual": f"SGLang pools, mamba_full_memory_ratio "
            f"{layouts.SGLANG_MAMBA_FULL_MEMORY_RATIO:g}, page_size {layouts.SGLANG_PAGE_SIZE}, "
            "radix cache off",
            "kvstack": f"one arena, {layouts.KVSTACK_BLOCK_SIZE}-token KV blocks (layer axis), "
            "exact state pages",
        },
        "peak": "first memory-bound step (the queue head did not fit) with the most resident "
        "sequences; waste = (capacity - live K/V - exact states) / capacity there",
        "models": {},
    }
    per_model: dict[str, dict[str, TraceResult]] = {}
    for model, (make_geometry, device, weights, deployment) in DEPLOYMENTS.items():
        geometry = make_geometry().serving()
        capacity = capacity_bytes(model, scale)
        trace, trace_info = trace_for(geometry, capacity)
        log(f"{model}: {len(trace)} requests on {capacity / GB:.2f} GB")
        runs = _run(geometry, capacity, trace)
        per_model[model] = {name: result for name, (result, _, _) in runs.items()}
        dual = runs["fixed_dual"][1]
        workload["models"][model] = {
            "geometry": {**asdict(geometry), "recurrent_shape": list(geometry.recurrent_shape)},
            "state_page_bytes": geometry.state_page_bytes,
            "kv_token_bytes_per_layer": geometry.kv_token_bytes,
            "deployment": deployment,
            "device_bytes": device,
            "weight_bytes": weights,
            "capacity_bytes": capacity,
            "vllm_block_tokens": layouts.vllm_attention_block_size(geometry),
            "vllm_page_bytes": layouts.vllm_page_bytes(geometry),
            "sglang_split": asdict(dual.split),
            "trace": trace_info,
            "runs": {
                name: {
                    "max_sequences": result.max_sequences,
                    "max_resident_any_step": result.max_resident,
                    "peak_step": result.peak_step,
                    "peak": result.peak,
                    "memory_bound_steps": result.memory_bound_steps,
                    "steps": result.steps,
                    "admissions": result.admissions,
                    "preemptions": result.preemptions,
                    "compactions": layout.arena.compactions,
                    "seconds": round(seconds, 2),
                }
                for name, (result, layout, seconds) in runs.items()
            },
        }
        for name, (result, _, _) in runs.items():
            log(
                f"  {name}: {result.max_sequences} sequences, waste {result.peak['waste']:.3f}, "
                f"{runs[name][2]:.1f}s"
            )
    _add_figures(figures, per_model)
    return figures, workload


def _add_figures(figures: dict[str, Figure], per_model: dict[str, dict[str, TraceResult]]) -> None:
    def add(name: str, value: float, unit: str, description: str) -> None:
        figures[name] = Figure(float(value), unit, description, TARGETS.get(name))

    models = list(per_model)
    waste_what = (
        "bytes reserved but unused at the peak (capacity - live K/V - exact states) / capacity; "
        "peak = first memory-bound step with the most resident sequences"
    )
    seq_what = "sequences resident at the peak: the most that fit while requests waited"
    for layout in layouts.LAYOUTS:
        for model in models:
            result = per_model[model][layout]
            add(
                f"arena.hybrid.waste.{layout}.{model}",
                result.peak["waste"],
                "fraction",
                f"{layout}, {model}: {waste_what}",
            )
            add(
                f"arena.hybrid.max_sequences.{layout}.{model}",
                result.max_sequences,
                "sequences",
                f"{layout}, {model}: {seq_what}",
            )
        add(
            f"arena.hybrid.waste.{layout}",
            max(per_model[m][layout].peak["waste"] for m in models),
            "fraction",
            f"{layout}: {waste_what}; worst of {', '.join(models)}",
        )
        add(
            f"arena.hybrid.max_sequences.{layout}",
            sum(per_model[m][layout].max_sequences for m in models),
            "sequences",
            f"{layout}: {seq_what}; sum over {', '.join(models)}, each on its own arena",
        )
    for other in ("padded_unified", "fixed_dual"):
        ratios = {
            m: per_model[m]["kvstack"].max_sequences / per_model[m][other].max_sequences
            for m in models
        }
        for model, value in ratios.items():
            add(
                f"arena.hybrid.max_sequences_ratio.kvstack_over_{other}.{model}",
                value,
                "ratio",
                f"{model}: kvstack max_sequences / {other} max_sequences",
            )
        add(
            f"arena.hybrid.max_sequences_ratio.kvstack_over_{other}",
            min(ratios.values()),
            "ratio",
            f"kvstack max_sequences / {other} max_sequences, worst model",
        )
    ratios = {
        m: per_model[m]["padded_unified"].peak["waste"] / per_model[m]["kvstack"].peak["waste"]
        for m in models
    }
    for model, value in ratios.items():
        add(
            f"arena.hybrid.waste_ratio.padded_unified_over_kvstack.{model}",
            value,
            "ratio",
            f"{model}: padded_unified waste / kvstack waste at their peaks",
        )
    add(
        "arena.hybrid.waste_ratio.padded_unified_over_kvstack",
        max(ratios.values()),
        "ratio",
        "padded_unified waste / kvstack waste, largest over models (AVMP, arXiv 2605.22416, "
        f"reports unified padding wasting up to {AVMP_REPORTED_PADDING_WASTE:g}x)",
    )


if __name__ == "__main__":  # python -m kvstack.bench.arena_hybrid [--quick]
    import json
    import sys

    started = time.perf_counter()
    figs, work = measure_hybrid("--quick" in sys.argv, log=lambda m: print(m, file=sys.stderr))
    for key, fig in figs.items():
        print(f"{key:72s} {fig.value:10.4g} {fig.unit:10s} {fig.met()}")
    print(f"{time.perf_counter() - started:.1f}s", file=sys.stderr)
    if "--json" in sys.argv:
        print(json.dumps(work, indent=1, default=str))
