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

Figures (``results.json``, and ``bench/results/quality.json`` for a full run):

    vtoken.quality.accuracy.full              fraction of items right, full cache
    vtoken.quality.accuracy.<policy>          ... TokenTableCache(<policy>, ratio=0.5)
    vtoken.quality.accuracy.<config>.<kind>   per item kind (passkey, needle, qa)
    vtoken.quality.nll.full                   mean NLL per continuation token (nats)
    vtoken.quality.nll.<policy>
    vtoken.quality.nll_delta.<policy>         nll.<policy> - nll.full
    vtoken.quality.nll.<config>.<text>        per held-out text

with ``<policy>`` in h2o, scissorhands, random, streamingllm, snapkv, tova, and h2o_chunk256
(H2O with ``prefill_chunk=256``: the quality cost of a bounded prefill peak).

Cost: one prefill of ~1000 tokens per item and cache (7 x 64) plus 7 x 3 x 192 decode steps;
about 40 minutes on 2 shared CPU cores with ``OMP_NUM_THREADS=1`` (on a loaded machine, more
threads than free cores makes these small sequential forwards several times slower).
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstack.bench import quality_data
from kvstack.bench.quality_data import KINDS, QualityItem
from kvstack.bench.suite import CACHE_CODE, Figure, Measured, run_suite
from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.models import greedy_generation_config

NAME = "quality"
DEPENDS_ON = (
    *CACHE_CODE,
    "kvstack/models.py",
    "bench/quality.py",
    "bench/quality_data.py",
    "bench/data/quality",
)
POLICIES = ("h2o", "scissorhands", "random", "streamingllm", "snapkv", "tova")
# "<policy>_chunk<N>": the policy with TokenTableCache(prefill_chunk=N), which prefills N tokens
# at a time and evicts down to the budget after each chunk (a bounded peak, at a quality cost).
CHUNKED = ("h2o_chunk256",)


