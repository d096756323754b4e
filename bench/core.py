"""The core benchmark: the registered attention ops and the repack copy, against baselines of
the same run.

The measurements are the pytest-benchmark suite ``bench/test_core.py`` (workloads in its
docstring and in ``workloads.py``); ``measure`` runs it with ``--benchmark-json`` and turns the
medians into ratios. Every ratio compares two sides of one run on one workload:

    paged_attention.compiled_over_reference         t_reference / t_compiled, context 4096  >= 10
    paged_attention.compiled_over_contiguous_sdpa   t_compiled / t_sdpa, context 4096        <= 1.15
        (SDPA reads the same tokens laid out contiguously: what differs is the gather through
        the token table, and SDPA's fused kernel)
    decode_attention.{several_kv_heads,one_kv_head}.compiled_over_reference             (record)
    decode_attention.{several_kv_heads,one_kv_head}.compiled_over_contiguous_sdpa        <= 1.15
    {paged_attention,decode_attention.{path}}.cpp_over_compiled   t_compiled / t_cpp   (record)
    {paged_attention,decode_attention.{path}}.cpp_over_contiguous_sdpa   t_cpp / t_sdpa  (record)
        (the ``cpp`` backend's C++ decode kernel, where a compiler builds it, on the same inputs)
    ragged_decode_attention.cpp_over_compiled    t_compiled / t_cpp, HeadwiseCache's step (record)
    ragged_decode_attention.compiled_over_reference   t_reference / t_compiled            (record)
    repack.bandwidth_fraction    (bytes/s of copy_slots) / (bytes/s of a plain copy)      >= 0.7
        (copy_slots on the backend a repack runs on CPU: the C++ one where it builds;
        ``repack.compiled_bandwidth_fraction`` records the torch.compile one)

plus the same ratios per context (suffix ``.ctx1024`` ...) and the medians in ms for the record.
Absolute CPU times are not comparable between runs on a shared machine; the ratios are.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvstack.bench.suite import (
    OPS_CODE,
    REPO_ROOT,
    Figure,
    Measured,
    figure_table,
    format_value,
    run_suite,
)
from kvstack.errors import KVStackError

NAME = "core"
DEPENDS_ON = (
    *OPS_CODE,
    "bench/core.py",
    "bench/test_core.py",
    "bench/workloads.py",
)
BENCH_FILE = REPO_ROOT / "bench" / "test_core.py"

TARGETS = {
    "paged_attention.compiled_over_reference": (">=", 10.0),
    "paged_attention.compiled_over_contiguous_sdpa": ("<=", 1.15),
    "decode_attention.several_kv_heads.compiled_over_contiguous_sdpa": ("<=", 1.15),
    "decode_attention.one_kv_head.compiled_over_contiguous_sdpa": ("<=", 1.15),
    "repack.bandwidth_fraction": (">=", 0.7),
}


def _run_pytest_benchmark(quick: bool, json_path: Path, log: Callable[[str], None]) -> dict:
    import pytest

    log(f"pytest-benchmark: {BENCH_FILE.relative_to(REPO_ROOT)} -> {json_path.name}")
    # The nested session's environment: quick or not, and never an xdist worker's. Run from a
    # test under pytest-xdist, PYTEST_XDIST_WORKER is set, and pytest-benchmark would take the
    # nested session for a worker and disable its benchmarks (a usage error with --benchmark-only).
    environment = {"KVSTACK_BENCH_QUICK": "1" if quick else "0", "PYTEST_XDIST_WORKER": None}
    previous = {name: os.environ.get(name) for name in environment}
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        status = pytest.main(
            [
                str(BENCH_FILE),
                "-q",
                "-x",  # a wrong output ends the run: nothing after it would be reported
                "-p",
                "no:cacheprovider",
                "-p",
                "no:xdist",  # one process: the benchmarks are timed one after another
                f"--rootdir={REPO_ROOT}",
                "--benchmark-only",
                "--benchmark-disable-gc",
                f"--benchmark-json={json_path}",
            ]
        )
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if status == pytest.ExitCode.TESTS_FAILED:
        raise KVStackError(
            f"the core microbenchmarks failed (pytest exit status {int(status)}): an output "
            "differs from the reference or a benchmark raised; nothing was reported"
        )
    if status != pytest.ExitCode.OK:
        raise KVStackError(
            f"the core microbenchmarks did not run (pytest exit status {int(status)}, expected "
            f"0): pytest stopped before the benchmarks (a usage or collection error, printed "
            "above); nothing was reported"
        )
    return json.loads(json_path.read_text())


def medians_ms(benchmark_json: dict) -> dict[tuple[str, str, str, int], float]:
    """(op, path, implementation, context) -> median ms, from pytest-benchmark's JSON."""
    medians = {}
    for bench in benchmark_json["benchmarks"]:
        info = bench["extra_info"]
        key = (info["op"], info["path"], info["implementation"], int(info["context"]))
        medians[key] = bench["stats"]["median"] * 1e3
    return medians


