"""The quality benchmark: what token eviction at a 50 % budget costs in answers and likelihood.

Measured in one run (``run_quality``) on SmolLM2-135M-Instruct (CPU, float32), for the full
cache and each eviction policy on ``TokenTableCache(ratio=0.5)`` (each token table keeps half
of the prompt's tokens; eviction runs after the prefill and after every decode step):

* accuracy on the long-context retrieval set of ``bench/quality_data.py`` (passkey, needle and
  question answering over passages; 600-1500-token prompts): the item's text and question as
  the user turn of the chat template, the assistant turn opened with the answer's first words
  (a cloze such as "The five-digit pass key is"; without it SmolLM2-135M restates the question
  and runs out of tokens), greedy decoding of at most ``max_new_tokens`` tokens; an item is
  right when one of its answer strings appears in the output (any case);
* teacher-forced NLL of held-out text (``data/quality/heldout_*.txt``, no chat template): the
  first ``nll_context`` tokens are prefilled into the cache, then the next ``nll_continuation``
  tokens are fed one at a time (each a decode step, so the cache evicts at every step), and the
  mean of -log p(next token) over the continuation is taken (natural log, nats per token).

Full cache: ``DynamicCache`` with "sdpa" attention (``PagedCache`` with "kvstack" gives the same
tokens). Policies run with "kvstack" attention, their default settings.

Figures (flat name -> float, ``figures.json``):

    vtoken.quality.accuracy.full              fraction of items right, full cache
    vtoken.quality.accuracy.<policy>          ... TokenTableCache(<policy>, ratio=0.5)
    vtoken.quality.accuracy.<config>.<kind>   per item kind (passkey, needle, qa)
    vtoken.quality.nll.full                   mean NLL per continuation token (nats)
    vtoken.quality.nll.<policy>
    vtoken.quality.nll_delta.<policy>         nll.<policy> - nll.full
    vtoken.quality.nll.<config>.<text>        per held-out text

with ``<policy>`` in h2o, scissorhands, random, streamingllm, snapkv, tova.

Cost: one prefill of ~1000 tokens per item and cache (7 x 64) plus 7 x 3 x 192 decode steps;
about 40 minutes on 2 shared CPU cores with ``OMP_NUM_THREADS=1`` (on a loaded machine, more
threads than free cores makes these small sequential forwards several times slower).
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from kvstack.bench import quality_data
from kvstack.bench.quality_data import KINDS, QualityItem
from kvstack.errors import InvalidArgumentError
from kvstack.models import greedy_generation_config

POLICIES = ("h2o", "scissorhands", "random", "streamingllm", "snapkv", "tova")
FULL_NAME = "full"
PREFIX = "vtoken.quality"


@dataclass(frozen=True)
class QualityConfig:
    counts: dict[str, int]  # items per kind
    words: tuple[int, int]  # context length range of the items, in words
    policies: tuple[str, ...]
    nll_texts: tuple[str, ...]  # names of held-out texts (heldout_<name>.txt)
    nll_context: int  # tokens prefilled before the scored continuation
    nll_continuation: int  # tokens scored, one decode step each
    ratio: float = 0.5
    max_new_tokens: int = 12
    block_size: int = 16
    seed: int = quality_data.SEED


FULL = QualityConfig(
    counts=dict(quality_data.DEFAULT_COUNTS),
    words=(quality_data.MIN_WORDS, quality_data.MAX_WORDS),
    policies=POLICIES,
    nll_texts=("letters", "orchestra", "tides"),
    nll_context=1024,
    nll_continuation=192,
)
# One short item per kind, one short text, two policies: checks the pipeline in seconds; its
# numbers mean nothing.
QUICK = QualityConfig(
    counts={"passkey": 1, "needle": 1, "qa": 1},
    words=(120, 160),
    policies=("h2o", "streamingllm"),
    nll_texts=("letters",),
    nll_context=96,
    nll_continuation=16,
)


# --------------------------------------------------------------------------- model plumbing
def prompt_ids(tokenizer: Any, item: QualityItem) -> torch.Tensor:
    """[1, T]: the item as a chat user turn, then the assistant turn opened with its prefix."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": item.prompt}], add_generation_prompt=True, tokenize=False
    )
    text += item.answer_prefix
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class CacheCase:
    name: str  # "full" or a policy name
    attn: str
    make: Callable[[], Any]


