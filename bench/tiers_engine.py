"""The tiers benchmark's engine runs: swap to a host tier instead of recomputing, and the batch
rule that decides whose pages come back (``tiers.scheduler_bytes_ratio``, ``tiers.engine.*``).

Workload: SmolLM2-135M-Instruct on CPU, float32, one torch thread; the engine's attention on its
default backends. ``REQUESTS`` requests with ShareGPT-like prompt and output lengths
(``kvstack.bench.serve.trace_requests``: contexts up to ``MAX_CONTEXT`` tokens, outputs up to
``MAX_NEW`` tokens, prompts sliced from the longest benchmark prompt). Lossless ``CacheSpec()``
on a fixed arena of ``ARENA_FRACTION`` of the KV every request would hold at once at its
longest, so the running requests outgrow it as they decode; a host tier
(``Engine(swap_bytes=...)``) large enough for the whole trace, so no swap is refused.
``max_batch_tokens`` 512, ``prefill_chunk`` 128.

* ``tiers.scheduler_bytes_ratio``: bytes copied back from the host per output token with
  ``PageAwareRule`` (resident work first, then the fewest bytes to fetch; looking ahead with
  each request's ``max_new_tokens``, it brings a swapped request back only when the room lasts
  until a request finishes, and swaps out the smallest request whose leaving makes that room;
  the fairness bound ``max_wait``) ÷ ``FIFORule`` (the oldest request first wherever its
  pages are; the newest request swapped out: vLLM's policy), summed over the traces drawn with
  ``SCHEDULER_SEEDS``. The requests arrive as a Poisson process of ``ARRIVAL_RATE`` per engine
  step, counted in steps, so a run makes the same steps and moves the same bytes every time:
  one run of each rule on each trace. Same engine, traces, arenas and host tiers; what differs
  is the rule. Target < 1. ``.first_trace``: the same on the first trace alone;
  ``.vs_round_robin``: on it, over ``RoundRobinRule`` (the request that ran least recently
  first, wherever its pages are).
* ``tiers.engine.bytes_per_token.{page_aware,fifo,round_robin}`` and
  ``tiers.engine.swaps.{...}``: the counts behind those ratios.

The timed runs serve the same requests all at once (a side that makes more, shorter steps would
meet step-counted arrivals sooner, and so serve a different load), ``REPEATS`` interleaved
rounds, medians of the engine loop's wall time:

* ``tiers.engine.swap_over_recompute``: output tokens/s of the page-aware engine with the host
  tier ÷ the same engine recomputing its preempted requests (no host tier). What differs is
  the remedy: a copy of the pages to the host and back, against a prefill of the request's
  prompt and outputs.
* ``tiers.engine.adaptive_chunking.{step_p95_ratio,tpot_p95_ratio,throughput_ratio}``:
  AsymCache's adaptive chunking (``Engine(step_time_target=...)``: every decode token first,
  then prefill and recompute cut to the tokens the fitted step costs allow) on the recomputing
  engine, whose recomputed prefills are what it is for, with a target of ``ADAPTIVE_TARGET`` x
  the median step of its first fixed-budget run, ÷ that engine with the fixed budget: 95th
  percentiles of step time and of time per output token (each round's ratio of the two runs
  it made, median over the rounds), and output tokens/s (medians of the rounds' wall times).
  What differs is how many tokens a step takes and in what order.
* ``tiers.engine.tokens_equal_recompute``: the fraction of the other runs whose every
  request's tokens equal the recomputing run's.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from kvstack.bench.suite import Figure

REQUESTS, QUICK_REQUESTS = 16, 6
MAX_CONTEXT, QUICK_MAX_CONTEXT = 1024, 96
MAX_NEW, QUICK_MAX_NEW = 128, 40
ARRIVAL_RATE = 0.25  # requests per engine step
ARENA_FRACTION = 0.2
MAX_BATCH_TOKENS, PREFILL_CHUNK = 512, 128
TRACE_SEED = 0
# The traces of tiers.scheduler_bytes_ratio: TRACE_SEED's (every rule, the tiers.engine.*
# figures), then other draws at the same rate and arena fraction (page-aware and FIFO).
SCHEDULER_SEEDS, QUICK_SCHEDULER_SEEDS = (TRACE_SEED, 1, 2), (TRACE_SEED, 1)
REPEATS = 3
# Adaptive chunking's step-time target, as a multiple of the median step of the fixed-budget
# run (mostly decode steps): room for some prefill beside the decodes in every step.
ADAPTIVE_TARGET = 2.0


def lossless_engine(model: Any, capacity: int, **kwargs: Any) -> tuple[Any, Any]:
    """(arena, engine): a lossless ``CacheSpec()`` engine on a fresh arena of ``capacity``
    bytes, with this benchmark's step budget and prefill chunk (``kwargs``: the rest)."""
    from kvstack.arena import KVArena
    from kvstack.serve import CacheSpec, Engine

    arena = KVArena(capacity, dtype=next(model.parameters()).dtype)
    engine = Engine(
        model,
        arena,
        cache=CacheSpec(),
        max_batch_tokens=MAX_BATCH_TOKENS,
        prefill_chunk=PREFILL_CHUNK,
        **kwargs,
    )
    return arena, engine