def split_case_name(name: str) -> tuple[str, int | None]:
    """``"h2o_chunk256"`` -> ("h2o", 256); ``"h2o"`` -> ("h2o", None)."""
    policy, _, chunk = name.partition("_chunk")
    return policy, int(chunk) if chunk else None


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
    policies=(*POLICIES, *CHUNKED),
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

    from kvstack.hf import TokenTableCache
    from kvstack.policies import BY_NAME

    cases = [CacheCase(FULL_NAME, "sdpa", lambda: DynamicCache(config=model.config))]
    for name in config.policies:
        policy, chunk = split_case_name(name)
        cases.append(
            CacheCase(
                name,
                "kvstack",
                lambda policy=policy, chunk=chunk: TokenTableCache(
                    model.config,
                    BY_NAME[policy](),  # a fresh policy, default settings
                    ratio=config.ratio,
                    block_size=config.block_size,
                    prefill_chunk=chunk,
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
    """Measure accuracy and NLL for the full cache and each policy into ``out_dir``
    (``bench/suite.py`` says what is written; ``outputs.json`` holds every item's output per
    cache); return the figures.

    ``quick`` uses ``QUICK`` (three short items, one short text, two policies) to exercise the
    pipeline; its numbers mean nothing. ``config`` overrides both (and, like ``quick``, keeps
    the run out of the committed results file). ``model_and_tokenizer``: a loaded SmolLM2 whose
    attention implementation may be switched (default: ``load_smollm2(fresh=True)``).
    """
    if config is None:
        config = QUICK if quick else FULL
    unknown = {split_case_name(name)[0] for name in config.policies} - set(POLICIES)
    if unknown:
        raise InvalidArgumentError(f"unknown policies {sorted(unknown)}; expected among {POLICIES}")
    return run_suite(
        NAME,
        lambda quick, log: measure(config, log, model_and_tokenizer, quick),
        DEPENDS_ON,
        out_dir,
        quick=quick or config is not FULL,
        command=command,
        verbose=verbose,
    )


def measure(
    config: QualityConfig,
    log: Callable[[str], None],
    model_and_tokenizer: tuple[Any, Any] | None = None,
    quick: bool = False,
) -> Measured:
    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")

    if model_and_tokenizer is None:
        from kvstack.models import load_smollm2

        log("loading SmolLM2-135M-Instruct")
        # fresh: this run switches the attention implementation, so it needs its own copy.
        model_and_tokenizer = load_smollm2(progress=True, fresh=True)
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
    results: dict[str, dict] = {}
    for case in _cases(model, config):
        model.set_attn_implementation(case.attn)
        outputs = []
        for item, ids in zip(items, item_ids, strict=True):
            text = generate_answer(model, tokenizer, ids, case.make(), generation_config)
            outputs.append({"id": item.id, "output": text, "correct": item.is_correct(text)})
            log(f"{case.name}: {item.id} ({ids.shape[1]} tokens) {outputs[-1]['correct']}")
        nll = {}
        for name, (context, continuation) in nll_ids.items():
            nll[name] = continuation_nll(model, context, continuation, case.make())
            if not math.isfinite(nll[name]):
                raise KVStackError(f"{case.name}: NLL of {name!r} is {nll[name]}, not finite")
            log(f"{case.name}: NLL {name} {nll[name]:.4f}")
        results[case.name] = {"outputs": outputs, "nll": nll}
    model.set_attn_implementation("sdpa")

    figures = _figures(items, results)
    lengths = [int(ids.shape[1]) for ids in item_ids]
    outputs_json = {
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
    }
    workload = {
        "model": "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)",
        "dtype": "float32",
        "device": "cpu",
        "items": {kind: sum(i.kind == kind for i in items) for kind in KINDS},
        "item_seed": config.seed,
        "prompt_tokens": {"min": min(lengths), "max": max(lengths)},
        "max_new_tokens": config.max_new_tokens,
        "ratio": config.ratio,
        "block_size": config.block_size,
        "policies": list(config.policies),
        "nll_texts": list(config.nll_texts),
        "nll_context": config.nll_context,
        "nll_continuation": config.nll_continuation,
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack quality benchmark (vToken: accuracy and NLL under eviction)",
        sections=_sections(config, items, lengths, figures, results, quick),
        plot=lambda path: _plot(config, figures, path),
        extra_files={"outputs.json": json.dumps(outputs_json, indent=1) + "\n"},
    )


def _figures(items: Sequence[QualityItem], results: dict[str, dict]) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}
    for name, r in results.items():
        correct = [o["correct"] for o in r["outputs"]]
        figures[f"{PREFIX}.accuracy.{name}"] = Figure(
            sum(correct) / len(correct), "fraction", f"items right, {name}"
        )
        for kind in KINDS:
            of_kind = [c for c, item in zip(correct, items, strict=True) if item.kind == kind]
            if of_kind:
                figures[f"{PREFIX}.accuracy.{name}.{kind}"] = Figure(
                    sum(of_kind) / len(of_kind), "fraction", f"{kind} items right, {name}"
                )
        # Every text has the same number of scored tokens, so the mean of means is the mean.
        figures[f"{PREFIX}.nll.{name}"] = Figure(
            sum(r["nll"].values()) / len(r["nll"]),
            "nats/token",
            f"teacher-forced NLL of held-out text, mean over texts, {name}",
        )
        for text, value in r["nll"].items():
            figures[f"{PREFIX}.nll.{name}.{text}"] = Figure(
                value, "nats/token", f"NLL of {text}, {name}"
            )
    full = figures[f"{PREFIX}.nll.{FULL_NAME}"].value
    for name in results:
        if name != FULL_NAME:
            figures[f"{PREFIX}.nll_delta.{name}"] = Figure(
                figures[f"{PREFIX}.nll.{name}"].value - full,
                "nats/token",
                f"NLL of {name} - NLL of the full cache",
            )
    return figures


def _depth_bucket(depth: float) -> int:
    return min(int(depth * 3), 2)


def _sections(
    config: QualityConfig,
    items: Sequence[QualityItem],
    lengths: Sequence[int],
    figures: dict[str, Figure],
    results: dict[str, dict],
    quick: bool,
) -> list[str]:
    value = {name: figure.value for name, figure in figures.items()}
    counts = ", ".join(f"{sum(i.kind == k for i in items)} {k}" for k in KINDS)
    lines = []
    if quick:
        lines += [
            "**Quick run: three short items and one short text; the numbers mean nothing.**",
            "",
        ]
    lines += [
        "## Workload",
        "",
        "- Model: SmolLM2-135M-Instruct, float32, CPU.",
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
        "| cache | accuracy | " + " | ".join(KINDS) + " | NLL | NLL - full |",
        "|---|---:|" + "---:|" * len(KINDS) + "---:|---:|",
    ]
    for name in results:
        delta = value.get(f"{PREFIX}.nll_delta.{name}")
        cells = [
            name,
            f"{value[f'{PREFIX}.accuracy.{name}']:.3f}",
            *(
                f"{value[f'{PREFIX}.accuracy.{name}.{k}']:.2f}"
                if f"{PREFIX}.accuracy.{name}.{k}" in value
                else "-"
                for k in KINDS
            ),
            f"{value[f'{PREFIX}.nll.{name}']:.4f}",
            "-" if delta is None else f"{delta:+.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
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
    lines += ["", "Every item's output per cache is in `outputs.json`."]
    return lines


def _plot(config: QualityConfig, figures: dict[str, Figure], path: Path) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    figures = {name: figure.value for name, figure in figures.items()}
    names = [FULL_NAME, *config.policies]
    fig = MplFigure(figsize=(9, 3.8), dpi=120)
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


def readme_tables(results: dict) -> dict[str, str]:
    """The README's quality table, from a results file."""
    f = {name: figure["value"] for name, figure in results["figures"].items()}
    names = [FULL_NAME, *results["workload"]["policies"]]
    rows = [
        f"| cache | accuracy ({sum(results['workload']['items'].values())}) | "
        + " | ".join(KINDS)
        + " | NLL (nats/token) | NLL - full |",
        "|---|---:|" + "---:|" * len(KINDS) + "---:|---:|",
    ]
    for name in names:
        delta = f.get(f"{PREFIX}.nll_delta.{name}")
        rows.append(
            "| "
            + " | ".join(
                [
                    "full (`DynamicCache`)" if name == FULL_NAME else f"`{name}`",
                    f"{f[f'{PREFIX}.accuracy.{name}']:.3f}",
                    *(f"{f.get(f'{PREFIX}.accuracy.{name}.{k}', float('nan')):.2f}" for k in KINDS),
                    f"{f[f'{PREFIX}.nll.{name}']:.3f}",
                    "—" if delta is None else f"{delta:+.3f}",
                ]
            )
            + " |"
        )
    w = results["workload"]
    items = ", ".join(f"{n} {kind}" for kind, n in w["items"].items())
    workload = (
        f"Workload: {w['model']}, {w['device'].upper()}; {items} items of "
        f"{w['prompt_tokens']['min']}–{w['prompt_tokens']['max']} prompt tokens, greedy, at most "
        f"{w['max_new_tokens']} new tokens; policies at ratio {w['ratio']:g} with their default "
        f"settings; NLL over {w['nll_continuation']} tokens after a {w['nll_context']}-token "
        f"prefix of each of {len(w['nll_texts'])} held-out texts."
    )
    return {"quality": "\n".join(rows) + "\n\n" + workload}
