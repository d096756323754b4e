"""The skeleton every benchmark suite shares: run, report, plot and the committed results file.

A suite module (``core``, ``vtoken``, ``quality``) defines

* ``DEPENDS_ON``: the repository paths whose code or data its figures measure. A results file
  is stale once any of them differs from the commit it was measured at (``kvstack figures
  --check``);
* ``measure(quick, log) -> Measured``: the run itself — figures with their targets, the
  workload, the report's sections and a plot;
* ``readme_tables(results) -> {block name: markdown}``: the README tables it owns.

``run_suite`` does the rest the same way for all of them: checks ``out_dir``, logs progress
with elapsed time, and writes ``report.md``, ``results.json`` and the plot under ``out_dir``.
A full (not ``--quick``) run also writes ``bench/results/SUITE.json`` in the checkout, the file
that is committed: each figure with its value, unit, target and whether it is met, plus the
commit, whether the tree was dirty (and which dependencies), the machine, the versions, the
exact command and the date. Quick runs check the pipeline; their numbers mean nothing and
never reach the committed file.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvstack.errors import InvalidArgumentError

SUITES = (
    "core",
    "vtoken",
    "quality",
    "arena",
    "serve",
    "kvpress",
    "tangram",
    "tiers",
    "memory",
    "gpu",
)
REPO_ROOT = Path(__file__).resolve().parents[1]  # bench/ sits at the top of the checkout
RESULTS_DIR = REPO_ROOT / "bench" / "results"

Target = tuple[str, float]  # (">=", "<=" or "<", value)

# What the suites' DEPENDS_ON share: the registered ops and their backends, and on top of them
# the Hugging Face caches with their policies.
OPS_CODE = ("reference", "compiled", "cuda_kernels", "kvstack/ops.py")
CACHE_CODE = (*OPS_CODE, "kvstack/hf", "kvstack/policies.py")


@dataclass(frozen=True)
class Figure:
    value: float
    unit: str  # "ratio", "fraction", "ms", "blocks", "nats/token", ...
    description: str  # what was measured, in one line
    target: Target | None = None

    def met(self) -> bool | None:
        """Whether the value meets the target (None: no target); NaN never does."""
        if self.target is None:
            return None
        comparison, target = self.target
        if not math.isfinite(self.value):
            return False
        if comparison == "<":  # a strict improvement: equal is not met
            return self.value < target
        return self.value >= target if comparison == ">=" else self.value <= target

    def record(self) -> dict[str, Any]:
        """The figure as a results file holds it."""
        target = self.target
        return {
            "value": self.value,
            "unit": self.unit,
            "description": self.description,
            "target": None if target is None else {"comparison": target[0], "value": target[1]},
            "met": self.met(),
        }


@dataclass
class Measured:
    """What a suite's ``measure`` returns."""

    figures: dict[str, Figure]
    workload: dict[str, Any]  # model, lengths, batch, dtype, budget, repeats ...
    title: str
    sections: list[str]  # markdown after the targets table
    plot: Callable[[Path], None] | None = None  # writes a PNG to the given path
    extra_files: dict[str, str] = field(default_factory=dict)  # file name -> text


# --------------------------------------------------------------------------- provenance
def git(*args: str) -> str | None:
    """What ``git ARGS`` prints in the checkout, stripped; None when it fails."""
    try:
        result = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def provenance(depends_on: Sequence[str]) -> dict[str, Any]:
    """Commit, dirty flags, machine and versions of this process, for a results file."""
    import torch
    import transformers

    status = git("status", "--porcelain", "--untracked-files=no")
    dirty_deps = git("status", "--porcelain", "--untracked-files=all", "--", *depends_on)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(status),
        "dirty_dependencies": sorted(line[3:] for line in (dirty_deps or "").splitlines()),
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "gpu": gpu,
            "platform": platform.platform(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


# CUDA C++ sources: only a CUDA build of torch compiles them, and only a GPU runs them, so figures
# measured on a machine without a GPU cannot depend on them (a CPU C++ source still counts).
CUDA_ONLY_SUFFIXES = (".cu", ".cuh")


def could_affect(paths: Sequence[str], machine: Mapping[str, Any]) -> list[str]:
    """Those of ``paths`` whose code a run on ``machine`` (a results file's ``machine``) could
    have executed: all of them with a GPU; without one, all but CUDA sources. Results files
    record every dirty path; ``kvstack figures --check`` applies this rule when it judges them."""
    if machine.get("gpu"):
        return sorted(paths)
    return sorted(path for path in paths if not path.endswith(CUDA_ONLY_SUFFIXES))


def changed_since(commit: str | None, depends_on: Sequence[str]) -> list[str]:
    """Paths under ``depends_on`` that differ now from ``commit`` (committed since, or not)."""
    if commit is None:
        return []
    diff = git("diff", "--name-only", commit, "--", *depends_on) or ""
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *depends_on) or ""
    return sorted(set(diff.split()) | set(untracked.split()))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(results: Mapping[str, Any]) -> str:
    m, v = results["machine"], results["versions"]
    threads = f"{m['torch_threads']} torch thread" + ("s" if m["torch_threads"] != 1 else "")
    device = m["gpu"] or f"CPU ({m['cores']} cores, {threads})"
    return (
        f"{m['cpu']}; {device}; torch {v['torch']}, transformers {v['transformers']}, "
        f"Python {v['python']}"
    )


