"""The ``kvstack`` command.

    kvstack bench core --out DIR [--quick]   run the core benchmark, write its report, print it
    kvstack bench vtoken --out DIR [--quick] retained blocks with vs without reclamation (SmolLM2)
    kvstack bench quality --out DIR [--quick] retrieval accuracy and NLL per policy at 50 % budget
    kvstack ops                              the op registry: which backends run here, or why not
    kvstack demo [--policy P] [--budget N | --ratio R] [--quick] ...
                                             one long prompt through DynamicCache, PagedCache and
                                             TokenTableCache on SmolLM2: memory and speed table

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
    vtoken = suites.add_parser(
        "vtoken", help="retained KV blocks with reclamation vs Naive-Evict, on the real model"
    )
    vtoken.add_argument("--out", required=True, type=Path, help="directory for the report")
    vtoken.add_argument(
        "--quick", action="store_true", help="two short prompts: checks the pipeline only"
    )

    quality = suites.add_parser(
        "quality", help="retrieval accuracy and held-out NLL per policy at 50%% budget (SmolLM2)"
    )
    quality.add_argument("--out", required=True, type=Path, help="directory for the report")
    quality.add_argument(
        "--quick", action="store_true", help="three items: checks the pipeline only"
    )

    commands.add_parser("ops", help="list every operation and backend: available, or why not")

    _add_demo_parser(commands)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _existing_file(text: str) -> Path:
    path = Path(text)
    if not path.is_file():
        problem = "is not a file" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; expected a UTF-8 text file")
    return path


def _model_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json").is_file():
        problem = "has no config.json" if path.is_dir() else "is not a directory"
        raise argparse.ArgumentTypeError(
            f"{text!r} {problem}; expected the directory of a Hugging Face causal LM"
        )
    return path


def _add_demo_parser(commands: argparse._SubParsersAction) -> None:
    from kvstack.demo import DEFAULT_NEW_TOKENS, DEFAULT_RATIO, POLICY_NAMES, QUICK_NEW_TOKENS

    demo = commands.add_parser(
        "demo",
        help="one long prompt through DynamicCache, PagedCache and TokenTableCache",
        description="Greedy generation of one long prompt with DynamicCache, PagedCache and "
        "TokenTableCache (token eviction with reclaimed memory); prints what each generated "
        "and a table of blocks, KV bytes, live tokens, tokens/s and repacks. The first run "
        "installs and converts SmolLM2-135M-Instruct (cached for later runs).",
    )
    demo.add_argument(
        "--model-path",
        type=_model_dir,
        help="directory of a local Hugging Face causal LM to use instead of SmolLM2",
    )
    demo.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        default="h2o",
        help="eviction policy of the TokenTableCache (%(default)s)",
    )
    size = demo.add_mutually_exclusive_group()
    size.add_argument(
        "--budget", type=_positive_int, help="live tokens kept per token table (instead of --ratio)"
    )
    size.add_argument(
        "--ratio",
        type=_ratio,
        help=f"fraction of the prompt kept per token table, in (0, 1] (default {DEFAULT_RATIO})",
    )
    demo.add_argument(
        "--prompt-file",
        type=_existing_file,
        help="UTF-8 text to use as the prompt (default: the built-in handbook and its question)",
    )
    demo.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        help=f"tokens to generate per cache (default {DEFAULT_NEW_TOKENS}; "
        f"{QUICK_NEW_TOKENS} with --quick)",
    )
    demo.add_argument(
        "--block-size", type=_positive_int, default=16, help="tokens per block (%(default)s)"
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help="tiny run that checks the pipeline: a short prompt and a few new tokens",
    )
    demo.set_defaults(demo_parser=demo)  # for usage errors found after parsing


def _run_demo(args: argparse.Namespace) -> int:
    from kvstack.demo import DemoOptions, check_options, run_demo
    from kvstack.errors import InvalidArgumentError

    options = DemoOptions(
        model_path=args.model_path,
        policy=args.policy,
        budget=args.budget,
        ratio=args.ratio,
        prompt_file=args.prompt_file,
        max_new_tokens=args.max_new_tokens,
        block_size=args.block_size,
        quick=args.quick,
    )
    try:  # what needs no model (e.g. a budget below what the policy must keep): a usage error
        check_options(options)
    except InvalidArgumentError as error:
        args.demo_parser.error(str(error))  # exits with status 2
    run_demo(options)
    return 0


def _run_bench(name: str, out: Path, quick: bool, argv: Sequence[str]) -> int:
    """Run benchmark ``name`` (core, vtoken, quality) into ``out`` and print its report."""
    import importlib

    run = getattr(importlib.import_module(f"kvstack.bench.{name}"), f"run_{name}")
    run(out, quick=quick, command=shlex.join(["kvstack", *argv]), verbose=True)
    print((out / "report.md").read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvstack`` and ``python -m kvstack``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.command == "bench":
        return _run_bench(args.suite, args.out, args.quick, argv)
    if args.command == "demo":
        return _run_demo(args)
    if args.command == "ops":
        from kvstack import ops

        print(ops.report())
        return 0
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others