def _cases(model: Any, config: QualityConfig) -> list[CacheCase]:
    from transformers import DynamicCache

    from kvstack.demo import make_policy
    from kvstack.hf import TokenTableCache

    cases = [CacheCase(FULL_NAME, "sdpa", lambda: DynamicCache(config=model.config))]
    for name in config.policies:
        cases.append(
            CacheCase(
                name,
                "kvstack",
                lambda name=name: TokenTableCache(
                    model.config,
                    make_policy(name),  # a fresh policy, default settings
                    ratio=config.ratio,
                    block_size=config.block_size,
                ),
            )
        )
    return cases


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings(), torch.inference_mode():
        # transformers 5.24 renames past_key_values to cache (5.17 has only the old name); the
        # old one works on both and warns on 5.24.
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        yield


def generate_answer(
    model: Any, tokenizer: Any, ids: torch.Tensor, cache: Any, generation_config: Any
) -> str:
    with _quiet():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            generation_config=generation_config,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def continuation_nll(model: Any, context: torch.Tensor, continuation: torch.Tensor, cache: Any):
    """Mean -log p(continuation token | everything before it), natural log, teacher-forced.

    ``context`` [1, C] is prefilled into ``cache``; then each continuation token but the last is
    fed alone (one decode step, after which an evicting cache evicts), and the next token's
    probability is read from that step's logits. The first continuation token is scored from the
    prefill's last logits."""
    import torch.nn.functional as F

    steps = continuation.shape[1]
    total = 0.0
    with _quiet():
        seen = context.shape[1]
        out = model(
            input_ids=context,
            attention_mask=torch.ones_like(context),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        for t in range(steps):
            logp = F.log_softmax(out.logits[0, -1].float(), dim=-1)  # [V]
            total -= float(logp[continuation[0, t]])
            if t + 1 == steps:
                break
            seen += 1
            out = model(
                input_ids=continuation[:, t : t + 1],
                attention_mask=torch.ones(1, seen, dtype=torch.long),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
    return total / steps


# --------------------------------------------------------------------------- run and report
def run_quality(
    out_dir: str | Path,
    quick: bool = False,
    *,
    command: str | None = None,
    verbose: bool = False,
    config: QualityConfig | None = None,
    model_and_tokenizer: tuple[Any, Any] | None = None,
) -> dict[str, float]:
    """Measure accuracy and NLL for the full cache and each policy; write ``figures.json``,
    ``report.md``, ``outputs.json`` (every item's output per cache) and ``quality.png`` under
    ``out_dir``; return the figures.

    ``quick`` uses ``QUICK`` (three short items, one short text, two policies) to exercise the
    pipeline; its numbers mean nothing. ``config`` overrides both. ``command`` is recorded in
    the report (default: the equivalent ``kvstack bench quality`` command). ``verbose`` logs
    progress to stderr. ``model_and_tokenizer``: a loaded SmolLM2 whose attention
    implementation may be switched (default: ``load_smollm2(fresh=True)``).
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir must be a directory, got existing file {str(out)!r}")
    if config is None:
        config = QUICK if quick else FULL
    unknown = set(config.policies) - set(POLICIES)
    if unknown:
        raise InvalidArgumentError(f"unknown policies {sorted(unknown)}; expected among {POLICIES}")
    if command is None:
        command = f"kvstack bench quality --out {out}" + (" --quick" if quick else "")

    def log(message: str) -> None:
        if verbose:
            print(f"[kvstack bench quality] {message}", file=sys.stderr, flush=True)

    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")

    if model_and_tokenizer is None:
        from kvstack.models import load_smollm2

        log("loading SmolLM2-135M-Instruct")
        # fresh: this run switches the attention implementation, so it needs its own copy.
        model_and_tokenizer = load_smollm2(progress=verbose, fresh=True)
    model, tokenizer = model_and_tokenizer

    items = quality_data.build_items(config.counts, seed=config.seed, words=config.words)
    item_ids = [prompt_ids(tokenizer, item) for item in items]
    texts = quality_data.heldout_texts()
    missing = set(config.nll_texts) - set(texts)
    if missing:
        raise InvalidArgumentError(f"no held-out texts {sorted(missing)}; have {sorted(texts)}")
    nll_ids = {}
    need = config.nll_context + config.nll_continuation
    for name in config.nll_texts:
        ids = tokenizer(texts[name], return_tensors="pt")["input_ids"]
        if ids.shape[1] < need:
            raise InvalidArgumentError(
                f"held-out text {name!r} has {ids.shape[1]} tokens; nll_context + "
                f"nll_continuation = {need}"
            )
        nll_ids[name] = (ids[:, : config.nll_context], ids[:, config.nll_context : need])

    generation_config = greedy_generation_config(model, tokenizer, config.max_new_tokens)
    cases = _cases(model, config)
    results: dict[str, dict] = {}
    for case in cases:
        model.set_attn_implementation(case.attn)
        # Warm-up (torch.compile of the kvstack attention happens here, not in the timings).
        generate_answer(model, tokenizer, item_ids[0][:, :48], case.make(), generation_config)
        start = time.perf_counter()
        outputs = []
        for item, ids in zip(items, item_ids, strict=True):
            text = generate_answer(model, tokenizer, ids, case.make(), generation_config)
            outputs.append({"id": item.id, "output": text, "correct": item.is_correct(text)})
            log(f"{case.name}: {item.id} ({ids.shape[1]} tokens) {outputs[-1]['correct']}")
        item_seconds = time.perf_counter() - start
        start = time.perf_counter()
        nll = {}
        for name, (context, continuation) in nll_ids.items():
            nll[name] = continuation_nll(model, context, continuation, case.make())
            log(f"{case.name}: NLL {name} {nll[name]:.4f}")
        results[case.name] = {
            "outputs": outputs,
            "nll": nll,
            "item_seconds": item_seconds,
            "nll_seconds": time.perf_counter() - start,
        }
    model.set_attn_implementation("sdpa")

    figures = _figures(items, results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    (out / "outputs.json").write_text(
        json.dumps(
            {
                "items": [
                    {
                        "id": item.id,
                        "kind": item.kind,
                        "answers": list(item.answers),
                        "depth": round(item.depth, 4),
                        "prompt_tokens": int(ids.shape[1]),
                    }
                    for item, ids in zip(items, item_ids, strict=True)
                ],
                "outputs": {name: r["outputs"] for name, r in results.items()},
            },
            indent=1,
        )
        + "\n"
    )
    _plot(config, figures, out / "quality.png")
    lengths = [int(ids.shape[1]) for ids in item_ids]
    (out / "report.md").write_text(
        _report(config, items, lengths, figures, results, command, quick)
    )
    return figures


def _figures(items: Sequence[QualityItem], results: dict[str, dict]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for name, r in results.items():
        correct = [o["correct"] for o in r["outputs"]]
        figures[f"{PREFIX}.accuracy.{name}"] = sum(correct) / len(correct)
        for kind in KINDS:
            of_kind = [c for c, item in zip(correct, items, strict=True) if item.kind == kind]
            if of_kind:
                figures[f"{PREFIX}.accuracy.{name}.{kind}"] = sum(of_kind) / len(of_kind)
        # Every text has the same number of scored tokens, so the mean of means is the mean.
        figures[f"{PREFIX}.nll.{name}"] = sum(r["nll"].values()) / len(r["nll"])
        for text, value in r["nll"].items():
            figures[f"{PREFIX}.nll.{name}.{text}"] = value
    full = figures[f"{PREFIX}.nll.{FULL_NAME}"]
    for name in results:
        if name != FULL_NAME:
            figures[f"{PREFIX}.nll_delta.{name}"] = figures[f"{PREFIX}.nll.{name}"] - full
    return figures


def _depth_bucket(depth: float) -> int:
    return min(int(depth * 3), 2)


def _report(
    config: QualityConfig,
    items: Sequence[QualityItem],
    lengths: Sequence[int],
    figures: dict[str, float],
    results: dict[str, dict],
    command: str,
    quick: bool,
) -> str:
    counts = ", ".join(f"{sum(i.kind == k for i in items)} {k}" for k in KINDS)
    lines = [
        "# kvstack quality benchmark (vToken: accuracy and NLL under eviction)",
        "",
        f"Produced by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
    ]
    if quick:
        lines += [
            "**Quick run: three short items and one short text; the numbers mean nothing.**",
            "",
        ]
    lines += [
        "## Workload",
        "",
        f"- Model: SmolLM2-135M-Instruct, float32, CPU ({platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s), Python "
        f"{platform.python_version()}).",
        f"- Items: {len(items)} ({counts}), built by `bench/quality_data.py` (seed "
        f"{config.seed}); prompts {min(lengths)}-{max(lengths)} tokens (mean "
        f"{sum(lengths) / len(lengths):.0f}) with the chat template, question after the text, "
        "the assistant turn opened with the answer's first words.",
        f"- Decoding: greedy, at most {config.max_new_tokens} new tokens (stops at end of "
        "turn); right = an accepted answer string appears in the output, any case.",
        f"- Caches: full = `DynamicCache` (sdpa); policies = `TokenTableCache(policy, "
        f"ratio={config.ratio:g}, block_size={config.block_size})` with kvstack attention, "
        "default policy settings; each token table keeps "
        f"ceil({config.ratio:g} x prompt tokens), evicting after the prefill and every decode "
        "step.",
        f"- NLL: held-out texts {', '.join(config.nll_texts)} (`bench/data/quality/"
        f"heldout_*.txt`, plain text, no chat template): first {config.nll_context} tokens "
        f"prefilled, next {config.nll_continuation} tokens scored teacher-forced one decode "
        "step at a time (so the budget is ratio x context tokens throughout); mean nats per "
        "scored token, averaged over texts.",
        "",
        "## Results",
        "",
        "| cache | accuracy | " + " | ".join(KINDS) + " | NLL | NLL - full | items s | NLL s |",
        "|---|---:|" + "---:|" * len(KINDS) + "---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        delta = figures.get(f"{PREFIX}.nll_delta.{name}")
        cells = [
            name,
            f"{figures[f'{PREFIX}.accuracy.{name}']:.3f}",
            *(
                f"{figures[f'{PREFIX}.accuracy.{name}.{k}']:.2f}"
                if f"{PREFIX}.accuracy.{name}.{k}" in figures
                else "-"
                for k in KINDS
            ),
            f"{figures[f'{PREFIX}.nll.{name}']:.4f}",
            "-" if delta is None else f"{delta:+.4f}",
            f"{r['item_seconds']:.0f}",
            f"{r['nll_seconds']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "![accuracy and NLL per cache](quality.png)",
        "",
        "### Accuracy by depth of the fact in the context",
        "",
        "| cache | depth < 1/3 | 1/3 - 2/3 | > 2/3 |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        cells = [name]
        for bucket in range(3):
            of = [
                o["correct"]
                for o, i in zip(r["outputs"], items, strict=True)
                if _depth_bucket(i.depth) == bucket
            ]
            cells.append(f"{sum(of)}/{len(of)}" if of else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "### NLL per held-out text (nats per token)",
        "",
        "| cache | " + " | ".join(config.nll_texts) + " |",
        "|---|" + "---:|" * len(config.nll_texts),
    ]
    for name, r in results.items():
        lines.append(
            "| " + " | ".join([name, *(f"{r['nll'][t]:.4f}" for t in config.nll_texts)]) + " |"
        )
    lines += [
        "",
        "Every item's output per cache is in `outputs.json`; all figures are in `figures.json`. "
        "Seconds are wall time on a shared CPU, for the record only.",
        "",
    ]
    return "\n".join(lines)


def _plot(config: QualityConfig, figures: dict[str, float], path: Path) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [FULL_NAME, *config.policies]
    fig = Figure(figsize=(9, 3.8), dpi=120)
    FigureCanvasAgg(fig)
    ax_acc, ax_nll = fig.subplots(1, 2)
    accuracy = [figures[f"{PREFIX}.accuracy.{n}"] for n in names]
    bars = ax_acc.bar(names, accuracy, color=["0.5"] + ["C0"] * len(config.policies))
    ax_acc.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_ylabel("accuracy")
    ax_acc.set_title(f"Retrieval accuracy, budget ratio {config.ratio:g}", fontsize=9)
    delta = [figures[f"{PREFIX}.nll_delta.{n}"] for n in config.policies]
    bars = ax_nll.bar(list(config.policies), delta, color="C1")
    ax_nll.bar_label(bars, fmt="%+.3f", fontsize=7)
    ax_nll.axhline(0, color="0.3", linewidth=0.8)
    ax_nll.set_ylabel("NLL - full cache (nats/token)")
    full = figures[f"{PREFIX}.nll.{FULL_NAME}"]
    ax_nll.set_title(f"Held-out NLL vs full cache ({full:.3f})", fontsize=9)
    for ax in (ax_acc, ax_nll):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
