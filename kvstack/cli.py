"""The ``kvstack`` command.

    kvstack bench SUITE --out DIR [--quick]  run a benchmark (core, vtoken, quality, arena,
                                             serve, kvpress, tangram, tiers, memory, gpu): its
                                             report under DIR, its results (full runs) in
                                             bench/results/SUITE.json, to be committed
    kvstack figures [--check]                render the README's figure tables from those files;
                                             --check: fail if one differs or is stale
    kvstack ops                              the op registry: which backends run here, or why not
    kvstack calibrate --ratio R --out FILE [--model-path M] [--samples N] ...
                                             per-KV-head budgets from pilot samples (Tangram)
    kvstack memory [--conversation FILE] [--questions N] [-k K] [--store DIR] ...
                                             a fact memory: answers with the facts' K/V
                                             injected, TTFT against prefilling their text
    kvstack demo [--policy P] [--budget N | --ratio R] [--quick] ...
                                             one long prompt through DynamicCache, PagedCache and
                                             TokenTableCache on SmolLM2: memory and speed table

Heavy imports (torch.compile backends, matplotlib) happen inside the command that needs them,
so ``kvstack ops`` and ``--help`` stay quick.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# suite -> (help, what --quick runs)
BENCH_SUITES = {
    "core": ("attention ops and the repack copy against baselines of the same run", "tiny sizes"),
    "vtoken": (
        "retained KV blocks with reclamation vs Naive-Evict, and generate speed (SmolLM2)",
        "two short prompts",
    ),
    "quality": (
        "retrieval accuracy and held-out NLL per policy at 50%% budget (SmolLM2)",
        "three items",
    ),
    "arena": (
        "real bytes of evicting caches and chunked prefill (SmolLM2); hybrid page layouts",
        "a short prompt",
    ),
    "serve": (
        "many requests on one fixed arena through the Engine: concurrency, throughput (SmolLM2)",
        "four short requests",
    ),
    "kvpress": (
        "evicting prefill against kvpress's same presses, side by side (SmolLM2; needs "
        "`make kvpress-env`)",
        "two prompts",
    ),
    "tangram": (
        "calibrated per-head budgets: head-group overallocation, work-list balance and planning "
        "time (SmolLM2)",
        "three short pilot samples",
    ),
    "tiers": (
        "TieredCache with most of the KV on host and disk: decode speed, prefetch overlap, "
        "bytes per token, resume from disk (SmolLM2)",
        "a short prompt",
    ),
    "memory": (
        "a fact memory: time to first token and accuracy, facts' KV injected against their text "
        "prefilled (SmolLM2)",
        "six questions, k = 2 and 4",
    ),
    "gpu": ("generate speed on a CUDA device (SmolLM2 architecture)", "eight new tokens"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstack", description="KV-cache memory management for LLM inference."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser(
        "bench",
        help="run a benchmark: its report under --out, its results in bench/results/SUITE.json",
    )
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name, (help_text, quick_text) in BENCH_SUITES.items():
        suite = suites.add_parser(name, help=help_text)
        suite.add_argument("--out", required=True, type=Path, help="directory for the report")
        suite.add_argument(
            "--quick",
            action="store_true",
            help=f"{quick_text}: checks the pipeline only, writes no committed results",
        )

    figures = commands.add_parser(
        "figures", help="render the README's figure tables from bench/results/*.json"
    )
    figures.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 if a table differs from its results file or a file is stale",
    )

    commands.add_parser("ops", help="list every operation and backend: available, or why not")

    _add_calibrate_parser(commands)

    _add_demo_parser(commands)
    _add_memory_parser(commands)
    return parser


def _demo_option(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type for the demo option ``name``: ``parse`` the text (int, float, Path), then
    check it with the demo's own rule (``kvstack.demo.check_option``); a rule's error becomes a
    usage error (exit status 2) that names the option, the value and what was expected."""

    def convert(text: str) -> Any:
        from kvstack.demo import check_option
        from kvstack.errors import InvalidArgumentError

        try:
            value = parse(text)
        except ValueError:
            value = text  # not a number at all: the rule refuses the text itself
        try:
            return check_option(name, value)
        except InvalidArgumentError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = name  # what argparse calls the type in its own messages
    return convert