def _figures(benchmark_json: dict, quick: bool) -> tuple[dict[str, Figure], dict]:
    medians = medians_ms(benchmark_json)
    # (op, path) -> the workload its benchmarks recorded (the same for every implementation)
    infos = {}
    for b in benchmark_json["benchmarks"]:
        info = {k: v for k, v in b["extra_info"].items() if k != "implementation"}
        infos[(info["op"], info["path"])] = info
    figures: dict[str, Figure] = {}

    def add(name: str, value: float, unit: str, description: str) -> None:
        figures[name] = Figure(value, unit, description, TARGETS.get(name))

    def add_ratios(prefix: str, what: str, t: dict[str, float], ctx: int, suffix: str) -> None:
        add(
            f"{prefix}.compiled_over_reference{suffix}",
            t["reference"] / t["compiled"],
            "ratio",
            f"speed-up of compiled {what} over the reference, context {ctx}",
        )
        add(
            f"{prefix}.compiled_over_contiguous_sdpa{suffix}",
            t["compiled"] / t["contiguous_sdpa"],
            "ratio",
            f"time of compiled {what} / SDPA on the same tokens laid out contiguously, "
            f"context {ctx}",
        )

    def add_cpp(prefix: str, what: str, op_path: tuple[str, str], ctx: int, suffix: str) -> None:
        # Only where the cpp backend built (no compiler: its benchmarks were skipped).
        t = {impl: medians.get((*op_path, impl, ctx)) for impl in ALL_IMPLEMENTATIONS}
        if t["cpp"] is None:
            return
        add(
            f"{prefix}.cpp_over_compiled{suffix}",
            t["compiled"] / t["cpp"],
            "ratio",
            f"speed-up of the C++ kernel (cpp backend) over compiled {what}, context {ctx}",
        )
        if t["contiguous_sdpa"] is not None:
            add(
                f"{prefix}.cpp_over_contiguous_sdpa{suffix}",
                t["cpp"] / t["contiguous_sdpa"],
                "ratio",
                f"time of the C++ kernel's {what} / SDPA on the same tokens laid out "
                f"contiguously, context {ctx}",
            )
        add(f"{prefix}.cpp_ms{suffix}", t["cpp"], "ms", f"median, context {ctx}")

    paged_contexts = sorted({k[3] for k in medians if k[0] == "paged_attention"})
    main = paged_contexts[-1] if quick else 4096
    for ctx in paged_contexts:
        t = {impl: medians[("paged_attention", "paged", impl, ctx)] for impl in IMPLEMENTATIONS}
        if ctx == main:  # the headline figures, unsuffixed
            add_ratios("paged_attention", "paged_attention", t, ctx, "")
        add_ratios("paged_attention", "paged_attention", t, ctx, f".ctx{ctx}")
        if ctx == main:
            add_cpp("paged_attention", "paged_attention", ("paged_attention", "paged"), ctx, "")
        add_cpp(
            "paged_attention", "paged_attention", ("paged_attention", "paged"), ctx, f".ctx{ctx}"
        )
        for impl, ms in t.items():
            add(f"paged_attention.{impl}_ms.ctx{ctx}", ms, "ms", f"median, context {ctx}")

    for path in PATHS:
        ((ctx,),) = [{k[3] for k in medians if k[:2] == ("decode_attention", path)}]
        t = {impl: medians[("decode_attention", path, impl, ctx)] for impl in IMPLEMENTATIONS}
        what = f"decode_attention ({path.replace('_', ' ')} per table)"
        add_ratios(f"decode_attention.{path}", what, t, ctx, "")
        add_cpp(f"decode_attention.{path}", what, ("decode_attention", path), ctx, "")
        for impl, ms in t.items():
            add(f"decode_attention.{path}.{impl}_ms", ms, "ms", f"median, context {ctx}")

    ((ragged_ctx,),) = [{k[3] for k in medians if k[0] == "ragged_decode_attention"}]
    ragged = {
        impl: medians[key]
        for impl in ALL_IMPLEMENTATIONS
        if (key := ("ragged_decode_attention", "headwise", impl, ragged_ctx)) in medians
    }
    what = "ragged_decode_attention (HeadwiseCache's decode step, one table per KV head)"
    add(
        "ragged_decode_attention.compiled_over_reference",
        ragged["reference"] / ragged["compiled"],
        "ratio",
        f"speed-up of compiled {what} over the reference, prompt {ragged_ctx}",
    )
    if "cpp" in ragged:
        add(
            "ragged_decode_attention.cpp_over_compiled",
            ragged["compiled"] / ragged["cpp"],
            "ratio",
            f"speed-up of the C++ kernel (cpp backend) over compiled {what}, prompt {ragged_ctx}",
        )
    for impl, ms in ragged.items():
        add(f"ragged_decode_attention.{impl}_ms", ms, "ms", f"median, prompt {ragged_ctx}")

    ((repack_ctx,),) = [{k[3] for k in medians if k[0] == "copy_slots"}]
    copy_ms = medians[("copy_slots", "repack", "copy_slots", repack_ctx)]
    compiled_ms = medians[("copy_slots", "repack", "compiled_copy_slots", repack_ctx)]
    plain_ms = medians[("copy_slots", "repack", "plain_copy", repack_ctx)]
    repack_info = infos[("copy_slots", "repack")]
    backend = repack_info["copy_slots_backend"]
    gb = repack_info["bytes_moved"] / 1e9
    add(
        "repack.bandwidth_fraction",
        plain_ms / copy_ms,
        "fraction",
        f"bytes/s of copy_slots ({backend} backend, what a repack runs on CPU) of a forced "
        "repack / bytes/s of a plain contiguous copy of the same bytes",
    )
    add(
        "repack.compiled_bandwidth_fraction",
        plain_ms / compiled_ms,
        "fraction",
        "the same with the compiled (torch.compile) copy_slots",
    )
    add("repack.copy_slots_gb_per_s", gb / (copy_ms / 1e3), "GB/s", f"{backend} copy_slots")
    add("repack.plain_copy_gb_per_s", gb / (plain_ms / 1e3), "GB/s", "plain dst.copy_(src)")
    add("repack.bytes_moved", float(repack_info["bytes_moved"]), "bytes", "K and V bytes moved")

    paged = {k: v for k, v in infos[("paged_attention", "paged")].items() if k != "context"}
    workload = {
        "paged_attention": {**paged, "contexts": paged_contexts},
        "decode_attention.several_kv_heads": infos[("decode_attention", "several_kv_heads")],
        "decode_attention.one_kv_head": infos[("decode_attention", "one_kv_head")],
        "ragged_decode_attention": infos[("ragged_decode_attention", "headwise")],
        "repack": repack_info,
        "rounds": {b["name"]: b["stats"]["rounds"] for b in benchmark_json["benchmarks"]},
        "timer": "pytest-benchmark pedantic, 1 iteration per round, median; GC disabled",
    }
    return figures, workload