# --------------------------------------------------------------------------- the run
def run_suite(
    name: str,
    measure: Callable[[bool, Callable[[str], None]], Measured],
    depends_on: Sequence[str],
    out_dir: str | Path,
    *,
    quick: bool,
    command: str | None,
    verbose: bool,
    results_dir: Path | None = RESULTS_DIR,
) -> dict[str, float]:
    """Run one suite into ``out_dir`` (see the module doc); return {figure: value}."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir must be a directory, got existing file {str(out)!r}")
    if command is None:
        command = f"kvstack bench {name} --out {out}" + (" --quick" if quick else "")
    started = time.perf_counter()
    date = datetime.now(timezone.utc)

    def log(message: str) -> None:
        if verbose:
            elapsed = time.perf_counter() - started
            print(f"[kvstack bench {name} {elapsed:6.0f}s] {message}", file=sys.stderr, flush=True)

    # The code measured is the code at the start; a dependency that changes during the run
    # (an edit, a commit, a checkout) makes the results untrustworthy, and they say so.
    record = provenance(depends_on)
    measured = measure(quick, log)
    wall_seconds = time.perf_counter() - started
    record["dirty_dependencies"] = sorted(
        set(record["dirty_dependencies"]) | set(changed_since(record["commit"], depends_on))
    )
    results = {
        "suite": name,
        "quick": quick,
        **record,
        "command": command,
        "date": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "wall_seconds": round(wall_seconds, 1),
        "depends_on": list(depends_on),
        "workload": measured.workload,
        "figures": {key: figure.record() for key, figure in measured.figures.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(results, indent=1, sort_keys=True) + "\n"
    (out / "results.json").write_text(text)
    for file_name, content in measured.extra_files.items():
        (out / file_name).write_text(content)
    plot_name = f"{name}.png"
    if measured.plot is not None:
        measured.plot(out / plot_name)
    (out / "report.md").write_text(_report(measured, results, plot_name if measured.plot else None))
    if not quick and results_dir is not None:
        results_dir.mkdir(parents=True, exist_ok=True)
        (results_dir / f"{name}.json").write_text(text)
        log(f"results written to {results_dir / f'{name}.json'}")
    log(f"done in {wall_seconds:.0f}s")
    return {key: figure.value for key, figure in measured.figures.items()}


def format_value(value: float, unit: str) -> str:
    if not math.isfinite(value):
        return str(value)
    if unit == "percent":
        return f"{value:.1%}"
    if unit in ("blocks", "tokens", "count"):
        return f"{value:.0f}"
    return f"{value:.3g}"


def target_text(target: Mapping[str, Any] | None, unit: str = "ratio") -> str:
    """The target in the figure's own unit (a percent figure's target as a percent), so the
    two columns read alike."""
    if target is None:
        return ""
    value = format_value(target["value"], unit) if unit == "percent" else f"{target['value']:g}"
    return f"{target['comparison']} {value}"


def met_text(met: bool | None) -> str:
    return {True: "met", False: "missed", None: ""}[met]


def figure_table(results: Mapping[str, Any], names: Sequence[str]) -> str:
    """A markdown table of the named figures of a results file: value, target, met."""
    rows = ["| figure | measured | target | |", "|---|---:|---|---|"]
    for name in names:
        f = results["figures"][name]
        rows.append(
            f"| `{name}` | {format_value(f['value'], f['unit'])} | {target_text(f['target'], f['unit'])} "
            f"| {met_text(f['met'])} |"
        )
    return "\n".join(rows)


def _report(measured: Measured, results: Mapping[str, Any], plot_name: str | None) -> str:
    dirty = " (dirty tree)" if results["dirty"] else ""
    lines = [
        f"# {measured.title}",
        "",
        f"Produced by `{results['command']}` at commit {results['commit']}{dirty}, "
        f"{results['date']}, in {results['wall_seconds'] / 60:.1f} min.",
        "",
        f"Machine: {machine_line(results)}.",
        "",
        "## Targets",
        "",
        figure_table(
            results, [key for key, f in results["figures"].items() if f["target"] is not None]
        ),
    ]
    lines += ["", *measured.sections, ""]
    if plot_name:
        lines += [f"![{measured.title}]({plot_name})", ""]
    lines += [
        "Every figure, with its unit, target and description, is in `results.json`; the "
        "workload is its `workload` entry.",
        "",
    ]
    return "\n".join(lines)