def _add_demo_parser(commands: argparse._SubParsersAction) -> None:
    from kvstack.demo import DEFAULT_NEW_TOKENS, DEFAULT_RATIO, POLICY_NAMES, QUICK_NEW_TOKENS

    demo = commands.add_parser(
        "demo",
        help="one long prompt through DynamicCache, PagedCache and TokenTableCache",
        description="Greedy generation of one long prompt with DynamicCache, PagedCache and "
        "TokenTableCache (token eviction with reclaimed memory); prints what each generated "
        "and a table of blocks, KV bytes, live tokens, tokens/s and repacks. SmolLM2-135M-Instruct "
        "comes from `make install`; the first run converts it (cached for later runs).",
    )
    demo.add_argument(
        "--model-path",
        type=_demo_option("model_path", Path),
        help="directory of a local Hugging Face causal LM to use instead of SmolLM2",
    )
    demo.add_argument(
        "--policy",
        type=_demo_option("policy", str),
        default="h2o",
        metavar="{" + ",".join(POLICY_NAMES) + "}",
        help="eviction policy of the TokenTableCache (%(default)s)",
    )
    demo.add_argument(
        "--budget",
        type=_demo_option("budget", int),
        help="live tokens kept per token table (instead of --ratio)",
    )
    demo.add_argument(
        "--ratio",
        type=_demo_option("ratio", float),
        help=f"fraction of the prompt kept per token table, in (0, 1] (default {DEFAULT_RATIO})",
    )
    demo.add_argument(
        "--prompt-file",
        type=_demo_option("prompt_file", Path),
        help="UTF-8 text to use as the prompt (default: the built-in handbook and its question)",
    )
    demo.add_argument(
        "--max-new-tokens",
        type=_demo_option("max_new_tokens", int),
        help=f"tokens to generate per cache (default {DEFAULT_NEW_TOKENS}; "
        f"{QUICK_NEW_TOKENS} with --quick)",
    )
    demo.add_argument(
        "--block-size",
        type=_demo_option("block_size", int),
        default=16,
        help="tokens per block (%(default)s)",
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
    # argparse checked each option on its own; the rules across options (one of --budget and
    # --ratio, a budget the policy can keep) need no model either: a usage error too.
    try:
        options = check_options(options)
    except InvalidArgumentError as error:
        args.demo_parser.error(str(error))  # exits with status 2
    run_demo(options)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text}")
    return value


def _add_memory_parser(commands: Any) -> None:
    memory = commands.add_parser(
        "memory",
        help="a fact memory from a conversation file: answers, and TTFT injected vs prefilled",
        description="Builds a FactMemory from a conversation file (JSON: sessions with turns, "
        "the facts they state, questions; default: kvstack's generated evaluation set), answers "
        "questions with the retrieved facts' K/V injected, and prints each question's time to "
        "first token injected and with the facts' text prefilled (SmolLM2-135M-Instruct).",
    )
    memory.add_argument("--conversation", type=Path, help="the conversation file (JSON)")
    memory.add_argument(
        "--write-example",
        type=Path,
        metavar="FILE",
        help="write the generated evaluation set as a conversation file and exit",
    )
    memory.add_argument("--questions", type=_positive_int, default=10, help="(%(default)s)")
    memory.add_argument(
        "-k", type=_positive_int, default=5, help="facts retrieved per question (%(default)s)"
    )
    memory.add_argument(
        "--context-turns",
        type=int,
        default=5,
        help="w: turns before a fact it is encoded after (%(default)s)",
    )
    memory.add_argument(
        "--store", type=Path, help="directory of a saved memory: reopened, or written after build"
    )


def _run_memory(args: argparse.Namespace) -> int:
    from kvstack.memory_demo import run_memory_demo, write_example

    if args.write_example is not None:
        write_example(args.write_example)
        print(f"wrote {args.write_example}")
        return 0
    run_memory_demo(
        args.conversation,
        questions=args.questions,
        k=args.k,
        context_turns=args.context_turns,
        store=args.store,
    )
    return 0