IMPLEMENTATIONS = ("reference", "compiled", "contiguous_sdpa")  # always measured
ALL_IMPLEMENTATIONS = (*IMPLEMENTATIONS, "cpp")  # cpp: where a compiler builds it
PATHS = ("several_kv_heads", "one_kv_head")  # decode_attention's two code paths


def measure(quick: bool, log: Callable[[str], None]) -> Measured:
    with tempfile.TemporaryDirectory() as tmp:
        benchmark_json = _run_pytest_benchmark(quick, Path(tmp) / "benchmark.json", log)
    figures, workload = _figures(benchmark_json, quick)
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack core benchmark",
        sections=_sections(figures, workload),
        plot=lambda path: _plot(figures, workload, path),
        extra_files={"pytest-benchmark.json": json.dumps(benchmark_json, indent=1) + "\n"},
    )


def run_core(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the core benchmark into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def _sections(figures: dict[str, Figure], workload: dict) -> list[str]:
    p = workload["paged_attention"]
    lines = [
        "## Workload",
        "",
        f"One decode step (one query token per sequence) over token tables whose blocks are a "
        f"random permutation of the pool, fp32, {p['threads']} torch thread(s). "
        f"`paged_attention`: batch {p['batch']}, {p['num_query_heads']} query / "
        f"{p['num_kv_heads']} KV heads, head_dim {p['head_dim']}, block size "
        f"{p['block_size']}, contexts {', '.join(map(str, p['contexts']))}. Baseline: "
        "`scaled_dot_product_attention(enable_gqa=True)` on the same tokens laid out "
        "[B, H_kv, T, D] — the two sides differ in the table gather and in the kernel.",
        "",
        "| op | path | context | reference ms | compiled ms | contiguous SDPA ms | "
        "reference / compiled | compiled / SDPA |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for ctx in p["contexts"]:
        f = {k: figures[f"paged_attention.{k}_ms.ctx{ctx}"].value for k in IMPLEMENTATIONS}
        lines.append(
            f"| paged_attention | several KV heads | {ctx} | {f['reference']:.2f} | "
            f"{f['compiled']:.2f} | {f['contiguous_sdpa']:.2f} | "
            f"{f['reference'] / f['compiled']:.1f} | {f['compiled'] / f['contiguous_sdpa']:.2f} |"
        )
    for path in PATHS:
        w = workload[f"decode_attention.{path}"]
        f = {k: figures[f"decode_attention.{path}.{k}_ms"].value for k in IMPLEMENTATIONS}
        lines.append(
            f"| decode_attention | {path.replace('_', ' ')} ({w['batch']} x {w['num_query_heads']}"
            f"q/{w['num_kv_heads']}kv x {w['head_dim']}) | {w['context']} | "
            f"{f['reference']:.3f} | {f['compiled']:.3f} | {f['contiguous_sdpa']:.3f} | "
            f"{f['reference'] / f['compiled']:.1f} | {f['compiled'] / f['contiguous_sdpa']:.2f} |"
        )
    g = workload["ragged_decode_attention"]
    cpp = {
        name: figures[name].value
        for name in (
            "paged_attention.cpp_ms",
            *(f"decode_attention.{path}.cpp_ms" for path in PATHS),
            "ragged_decode_attention.cpp_ms",
        )
        if name in figures
    }
    lines += [
        "",
        f"`ragged_decode_attention`: {g['batch']} sequences of a {g['context']}-token prompt "
        f"whose {g['num_kv_heads']} KV heads keep {g['kept_tokens']} tokens in tables of their "
        f"own ({g['num_query_heads'] // g['num_kv_heads']} query heads each, head_dim "
        f"{g['head_dim']}), {g['work_rows']} work rows for {g['workers']} worker(s): reference "
        f"{figures['ragged_decode_attention.reference_ms'].value:.3f} ms, compiled "
        f"{figures['ragged_decode_attention.compiled_ms'].value:.3f} ms.",
        "",
        "The `cpp` backend's C++ kernels (CPU tensors) on the same inputs: "
        + (
            ", ".join(f"`{name.removesuffix('.cpp_ms')}` {ms:.3f} ms" for name, ms in cpp.items())
            if cpp
            else "not built here (no compiler), so not measured"
        )
        + ".",
    ]
    r = workload["repack"]
    lines += [
        "",
        f"Repack copy: {r['batch']} tables of {r['context']} tokens, 50 % evicted at random, "
        f"forced repack; {r['moved_rows']} rows moved ({r['bytes_moved'] / 1e6:.3g} MB of K "
        f"and V) by `copy_slots` ({r['copy_slots_backend']} backend) at "
        f"{format_value(figures['repack.copy_slots_gb_per_s'].value, 'GB/s')} GB/s against "
        f"{format_value(figures['repack.plain_copy_gb_per_s'].value, 'GB/s')} GB/s for a plain "
        "contiguous copy of as many bytes.",
    ]
    return lines


def _plot(figures: dict[str, Figure], workload: dict, path: Path) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    fig = MplFigure(figsize=(6, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    contexts = workload["paged_attention"]["contexts"]
    for impl in IMPLEMENTATIONS:
        values = [figures[f"paged_attention.{impl}_ms.ctx{c}"].value for c in contexts]
        ax.plot(contexts, values, marker="o", label=impl.replace("_", " "))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [str(c) for c in contexts])
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("median ms per decode step")
    ax.set_title("paged_attention, one decode step", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def readme_tables(results: dict) -> dict[str, str]:
    """The README's core tables, from a results file."""
    f, w = results["figures"], results["workload"]
    names = [
        *TARGETS,
        *(f"decode_attention.{path}.compiled_over_reference" for path in PATHS),
        *(
            name
            for name in (
                "paged_attention.cpp_over_compiled",
                *(f"decode_attention.{path}.cpp_over_compiled" for path in PATHS),
                "ragged_decode_attention.cpp_over_compiled",
                "ragged_decode_attention.compiled_over_reference",
            )
            if name in f
        ),
    ]
    contexts = w["paged_attention"]["contexts"]
    per_context = [
        "| `paged_attention`, context | " + " | ".join(map(str, contexts)) + " |",
        "|---|" + "---:|" * len(contexts),
    ]
    for ratio in ("compiled_over_reference", "compiled_over_contiguous_sdpa"):
        per_context.append(
            f"| `{ratio}` | "
            + " | ".join(
                format_value(f[f"paged_attention.{ratio}.ctx{c}"]["value"], "ratio")
                for c in contexts
            )
            + " |"
        )
    p, one, r = w["paged_attention"], w["decode_attention.one_kv_head"], w["repack"]
    g = w.get("ragged_decode_attention")
    workload = (
        f"Workload: fp32, {p['threads']} torch thread(s); `paged_attention` and "
        f"`decode_attention` (several KV heads) batch {p['batch']}, {p['num_query_heads']} "
        f"query / {p['num_kv_heads']} KV heads, head_dim {p['head_dim']}, block size "
        f"{p['block_size']}; `decode_attention` (one KV head) {one['batch']} tables x "
        f"{one['context']} tokens, {one['num_query_heads']} query heads, head_dim "
        f"{one['head_dim']}; "
        + (
            f"`ragged_decode_attention` {g['batch']} sequences, {g['num_kv_heads']} KV heads "
            f"keeping {g['kept_tokens']} of {g['context']} prompt tokens in tables of their own, "
            f"{g['num_query_heads']} query heads, head_dim {g['head_dim']}; "
            if g
            else ""
        )
        + f"repack: {r['batch']} tables x {r['context']} tokens, half evicted, "
        f"{r['bytes_moved'] / 1e6:.3g} MB moved. `cpp`: the C++ kernels of the cpp backend. "
        "Medians of pytest-benchmark rounds."
    )
    return {"core": "\n\n".join([figure_table(results, names), "\n".join(per_context), workload])}
