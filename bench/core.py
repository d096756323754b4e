"""The core benchmark: decode attention and repack copy, each against a baseline of the same run.

Measured in one run (``run_core``), medians of ``time.perf_counter`` over repeats, after warm-up
calls so that torch.compile time is excluded:

* decode attention over shuffled token tables (``workloads.build_decode``), per context:
  ``paged_attention`` reference vs compiled (both through ``kvstack.ops``) vs
  ``scaled_dot_product_attention`` on the same tokens laid out contiguously;
* the copy of a forced repack after 50% random eviction (``workloads.build_repack``):
  compiled ``copy_slots`` vs a plain contiguous copy of the same bytes.

Figures (flat name -> float, written to ``figures.json``), with targets:

    decode_attention.compiled_over_reference      t_reference / t_compiled at 4096   >= 10
    decode_attention.compiled_over_contiguous_sdpa t_compiled / t_sdpa at 4096        <= 1.15
    repack.bandwidth_fraction                     (bytes/s copy_slots) / (bytes/s plain copy) >= 0.7

plus the same ratios per context (suffix ``.ctx1024`` …) and absolute medians (``…_ms``) for the
record. Absolute CPU times are not comparable between runs on a shared machine; the ratios are.
Before timing, every implementation's output is checked against the reference, so a fast wrong
answer cannot be reported.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from kvstack import ops
from kvstack.bench.reporting import cpu_name, meets_target
from kvstack.bench.workloads import CORE_SHAPE, DecodeWorkload, Shape, build_decode, build_repack
from kvstack.errors import InvalidArgumentError


@dataclass(frozen=True)
class CoreConfig:
    shape: Shape
    contexts: tuple[int, ...]
    main_context: int  # the context the unsuffixed figures are taken at
    repack_context: int
    fast_repeats: int  # compiled, SDPA and both copies (interleaved, so noise hits each alike)
    reference_repeats: Mapping[int, int]  # context -> repeats; the reference is slow
    warmup: int
    seed: int = 0


FULL = CoreConfig(
    shape=CORE_SHAPE,
    contexts=(1024, 4096, 8192),
    main_context=4096,
    repack_context=4096,
    fast_repeats=20,
    reference_repeats={1024: 5, 4096: 3, 8192: 2},
    warmup=2,
)
# Tiny sizes so a test runs the whole pipeline (build, check, time, write) in seconds.
QUICK = CoreConfig(
    shape=Shape(batch=2, num_query_heads=4, num_kv_heads=2, head_dim=16),
    contexts=(64, 128),
    main_context=128,
    repack_context=128,
    fast_repeats=2,
    reference_repeats={64: 2, 128: 2},
    warmup=1,
)

# figure -> (comparison, target)
TARGETS = {
    "decode_attention.compiled_over_reference": (">=", 10.0),
    "decode_attention.compiled_over_contiguous_sdpa": ("<=", 1.15),
    "repack.bandwidth_fraction": (">=", 0.7),
}


# --------------------------------------------------------------------------- timing
def interleaved_medians_ms(
    fns: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 0,
    *,
    sparse: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Median ms of each function, timed in ``repeats`` rounds of one call of each.

    Interleaving means a burst of load from other processes on this shared machine slows every
    implementation of a round alike, instead of biasing whichever happened to run then (a ratio
    of two medians taken minutes apart can be off by an order of magnitude here).
    ``sparse[name] = n`` calls a slow function in only n rounds, spread evenly over the run, and
    skips it in warm-up (call it once yourself first). CPU ops are synchronous, so perf_counter
    around the call is the op's time.
    """
    sparse = dict(sparse or {})
    if repeats < 1:
        raise InvalidArgumentError(f"repeats must be >= 1, got {repeats!r}")
    for name, n in sparse.items():
        if name not in fns or not 1 <= n <= repeats:
            raise InvalidArgumentError(
                f"sparse[{name!r}] must name one of {sorted(fns)} with 1 <= n <= repeats "
                f"({repeats}), got {n!r}"
            )
    rounds_of = {name: {round(k * repeats / n) for k in range(n)} for name, n in sparse.items()}
    for _ in range(warmup):
        for name, fn in fns.items():
            if name not in sparse:
                fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeats):
        for name, fn in fns.items():
            if name in sparse and i not in rounds_of[name]:
                continue
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


# --------------------------------------------------------------------------- measurements
def _sdpa(w: DecodeWorkload) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        w.contiguous_query, w.contiguous_key, w.contiguous_value, enable_gqa=True
    )  # [B, H_q, 1, D]