def _add_calibrate_parser(commands: Any) -> None:
    from kvstack.calibrate import (
        DEFAULT_ALPHA,
        DEFAULT_FLOOR,
        DEFAULT_SAMPLE_TOKENS,
        DEFAULT_WINDOW,
    )

    calibrate = commands.add_parser(
        "calibrate",
        help="measure per-KV-head budgets on pilot samples (Tangram) and write a head profile",
    )
    calibrate.add_argument(
        "--model-path",
        type=Path,
        help="a local Hugging Face causal LM directory (default: SmolLM2-135M-Instruct)",
    )
    calibrate.add_argument("--samples", type=int, default=50, help="pilot samples (%(default)s)")
    calibrate.add_argument(
        "--ratio",
        type=float,
        required=True,
        help="the fraction of each layer's tokens the allocation keeps, in (0, 1]",
    )
    calibrate.add_argument("--out", type=Path, required=True, help="the profile file to write")
    calibrate.add_argument(
        "--alpha",
        type=float,
        default=DEFAULT_ALPHA,
        help="budget = min(1, mean + alpha * std) of a head's shares (%(default)s)",
    )
    calibrate.add_argument(
        "--sample-tokens",
        type=int,
        default=DEFAULT_SAMPLE_TOKENS,
        help="tokens per pilot sample (%(default)s)",
    )
    calibrate.add_argument(
        "--window", type=int, default=DEFAULT_WINDOW, help="SnapKV's observation window"
    )
    calibrate.add_argument(
        "--floor",
        type=float,
        default=DEFAULT_FLOOR,
        help="the part of an even split every head keeps first (%(default)s)",
    )
    calibrate.add_argument("--seed", type=int, default=0, help="pilot sample order (%(default)s)")
    calibrate.set_defaults(calibrate_parser=calibrate)  # for usage errors found after parsing


def _run_calibrate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from kvstack.calibrate import (
        DEFAULT_KERNEL_SIZE,
        calibrate,
        check_calibration_args,
        pilot_samples,
    )
    from kvstack.demo import load_model
    from kvstack.errors import InvalidArgumentError

    # Every rule that needs no model is checked first: a usage error (exit status 2), no load.
    try:
        check_calibration_args(
            args.samples,
            args.ratio,
            args.alpha,
            args.window,
            DEFAULT_KERNEL_SIZE,
            args.floor,
            args.sample_tokens,
        )
    except InvalidArgumentError as error:
        args.calibrate_parser.error(str(error))
    # The profile is written after minutes of calibration: a path it could never be written to
    # is a usage error now, not a traceback then.
    out_problem = _unwritable_file(args.out)
    if out_problem:
        args.calibrate_parser.error(f"--out {str(args.out)!r}: {out_problem}")
    model, tokenizer, name = load_model(args.model_path)
    samples = pilot_samples(tokenizer, args.samples, args.sample_tokens, seed=args.seed)
    with tqdm(total=len(samples), desc=f"calibrating {name}", unit="sample") as bar:
        profile = calibrate(
            model,
            samples,
            args.ratio,
            alpha=args.alpha,
            window=args.window,
            floor=args.floor,
            progress=lambda done, total: bar.update(1),
        )
    profile.save(args.out)
    stability = profile.calibration
    print(
        f"{args.out}: {profile.num_layers} layers x {profile.num_kv_heads} KV heads, mean budget "
        f"{stability['mean_budget']:.3f} at ratio {args.ratio:g} (alpha {args.alpha:g}); head "
        f"ranking vs the other samples: Spearman mean {stability['spearman_mean']:.3f}, "
        f"min {stability['spearman_min']:.3f}"
    )
    return 0


def _unwritable_file(path: Path) -> str | None:
    """Why a file could not be written at ``path`` (None: it could): a directory there, or a
    folder that is missing or not writable (the file and its temporary sit in that folder)."""
    if path.is_dir():
        return "is a directory; expected the path of the file to write"
    folder = path.parent
    if not folder.is_dir():
        return f"its folder {str(folder)!r} does not exist"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {str(folder)!r} is not writable"
    return None


def _run_bench(name: str, out: Path, quick: bool, argv: Sequence[str]) -> int:
    """Run benchmark ``name`` (a key of BENCH_SUITES) into ``out`` and print its report."""
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
    if args.command == "calibrate":
        return _run_calibrate(args)
    if args.command == "memory":
        return _run_memory(args)
    if args.command == "figures":
        from kvstack.bench.figures import main as figures_main

        return figures_main(check_only=args.check)
    if args.command == "ops":
        from kvstack import ops

        print(ops.report())
        return 0
    raise AssertionError(f"unhandled command {args.command!r}")  # argparse rejects others