def run_engine(
    model: Any,
    capacity: int,
    requests: list[tuple[list[int], int]],
    arrivals: list[int],
    rule: Any,
    swap_bytes: int | None,
    step_time_target: float | None = None,
) -> dict[str, Any]:
    """One engine over the trace: each request submitted at its arrival step (an idle engine
    skips ahead to the next arrival); the arena and the host tier must be empty at the end."""
    from kvstack.bench.serve import percentile

    arena, engine = lossless_engine(
        model, capacity, rule=rule, swap_bytes=swap_bytes, step_time_target=step_time_target
    )
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    handles: list[Any] = [None] * len(requests)
    step = 0
    step_seconds = []
    started = time.perf_counter()
    while order or engine.has_work():
        if not engine.has_work():
            step = max(step, arrivals[order[0]])
        while order and arrivals[order[0]] <= step:
            index = order.pop(0)
            handles[index] = engine.submit(*requests[index])
        begun = time.perf_counter()
        engine.step()
        step_seconds.append(time.perf_counter() - begun)
        step += 1
    wall = time.perf_counter() - started
    if arena.bytes_used or (engine.swap is not None and engine.swap.bytes_used):
        raise AssertionError("the trace ended with pages still held")
    swap = engine.swap.stats if engine.swap is not None else None
    output_tokens = sum(len(h.output_ids) for h in handles)
    return {
        "wall_seconds": wall,
        "output_tokens": output_tokens,
        "tokens_per_second": output_tokens / wall,
        "steps": step,
        "preemptions": engine.preemptions,
        "swaps": swap.swaps_in if swap else 0,
        "bytes_in": swap.bytes_in if swap else 0,
        "bytes_out": swap.bytes_out if swap else 0,
        "copy_seconds": swap.copy_seconds if swap else 0.0,
        "peak_host_bytes": swap.peak_host_bytes if swap else 0,
        "step_seconds_p50": percentile(step_seconds, 0.5),
        "step_seconds_p95": percentile(step_seconds, 0.95),
        "tpot_p95_s": percentile([h.stats.tpot_s for h in handles if h.stats.tokens > 1], 0.95),
        "outputs": [h.output_ids for h in handles],
    }