def _measure_decode(config: CoreConfig, context: int, log: Callable[[str], None]) -> dict:
    reference = ops.get("paged_attention", "reference")
    compiled = ops.get("paged_attention", "compiled")
    w = build_decode(context, config.shape, seed=config.seed)
    args = w.paged_args()

    # Check before timing; these first calls are also the warm-up that compiles.
    expected = reference(*args).out  # [B, 1, H_q, D]
    got_compiled = compiled(*args).out
    got_sdpa = _sdpa(w).transpose(1, 2)  # [B, 1, H_q, D]
    for name, got in (("compiled", got_compiled), ("contiguous SDPA", got_sdpa)):
        torch.testing.assert_close(
            got, expected, atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n} at {context}: {m}"
        )
    max_abs_diff = float((got_compiled - expected).abs().max())

    repeats = config.reference_repeats[context]
    log(
        f"decode attention, context {context}: compiled and SDPA x{config.fast_repeats}, "
        f"reference x{repeats}, interleaved"
    )
    t = interleaved_medians_ms(
        {
            "reference": lambda: reference(*args),
            "compiled": lambda: compiled(*args),
            "sdpa": lambda: _sdpa(w),
        },
        config.fast_repeats,
        config.warmup,
        sparse={"reference": repeats},
    )
    return {
        "reference_ms": t["reference"],
        "compiled_ms": t["compiled"],
        "contiguous_sdpa_ms": t["sdpa"],
        "compiled_over_reference": t["reference"] / t["compiled"],
        "compiled_over_contiguous_sdpa": t["compiled"] / t["sdpa"],
        "compiled_max_abs_diff": max_abs_diff,
    }


def _measure_repack(config: CoreConfig, log: Callable[[str], None]) -> dict:
    copy_slots = ops.get("copy_slots", "compiled")
    w = build_repack(config.repack_context, config.shape, seed=config.seed)
    pool = w.pool

    def repack_copy() -> None:
        # Idempotent: sources and destinations are disjoint (vToken I4), so every repeat moves
        # the same bytes.
        copy_slots(pool.key, pool.value, w.src_slots, w.dst_slots)

    def plain_copy() -> None:
        w.plain_dst.copy_(w.plain_src)

    repack_copy()  # check before timing; also compiles
    h_kv, d = config.shape.num_kv_heads, config.shape.head_dim
    for cache in (pool.key, pool.value):
        rows = cache.view(-1, h_kv, d)  # [S, H_kv, D]
        torch.testing.assert_close(rows[w.dst_slots], rows[w.src_slots], atol=0, rtol=0)

    log(f"repack copy, context {config.repack_context}: x{config.fast_repeats}")
    t = interleaved_medians_ms(
        {"copy_slots": repack_copy, "plain": plain_copy}, config.fast_repeats, config.warmup
    )
    gb = w.bytes_moved / 1e9
    return {
        "copy_slots_ms": t["copy_slots"],
        "plain_copy_ms": t["plain"],
        "copy_slots_gb_per_s": gb / (t["copy_slots"] / 1e3),
        "plain_copy_gb_per_s": gb / (t["plain"] / 1e3),
        # (bytes / t_copy) / (bytes / t_plain)
        "bandwidth_fraction": t["plain"] / t["copy_slots"],
        "bytes_moved": float(w.bytes_moved),
        "moved_rows": float(w.moved_rows),
    }


