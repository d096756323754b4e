"""The ``kvstack`` command.

    kvstack bench core --out DIR [--quick]   run the core benchmark, write its report, print it
    kvstack ops                              the op registry: which backends run here, or why not
    kvstack demo [--out DIR] [--quick]       for now, the core benchmark (HF caches come later)

Heavy imports (torch.compile backends, matplotlib) happen inside the command that needs them,
so ``kvstack ops`` and ``--help`` stay quick.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstack", description="KV-cache memory management for LLM inference."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="run a benchmark and write its report")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    core = suites.add_parser(
        "core", help="decode attention and repack copy against baselines of the same run"
    )
    core.add_argument("--out", required=True, type=Path, help="directory for the report")
    core.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline only")

    commands.add_parser("ops", help="list every operation and backend: available, or why not")

    demo = commands.add_parser("demo", help="for now: the core benchmark")
    demo.add_argument(
        "--out", type=Path, default=Path("kvstack-demo"), help="report directory (%(default)s)"
    )
    demo.add_argument("--quick", action="store_true", help="tiny sizes: checks the pipeline only")
    return parser


def _run_core(out: Path, quick: bool, argv: Sequence[str]) -> int:
    from kvstack.bench.core import run_core

    command = shlex.join(["kvstack", *argv])
    run_core(out, quick=quick, command=command, verbose=True)
    print((out / "report.md").read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvstack`` and ``python -m kvstack``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "bench":  # the only suite so far is "core"
        return _run_core(args.out, args.quick, argv)
    if args.command == "demo":
        return _run_core(args.out, args.quick, argv)
    if args.command == "ops":
        from kvstack import ops

        print(ops.report())
        return 0
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others