def measure_engine(
    model: Any, tokenizer: Any, quick: bool, log: Callable[[str], None]
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """The figures and the workload record of the engine runs (see the module doc)."""
    import kvstack.serve  # noqa: F401  (registers the engine's attention)
    from kvstack.bench.serve import full_kv_bytes, largest_request_bytes, trace_requests
    from kvstack.serve import CacheSpec, FIFORule, PageAwareRule, RoundRobinRule

    def trace(seed: int) -> tuple[list[tuple[list[int], int]], list[int], int, int]:
        """(requests, arrival steps, arena bytes, host tier bytes) of the trace drawn with
        ``seed``."""
        requests, arrivals = trace_requests(
            tokenizer,
            QUICK_REQUESTS if quick else REQUESTS,
            QUICK_MAX_CONTEXT if quick else MAX_CONTEXT,
            QUICK_MAX_NEW if quick else MAX_NEW,
            arrival_rate=ARRIVAL_RATE,
            quick=quick,
            seed=seed,
        )
        if quick:
            # The quick trace's drawn outputs are a few tokens: every request makes the cap
            # instead, so that its decoding still outgrows the arena and requests are swapped.
            requests = [(ids, QUICK_MAX_NEW) for ids, _ in requests]
        longest = full_kv_bytes(model, requests)
        # Never too small for the largest request alone (what ``submit`` checks).
        capacity = max(
            int(ARENA_FRACTION * longest), largest_request_bytes(model, CacheSpec(), requests)
        )
        return requests, arrivals, capacity, longest  # host: the whole trace, none refused

    seeds = QUICK_SCHEDULER_SEEDS if quick else SCHEDULER_SEEDS
    requests, arrivals, capacity, swap_bytes = trace(seeds[0])
    longest = swap_bytes

    # Untimed warm-up: the first calls compile the engine's attention for each batch size.
    warm = [(ids, 2 * (i + 1)) for i, (ids, _) in enumerate(requests[:4])]
    for _ in range(2):
        run_engine(model, 4 * longest, warm, [0] * len(warm), PageAwareRule(), None)

    rules = {"page_aware": PageAwareRule, "fifo": FIFORule, "round_robin": RoundRobinRule}
    runs: dict[str, dict[str, Any]] = {}
    for name, rule in rules.items():
        log(f"engine: {len(requests)} requests arriving over steps, {name} rule, host tier")
        runs[name] = run_engine(model, capacity, requests, arrivals, rule(), swap_bytes)
        log(
            f"  {runs[name]['swaps']} swaps, {runs[name]['bytes_in'] / 2**20:.1f} MiB back, "
            f"{runs[name]['steps']} steps"
        )
    # The headline ratio over more traces (the same rate and arena fraction, other draws):
    # one trace decides whom a rule swaps by the accident of its lengths.
    scheduler_runs = {seeds[0]: {name: runs[name] for name in ("page_aware", "fifo")}}
    for seed in seeds[1:]:
        other, other_arrivals, other_capacity, other_swap = trace(seed)
        scheduler_runs[seed] = {}
        for name in ("page_aware", "fifo"):
            log(f"engine: trace {seed}, {len(other)} requests arriving over steps, {name} rule")
            run = run_engine(
                model, other_capacity, other, other_arrivals, rules[name](), other_swap
            )
            scheduler_runs[seed][name] = run
            log(
                f"  {run['swaps']} swaps, {run['bytes_in'] / 2**20:.1f} MiB back, {run['steps']} steps"
            )

    # The timed comparisons serve the same load on both sides: every request at step 0 (with
    # arrivals counted in steps, a side that makes more, shorter steps would meet them sooner).
    log("engine: all at once, swapping, recomputing, recomputing with adaptive chunking")
    repeats = 1 if quick else REPEATS
    at_once = [0] * len(requests)
    target: list[float] = []  # set by the first recomputing run: ADAPTIVE_TARGET x its median

    def recomputing() -> dict[str, Any]:
        run = run_engine(model, capacity, requests, at_once, PageAwareRule(), None)
        if not target:
            target.append(ADAPTIVE_TARGET * run["step_seconds_p50"])
        return run

    sides = {
        "recompute": recomputing,
        "swap": lambda: run_engine(model, capacity, requests, at_once, PageAwareRule(), swap_bytes),
        "adaptive": lambda: run_engine(
            model, capacity, requests, at_once, PageAwareRule(), None, target[0]
        ),
    }
    # Interleaved rounds, who goes first alternating (``kvstack.bench.timing``'s discipline),
    # the recomputing side first in round 0 (it sets the target); the time of a run is its
    # engine loop's wall time (``run_engine``), without building the arenas, so the host tier's
    # allocation is not charged to the swapping side.
    walls: dict[str, list[float]] = {name: [] for name in sides}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    for round_index in range(repeats):
        names = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in names:
            rounds[name].append(sides[name]())
            walls[name].append(rounds[name][-1]["wall_seconds"])
    last = {name: runs_[-1] for name, runs_ in rounds.items()}
    recompute, adaptive = last["recompute"], last["adaptive"]

    def round_ratios(key: str) -> list[float]:
        """Each round's adaptive ÷ fixed-budget ``key`` (a 95th percentile): the two runs of a
        round share the machine's state, so their ratio is what a round measures; the figure
        is the median of these, not a ratio of percentiles pooled across rounds."""
        return [
            a[key] / r[key] for a, r in zip(rounds["adaptive"], rounds["recompute"], strict=True)
        ]

    p95_ratios = {key: round_ratios(key) for key in ("step_seconds_p95", "tpot_p95_s")}
    output_tokens = recompute["output_tokens"]

    figures: dict[str, Figure] = {}
    per_token = {name: run["bytes_in"] / run["output_tokens"] for name, run in runs.items()}

    def ratio(a: float, b: float) -> float:
        return a / b if b else (float("inf") if a else float("nan"))

    def traces_per_token(name: str) -> float:
        traces = scheduler_runs.values()
        return sum(t[name]["bytes_in"] for t in traces) / sum(
            t[name]["output_tokens"] for t in traces
        )

    figures["tiers.scheduler_bytes_ratio"] = Figure(
        ratio(traces_per_token("page_aware"), traces_per_token("fifo")),
        "ratio",
        "bytes copied back from the host tier per output token, PageAwareRule ÷ FIFORule, over "
        f"{len(scheduler_runs)} traces (seeds {', '.join(map(str, scheduler_runs))}); same "
        "engine, traces, arenas and host tiers",
        ("<", 1.0),
    )
    figures["tiers.scheduler_bytes_ratio.first_trace"] = Figure(
        ratio(per_token["page_aware"], per_token["fifo"]),
        "ratio",
        f"the same on the first trace alone (seed {seeds[0]}: the runs behind "
        "tiers.engine.bytes_per_token.*)",
    )
    figures["tiers.scheduler_bytes_ratio.vs_round_robin"] = Figure(
        ratio(per_token["page_aware"], per_token["round_robin"]),
        "ratio",
        "bytes copied back per output token, PageAwareRule ÷ RoundRobinRule",
    )
    for name, run in runs.items():
        figures[f"tiers.engine.bytes_per_token.{name}"] = Figure(
            per_token[name], "bytes", f"bytes copied back from the host per output token, {name}"
        )
        figures[f"tiers.engine.swaps.{name}"] = Figure(
            float(run["swaps"]), "count", f"requests swapped out and back in, {name}"
        )
    swap_seconds = statistics.median(walls["swap"])
    recompute_seconds = statistics.median(walls["recompute"])
    figures["tiers.engine.swap_over_recompute"] = Figure(
        recompute_seconds / swap_seconds,
        "ratio",
        "output tokens/s, page-aware engine swapping preempted requests to the host tier ÷ "
        "the same engine recomputing them (same trace, all at once, arena and rule)",
    )
    figures["tiers.engine.tokens_equal_recompute"] = Figure(
        sum(
            run["outputs"] == recompute["outputs"]
            for run in [*runs.values(), last["swap"], adaptive]
        )
        / (len(runs) + 2),
        "fraction",
        "swapping and adaptive runs whose every request's tokens equal the recomputing run's",
        (">=", 1.0),
    )
    what = (
        f"Engine(step_time_target={target[0] * 1e3:.0f} ms: {ADAPTIVE_TARGET:g}x the fixed run's "
        "median step) ÷ the same engine with a fixed budget of "
        f"{MAX_BATCH_TOKENS} tokens per step (page-aware, recomputing preempted requests; "
        "same trace, all at once, and arena)"
    )
    figures["tiers.engine.adaptive_chunking.step_p95_ratio"] = Figure(
        statistics.median(p95_ratios["step_seconds_p95"]),
        "ratio",
        f"95th percentile of step time, {what}; median over {repeats} interleaved rounds of "
        "each round's ratio",
    )
    figures["tiers.engine.adaptive_chunking.tpot_p95_ratio"] = Figure(
        statistics.median(p95_ratios["tpot_p95_s"]),
        "ratio",
        f"95th percentile over requests of time per output token, {what}; median over "
        f"{repeats} interleaved rounds of each round's ratio",
    )
    figures["tiers.engine.adaptive_chunking.throughput_ratio"] = Figure(
        recompute_seconds / statistics.median(walls["adaptive"]),
        "ratio",
        f"output tokens/s (medians of interleaved rounds), {what}",
    )
    workload = {
        "requests": len(requests),
        "prompt_tokens": [len(ids) for ids, _ in requests],
        "output_tokens": [new for _, new in requests],
        "arrival_steps": arrivals,
        "arrival_rate_per_step": ARRIVAL_RATE,
        "arena_bytes": capacity,
        "arena_fraction": ARENA_FRACTION,
        "host_tier_bytes": swap_bytes,
        "max_batch_tokens": MAX_BATCH_TOKENS,
        "prefill_chunk": PREFILL_CHUNK,
        "repeats": repeats,
        "tokens_per_second": {
            "swap": output_tokens / swap_seconds,
            "recompute": output_tokens / recompute_seconds,
            "adaptive": output_tokens / statistics.median(walls["adaptive"]),
        },
        "step_time_target_s": target[0],
        "timed_runs": {
            name: {key: value for key, value in run.items() if key != "outputs"}
            for name, run in last.items()
        },
        "wall_seconds": walls,
        "adaptive_p95_ratios_of_rounds": p95_ratios,
        "recompute_preemptions": recompute["preemptions"],
        "swap_preemptions": last["swap"]["preemptions"],
        "runs": {
            name: {key: value for key, value in run.items() if key != "outputs"}
            for name, run in runs.items()
        },
        "scheduler_traces": {
            str(seed): {
                name: {key: run[key] for key in ("swaps", "bytes_in", "output_tokens", "steps")}
                for name, run in by_rule.items()
            }
            for seed, by_rule in scheduler_runs.items()
        },
    }
    return figures, workload


__all__ = ["measure_engine", "run_engine"]