# --------------------------------------------------------------------------- run and report
def run_core(
    out_dir: str | Path,
    quick: bool = False,
    *,
    command: str | None = None,
    verbose: bool = False,
) -> dict[str, float]:
    """Measure the core workloads, write ``figures.json``, ``report.md`` and
    ``decode_attention.png`` under ``out_dir``, and return the figures.

    ``quick`` uses tiny sizes (``QUICK``) to exercise the pipeline; its numbers mean nothing.
    ``command`` is recorded in the report as what produced it (default: the equivalent
    ``kvstack bench core`` command). ``verbose`` logs progress to stderr.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir must be a directory, got existing file {str(out)!r}")
    config = QUICK if quick else FULL
    if command is None:
        command = f"kvstack bench core --out {out}" + (" --quick" if quick else "")

    def log(message: str) -> None:
        if verbose:
            print(f"[kvstack bench core] {message}", file=sys.stderr, flush=True)

    decode = {ctx: _measure_decode(config, ctx, log) for ctx in config.contexts}
    repack = _measure_repack(config, log)

    figures: dict[str, float] = {}
    for name in ("compiled_over_reference", "compiled_over_contiguous_sdpa"):
        figures[f"decode_attention.{name}"] = decode[config.main_context][name]
    for ctx, values in decode.items():
        for name, value in values.items():
            figures[f"decode_attention.{name}.ctx{ctx}"] = value
    for name, value in repack.items():
        figures[f"repack.{name}"] = value

    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    _plot_decode(config, decode, out / "decode_attention.png")
    (out / "report.md").write_text(_report(config, figures, decode, repack, command))
    return figures


def passes(name: str, value: float) -> bool:
    return meets_target(TARGETS, name, value)


def _report(
    config: CoreConfig, figures: dict[str, float], decode: dict, repack: dict, command: str
) -> str:
    s = config.shape
    contexts = ", ".join(str(c) for c in config.contexts)
    ref_repeats = ", ".join(f"{n} at {c}" for c, n in config.reference_repeats.items())
    lines = [
        "# kvstack core benchmark",
        "",
        f"Produced by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        "## Workload",
        "",
        f"- Machine: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} "
        f"threads, Python {platform.python_version()}; CPU, timed with `time.perf_counter`.",
        f"- Shape: {s.describe()}; seed {config.seed}.",
        f"- Decode attention: one decode step (1 query token per sequence) over {s.batch} token "
        f"tables whose blocks are a random permutation of the pool (shuffled table); "
        f"contexts {contexts} tokens per sequence, headline figures at {config.main_context}.",
        '  - reference: `ops.get("paged_attention", "reference")`; compiled: '
        '`ops.get("paged_attention", "compiled")`; contiguous SDPA: '
        "`scaled_dot_product_attention(enable_gqa=True)` on the same tokens laid out "
        "[B, H_kv, T, D].",
        "  - Outputs checked against the reference (atol = rtol = 1e-4) before timing.",
        f"- Repack copy: {s.batch} tables of {config.repack_context} tokens, 50% of each "
        f"table's tokens evicted at random, `plan_repack(force=True)`; the plans' moves in one "
        f'`ops.get("copy_slots", "compiled")` call vs a plain contiguous `dst.copy_(src)` of the '
        f"same bytes ({int(repack['moved_rows'])} rows x {s.num_kv_heads} heads x {s.head_dim} "
        f"x 2 (K and V) = {repack['bytes_moved'] / 1e6:.3g} MB).",
        f"- Repeats (medians): compiled, SDPA and both copies {config.fast_repeats} each, "
        f"after one checked call and {config.warmup} warm-up round(s) (so torch.compile time "
        f"is excluded); reference {ref_repeats}, after one checked call, in rounds spread "
        "evenly among the others'. All implementations of a workload are timed interleaved, "
        "round by round, so load from other processes hits each alike.",
        "",
        "## Targets",
        "",
        "| figure | measured | target | result |",
        "|---|---:|---:|---|",
    ]
    for name, (comparison, target) in TARGETS.items():
        value = figures[name]
        where = "" if name.startswith("repack") else f" (context {config.main_context})"
        result = "pass" if passes(name, value) else "FAIL"
        lines.append(f"| `{name}`{where} | {value:.3g} | {comparison} {target:g} | {result} |")
    lines += [
        "",
        "## Decode attention (median ms per decode step)",
        "",
        "| context | reference | compiled | contiguous SDPA | reference / compiled "
        "| compiled / SDPA | compiled max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ctx, v in decode.items():
        lines.append(
            f"| {ctx} | {v['reference_ms']:.2f} | {v['compiled_ms']:.2f} | "
            f"{v['contiguous_sdpa_ms']:.2f} | {v['compiled_over_reference']:.1f} | "
            f"{v['compiled_over_contiguous_sdpa']:.2f} | {v['compiled_max_abs_diff']:.1e} |"
        )
    lines += [
        "",
        "![decode attention ms vs context](decode_attention.png)",
        "",
        "## Repack copy",
        "",
        "| copy | median ms | GB/s |",
        "|---|---:|---:|",
        f"| compiled `copy_slots` | {repack['copy_slots_ms']:.2f} | "
        f"{repack['copy_slots_gb_per_s']:.2f} |",
        f"| plain `dst.copy_(src)` | {repack['plain_copy_ms']:.2f} | "
        f"{repack['plain_copy_gb_per_s']:.2f} |",
        "",
        f"Bandwidth fraction: {repack['bandwidth_fraction']:.3f}.",
        "",
        "Absolute CPU times on a shared machine are not comparable between runs; the ratios are "
        "against baselines measured in this run. All figures are in `figures.json`.",
        "",
    ]
    return "\n".join(lines)


def _plot_decode(config: CoreConfig, decode: dict, path: Path) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    contexts = list(decode)
    for key, label in (
        ("reference_ms", "reference"),
        ("compiled_ms", "compiled"),
        ("contiguous_sdpa_ms", "contiguous SDPA"),
    ):
        ax.plot(contexts, [decode[c][key] for c in contexts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("median ms per decode step")
    ax.set_title(f"Decode attention, {config.shape.describe()}", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
