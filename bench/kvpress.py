"""kvstack's evicting caches against kvpress's same presses, side by side in one run.

Issue 13 asks that each policy's prefill-heavy ``generate`` be no slower than kvpress's same
press. kvpress 0.5.5 needs transformers < 5.3 and kvstack >= 5.17, so kvpress runs in its own
venv (``make kvpress-env``), in a worker process (``bench/kvpress_worker.py``) that this driver
feeds over a pipe. Only one side computes at a time: each round times every configuration of
both processes once, on one prompt, the order rotated from round to round
(``bench/timing.time_interleaved``); the worker times its own ``generate`` call, so the pipe is
not in its figure (it is a few hundred microseconds against seconds).

Workload: the vToken prompts (``bench/prompts.py``, 1.2k-1.3k tokens), batch 1, a greedy
``generate`` of ``PREFILL_NEW_TOKENS`` new tokens (so the prompt's prefill dominates),
SmolLM2-135M-Instruct in float32 (the same converted weights on both sides), one torch thread
per process, after one warm-up round.

* ``kvpress.kvstack_over_kvpress.{snapkv,tova,streaming}``: ``TokenTableCache(policy, ratio
  0.5)`` with kvstack attention ÷ kvpress's SnapKVPress / TOVAPress / StreamingLLMPress at
  ``compression_ratio`` 0.5 over a DynamicCache with sdpa, per round, median over prompts
  (target <= 1);
* ``kvpress.kvstack_over_kvpress.h2o``: H2O ÷ kvpress's ObservedAttentionPress, its H2O-like
  press, which needs eager attention (target <= 1);
* ``kvpress.dynamic_here_over_worker``: DynamicCache with sdpa here (transformers 5.24) ÷ the
  same in the worker (transformers 5.2): how far the two environments differ before any press.

What differs between the two sides, besides the code measured: kvpress computes the prompt's
attention with sdpa (eager for ObservedAttention), scores once after prefill, prunes to half the
prompt, and lets the new tokens grow the cache; kvstack keeps each table at its budget (half the
prompt) from the prefill on and evicts at every decode step. Both use their own defaults
(kvpress SnapKV: window 64, kernel 5; kvstack SnapKV: window 32, kernel 7; sinks 4 on both).
Every configuration's first new token comes from the unpruned prompt on both sides, so it must be
DynamicCache's: a mismatch stops the run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.prompts import build_prompts
from kvstack.bench.suite import CACHE_CODE, REPO_ROOT, Figure, Measured, run_suite
from kvstack.bench.timing import time_interleaved
from kvstack.bench.vtoken import PREFILL_NEW_TOKENS, PREFILL_POLICIES, SPEED_RATIO, _generate
from kvstack.errors import KVStackError

NAME = "kvpress"
DEPENDS_ON = (
    *CACHE_CODE,
    "kvstack/models.py",
    "bench/kvpress.py",
    "bench/kvpress_worker.py",
    "bench/vtoken.py",
    "bench/prompts.py",
    "bench/timing.py",
    "bench/data",
)
KVPRESS_VERSION = "0.5.5"
# Where ``make kvpress-env`` puts kvpress's venv; KVSTACK_KVPRESS_PYTHON names another python.
KVPRESS_PYTHON = REPO_ROOT / ".venv" / f"kvpress-{KVPRESS_VERSION}" / "bin" / "python"
WORKER = Path(__file__).with_name("kvpress_worker.py")
# kvstack policy -> kvpress's worker configuration of the same method
SAME_PRESS = {"snapkv": "snapkv", "tova": "tova", "streaming": "streaming", "h2o": "observed"}
TARGETS = {f"kvpress.kvstack_over_kvpress.{name}": ("<=", 1.0) for name in SAME_PRESS}
QUICK_PROMPTS = 2


class KVPressWorker:
    """The worker process: one JSON request per line in, one JSON reply per line out."""

    def __init__(self, python: Path) -> None:
        if not python.exists():
            raise KVStackError(
                f"kvpress's python {str(python)!r} does not exist: run `make kvpress-env` "
                "(or set KVSTACK_KVPRESS_PYTHON to a python with kvpress "
                f"{KVPRESS_VERSION} installed)"
            )
        env = {**os.environ, "PYTHONPATH": ""}  # nothing of this venv leaks into the worker's
        self.process = subprocess.Popen(
            # -P: the script's directory (bench/, which holds this module, kvpress.py) must not
            # come first on the worker's sys.path, or `import kvpress` would import this file.
            [str(python), "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def ask(self, **request: Any) -> dict:
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            raise KVStackError(f"the kvpress worker exited (status {self.process.wait()})")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise KVStackError(
                f"the kvpress worker failed on {request.get('op')!r}: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}"
            )
        return reply

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask_quit()
        self.process.wait(timeout=60)

    def ask_quit(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.process.stdin.flush()


def measure(quick: bool, log: Callable[[str], None]) -> Measured:
    from transformers import DynamicCache

    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
    from kvstack.hf import TokenTableCache
    from kvstack.models import load_smollm2, smollm2_cache_dir

    model, tokenizer = load_smollm2(progress=False, fresh=True)  # fresh: attention switches
    prompts = build_prompts(tokenizer, quick=quick)
    if quick:
        prompts = prompts[:QUICK_PROMPTS]
    python = Path(os.environ.get("KVSTACK_KVPRESS_PYTHON", KVPRESS_PYTHON))
    worker = KVPressWorker(python)
    try:
        loaded = worker.ask(
            op="load",
            model_dir=str(smollm2_cache_dir()),
            threads=torch.get_num_threads(),
            prompts=[p.input_ids[0].tolist() for p in prompts],
        )
        log(
            f"{len(prompts)} prompts ({', '.join(str(p.num_tokens) for p in prompts)} tokens); "
            f"worker: kvpress {loaded['versions']['kvpress']}, transformers "
            f"{loaded['versions']['transformers']}, {loaded['torch_threads']} torch thread(s)"
        )
        current = {"index": 0}

        def on_round(index: int | None) -> None:
            current["index"] = 0 if index is None else index

        def here(name: str) -> Callable[[], list[int]]:
            def call() -> list[int]:
                prompt = prompts[current["index"]]
                if name == "dynamic":
                    cache, attn = DynamicCache(config=model.config), "sdpa"
                else:
                    policy = PREFILL_POLICIES[name]()
                    cache, attn = (
                        TokenTableCache(model.config, policy, ratio=SPEED_RATIO),
                        "kvstack",
                    )
                return _generate(model, [prompt], cache, attn, PREFILL_NEW_TOKENS)[0].tolist()

            return call

        worker_seconds: dict[str, list[float]] = {}

        def there(config: str) -> Callable[[], list[int]]:
            def call() -> list[int]:
                reply = worker.ask(
                    op="generate",
                    config=config,
                    prompt=current["index"],
                    new_tokens=PREFILL_NEW_TOKENS,
                )
                worker_seconds.setdefault(config, []).append(reply["seconds"])
                return reply["tokens"]

            return call

        fns = {"dynamic": here("dynamic"), **{name: here(name) for name in SAME_PRESS}}
        fns["kvpress:dynamic"] = there("dynamic")
        fns.update({f"kvpress:{press}": there(press) for press in SAME_PRESS.values()})
        # Every call's new tokens, warm-up round first, then the timed rounds in prompt order.
        tokens: dict[str, list[list[int]]] = {name: [] for name in fns}

        def recorded(name: str, fn: Callable[[], list[int]]) -> Callable[[], list[int]]:
            def call() -> list[int]:
                tokens[name].append(fn())
                return tokens[name][-1]

            return call

        log(f"{', '.join(fns)}: one warm-up round, then one round per prompt")
        timings = time_interleaved(
            {name: recorded(name, fn) for name, fn in fns.items()},
            repeats=len(prompts),
            warmup=1,
            on_round=on_round,
        )
        versions = loaded["versions"]
    finally:
        worker.close()

    reference = [generated[0] for generated in tokens["dynamic"]]
    for name, generated in tokens.items():
        if [t[0] for t in generated] != reference:
            raise KVStackError(
                f"{name}: first new tokens {[t[0] for t in generated]} differ from "
                f"DynamicCache's {reference}: the two sides do not run the same model and prompts"
            )
    # kvpress's own timer (generate alone), the timed rounds only (after the warm-up call).
    seconds = dict(timings.seconds)
    for config, values in worker_seconds.items():
        seconds[f"kvpress:{config}"] = values[1:]
    # Whole greedy continuations of DynamicCache in both processes (timed rounds): equal unless
    # the two transformers versions compute the model differently enough to flip a token.
    dynamic_equal = statistics.mean(
        float(a == b)
        for a, b in zip(tokens["dynamic"][1:], tokens["kvpress:dynamic"][1:], strict=True)
    )
    figures = _figures(seconds)
    workload = {
        "model": "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)",
        "prompts": [{"name": p.name, "tokens": p.num_tokens} for p in prompts],
        "batch": 1,
        "new_tokens": PREFILL_NEW_TOKENS,
        "ratio": SPEED_RATIO,
        "same_press": SAME_PRESS,
        "kvpress": versions,
        "torch_threads": torch.get_num_threads(),
        "warmup_rounds": 1,
        "seconds": {name: values for name, values in seconds.items()},
        "dynamic_tokens_equal_across_processes": dynamic_equal,
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack's evicting prefill against kvpress's presses",
        sections=[_table(seconds)],
    )


def _figures(seconds: dict[str, list[float]]) -> dict[str, Figure]:
    def per_round(mine: str, theirs: str) -> float:
        return statistics.median(a / b for a, b in zip(seconds[mine], seconds[theirs], strict=True))

    what = f"generate of {PREFILL_NEW_TOKENS} new tokens after the prompt, batch 1"
    figures = {}
    for policy, press in SAME_PRESS.items():
        key = f"kvpress.kvstack_over_kvpress.{policy}"
        figures[key] = Figure(
            per_round(policy, f"kvpress:{press}"),
            "ratio",
            f"wall time of a {what}: TokenTableCache({policy}, ratio {SPEED_RATIO:g}) / kvpress "
            f"{press} press at compression_ratio {SPEED_RATIO:g}, same round, median over prompts",
            TARGETS[key],
        )
    figures["kvpress.dynamic_here_over_worker"] = Figure(
        per_round("dynamic", "kvpress:dynamic"),
        "ratio",
        f"wall time of a {what} with DynamicCache (sdpa): this process (kvstack's transformers) / "
        "the kvpress worker's, same round, median over prompts",
    )
    for name, values in seconds.items():
        figures[f"kvpress.seconds.{name.replace(':', '.')}"] = Figure(
            statistics.median(values), "s", f"{what}, {name}, median over prompts"
        )
    return figures


def _table(seconds: dict[str, list[float]]) -> str:
    rows = ["| kvstack | s/prompt | kvpress | s/prompt |", "|---|---:|---|---:|"]
    pairs = [("dynamic", "dynamic"), *SAME_PRESS.items()]
    for mine, theirs in pairs:
        rows.append(
            f"| {mine} | {statistics.median(seconds[mine]):.3g} | {theirs} | "
            f"{statistics.median(seconds[f'kvpress:{theirs}']):.3g} |"
        )
    return "Medians over prompts, seconds per prompt:\n\n" + "\n".join(rows)


def run_kvpress(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the kvpress comparison into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def readme_tables(results: dict) -> dict[str, str]:
    """The README's kvpress tables, from a results file."""
    from kvstack.bench.suite import figure_table

    w = results["workload"]
    lengths = [prompt["tokens"] for prompt in w["prompts"]]
    workload = (
        f"Workload: {w['model']}; {len(lengths)} prompts of {min(lengths)}-{max(lengths)} "
        f"tokens, batch 1, {w['new_tokens']} new tokens, ratio {w['ratio']:g}, "
        f"{w['torch_threads']} torch thread(s) per process; kvpress {w['kvpress']['kvpress']} "
        f"with transformers {w['kvpress']['transformers']} in its own venv. DynamicCache's "
        "whole continuations were equal in the two processes on "
        f"{w['dynamic_tokens_equal_across_processes']:.0%} of the rounds."
    )
    return {
        "figures": figure_table(results, [*TARGETS, "kvpress.dynamic_here_over_worker"]),
        "seconds": _table(w["seconds"]),
        "workload": workload,
    }
