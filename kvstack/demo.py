"""``kvstack demo``: one long prompt through three caches, with their memory side by side.

The same greedy generation (N new tokens, default 64) of one long prompt runs with

* ``DynamicCache`` — transformers' own cache, with ``sdpa`` attention: the baseline;
* ``PagedCache`` — the same tokens in block pools behind token tables (must give exactly
  ``DynamicCache``'s tokens);
* ``TokenTableCache`` — token eviction (H2O by default, half of the prompt kept per table) whose
  freed memory is reclaimed by repacking (vToken),

and a table reports what each holds at the end (blocks, exact K/V bytes, live tokens per
attention layer, repacks) and how fast it generated. The model is SmolLM2-135M-Instruct (installed
by ``make install``, converted once by ``kvstack.models.load_smollm2``), or any local Hugging Face
causal LM (``model_path``). The default prompt is a handbook shipped in ``kvstack/data/demo_prompt.txt``
(about 1,700 tokens with its question at the end).

Speed is measured after two short warm-up ``generate`` calls with each cache type, so
torch.compile's one-time compilation of the kvstack attention is not counted; both the warm-up
and the timed calls go through ``kvstack.bench.timing.time_interleaved``, the one timing path for
whole-program figures. Options are checked by :func:`check_options`, whose per-option rules
(:func:`check_option`) are also the argparse types of ``kvstack demo``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstack.errors import InvalidArgumentError
from kvstack.models import greedy_generation_config

if TYPE_CHECKING:
    import torch

    from kvstack.policies import EvictionPolicy

# torch, transformers and the policies are imported where they are used, so that importing this
# module (``kvstack --help`` does, for the names below) stays instant.

POLICY_NAMES = ("h2o", "scissorhands", "random", "streamingllm", "snapkv", "tova")
"""The ``--policy`` names; :func:`make_policy` builds each with its default settings."""

DEFAULT_PROMPT = "data/demo_prompt.txt"  # inside the kvstack package
DEFAULT_RATIO = 0.5
DEFAULT_NEW_TOKENS = 64
QUICK_NEW_TOKENS = 8
QUICK_BODY_CHARS = 600  # --quick keeps this much of the document, then its question
# Warm-up: a generate on each of two prompt prefixes, prefill + two decode steps each. Two
# lengths, because a compiled graph that was specialised to its first key length recompiles
# (dynamic) when it sees a second one; that should happen here, not in the timed run.
WARMUP_PROMPT_TOKENS = (64, 160)
WARMUP_NEW_TOKENS = 3
TEXT_CHARS = 200  # generated text is shown up to this many characters


@dataclass(frozen=True)
class DemoOptions:
    """What ``kvstack demo`` runs; ``None`` means the default (see :func:`check_options`)."""

    model_path: Path | None = None
    policy: str = "h2o"
    budget: int | None = None
    ratio: float | None = None
    prompt_file: Path | None = None
    max_new_tokens: int | None = None
    block_size: int = 16
    quick: bool = False


@dataclass
class DemoRow:
    """One cache's run: what it generated and what it held at the end."""

    cache: str  # the label shown in the table
    token_ids: list[int]  # the new tokens
    text: str
    seconds: float  # wall time of the timed generate call
    kv_bytes: int
    live_tokens_per_layer: float
    blocks: int | None = None  # None: not a block cache (DynamicCache)
    repacks: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / self.seconds


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy (its default settings) by ``--policy`` name."""
    from kvstack.policies import BY_NAME

    return BY_NAME[check_option("policy", name)]()


# ---------------------------------------------------------------------------------------------
# Options: every rule once, used by run_demo and (as its argparse types) by ``kvstack demo``


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise InvalidArgumentError(f"{name}={value!r}; expected an integer >= 1")
    return value


def _ratio(name: str, value: Any) -> float:
    # ``not 0 < value <= 1`` also rejects nan.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidArgumentError(f"{name}={value!r}; expected a number in (0, 1]")
    return float(value)


def _policy_name(name: str, value: Any) -> str:
    if value not in POLICY_NAMES:
        raise InvalidArgumentError(f"{name}={value!r}; expected one of {', '.join(POLICY_NAMES)}")
    return value


def _prompt_file(name: str, value: Any) -> Path:
    path = Path(value)
    if not path.is_file():
        raise InvalidArgumentError(
            f"{name}={str(path)!r} {'is not a file' if path.exists() else 'does not exist'}; "
            "expected a UTF-8 text file"
        )
    read_prompt(path, quick=False)  # readable, UTF-8, not empty
    return path


def _model_dir(name: str, value: Any) -> Path:
    path = Path(value)
    if not (path / "config.json").is_file():
        raise InvalidArgumentError(
            f"{name}={str(path)!r} {'has no config.json' if path.is_dir() else 'is not a directory'}"
            "; expected the directory of a Hugging Face causal LM (config.json, weights, tokenizer)"
        )
    return path


_OPTION_RULES: dict[str, Callable[[str, Any], Any]] = {
    "model_path": _model_dir,
    "policy": _policy_name,
    "budget": _positive_int,
    "ratio": _ratio,
    "prompt_file": _prompt_file,
    "max_new_tokens": _positive_int,
    "block_size": _positive_int,
}
_DEFAULTED = {"model_path", "budget", "ratio", "prompt_file", "max_new_tokens"}  # None: default


def check_option(name: str, value: Any) -> Any:
    """Check one option of :class:`DemoOptions` on its own (what needs no other option) and
    return it as ``DemoOptions`` holds it; ``kvstack demo`` uses this as its argparse types.

    Raises:
        InvalidArgumentError: naming the option, its value and what was expected.
    """
    return _OPTION_RULES[name](name, value)


def check_options(options: DemoOptions) -> DemoOptions:
    """Validate ``options`` and fill in the defaults; raise before anything is loaded.

    Each option passes :func:`check_option`; then the rules across options: at most one of
    ``budget`` and ``ratio``, and a budget the policy can keep.

    Raises:
        InvalidArgumentError: naming the option, its value and what was expected.
    """
    given = {
        name: check_option(name, getattr(options, name))
        for name in _OPTION_RULES
        if getattr(options, name) is not None or name not in _DEFAULTED
    }
    budget, ratio = given.get("budget"), given.get("ratio")
    if budget is not None and ratio is not None:
        raise InvalidArgumentError(
            f"budget={budget!r} and ratio={ratio!r} were both given; expected one of them"
        )
    policy = make_policy(given["policy"])
    if budget is not None and budget < policy.min_budget():
        raise InvalidArgumentError(
            f"budget={budget!r}; expected an integer >= {policy.min_budget()} (what "
            f"{policy!r} must keep, plus one)"
        )
    new_tokens = given.get("max_new_tokens")
    if new_tokens is None:
        new_tokens = QUICK_NEW_TOKENS if options.quick else DEFAULT_NEW_TOKENS
    return DemoOptions(
        model_path=given.get("model_path"),
        policy=given["policy"],
        budget=budget,
        ratio=(DEFAULT_RATIO if ratio is None else ratio) if budget is None else None,
        prompt_file=given.get("prompt_file"),
        max_new_tokens=new_tokens,
        block_size=given["block_size"],
        quick=options.quick,
    )


# ---------------------------------------------------------------------------------------------
# Inputs


def read_prompt(prompt_file: Path | None, *, quick: bool) -> tuple[str, str]:
    """(prompt text, where it came from). ``quick``: the document's start and its question."""
    if prompt_file is None:
        text = resources.files("kvstack").joinpath(DEFAULT_PROMPT).read_text(encoding="utf-8")
        source = f"built-in handbook (kvstack/{DEFAULT_PROMPT})"
    else:
        try:
            text = Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(
                f"prompt_file={str(prompt_file)!r} could not be read as UTF-8 text ({exc})"
            ) from exc
        source = str(prompt_file)
    text = text.strip()
    if not text:
        raise InvalidArgumentError(
            f"prompt_file={str(prompt_file)!r} is empty; expected a text to generate from"
        )
    if quick:
        # The question is the last paragraph; keep it, and the first few sentences before it.
        body, _, question = text.rpartition("\n\n")
        if len(body) > QUICK_BODY_CHARS:
            body = body[:QUICK_BODY_CHARS].rsplit(maxsplit=1)[0]
        text = f"{body}\n\n{question}" if body else question
        source += ", shortened (--quick)"
    return text, source


def load_model(model_path: Path | None) -> tuple[Any, Any, str]:
    """(model, tokenizer, name), float32, eval mode, sdpa attention (switched per cache)."""
    if model_path is None:
        from kvstack.models import load_smollm2

        # fresh: the demo switches the attention implementation, so it needs its own copy.
        model, tokenizer = load_smollm2(attn_implementation="sdpa", progress=True, fresh=True)
        return model, tokenizer, "SmolLM2-135M-Instruct"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise InvalidArgumentError(
            f"model_path={str(model_path)!r} could not be loaded as a causal LM with its "
            f"tokenizer ({type(exc).__name__}: {exc})"
        ) from exc
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer, Path(model_path).name


def _prompt_ids(tokenizer: Any, text: str) -> torch.Tensor:
    """[1, T] token ids: the text as a user turn if the tokenizer has a chat template."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return tokenizer(text, return_tensors="pt")["input_ids"]


# ---------------------------------------------------------------------------------------------
# Measuring


def _generate(model: Any, ids: torch.Tensor, cache: Any, attn: str, config: Any) -> torch.Tensor:
    import torch

    model.set_attn_implementation(attn)
    with warnings.catch_warnings():
        # transformers 5.24 renames generate's past_key_values to cache (5.17 has only the old
        # name); the old one works on both and warns on 5.24.
        warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
        with torch.inference_mode():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                past_key_values=cache,
                generation_config=config,
            )


def _dynamic_cache_kv(cache: Any) -> tuple[int, float]:
    """(bytes of the K/V tensors, stored tokens per attention layer) of a DynamicCache."""
    import torch

    tensors = [
        (layer.keys, layer.values)
        for layer in cache.layers
        if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4
    ]
    if not tensors:
        return 0, 0.0
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in tensors)
    return kv_bytes, sum(k.shape[-2] for k, _ in tensors) / len(tensors)


def _warmup_lengths(prompt_tokens: int) -> list[int]:
    return sorted({min(n, prompt_tokens) for n in WARMUP_PROMPT_TOKENS})


def _row(
    label: str, cache: Any, out: torch.Tensor, seconds: float, *, ids: Any, tokenizer: Any
) -> DemoRow:
    """What one cache generated and holds at the end."""
    new_ids = out[0, ids.shape[1] :].tolist()
    row = DemoRow(
        cache=label,
        token_ids=new_ids,
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        seconds=seconds,
        kv_bytes=0,
        live_tokens_per_layer=0.0,
    )
    if hasattr(cache, "stats"):
        stats = cache.stats()
        row.blocks = int(stats["blocks_allocated"])
        row.kv_bytes = int(stats["bytes_reserved"])  # the real bytes of its private arena
        row.live_tokens_per_layer = stats["live_tokens_per_layer"]  # one row: per sequence too
        row.repacks = int(stats["repacks"])
    else:
        row.kv_bytes, row.live_tokens_per_layer = _dynamic_cache_kv(cache)
    return row


def _measure(
    cases: list[tuple[str, Callable[[], Any], Callable[[int], Any], str]],
    *,
    model: Any,
    tokenizer: Any,
    ids: torch.Tensor,
    config: Any,
    say: Callable[[str], None],
) -> list[DemoRow]:
    """Warm every case up on short prefixes, then time one full generate of each.

    Both go through ``kvstack.bench.timing.time_interleaved`` (one round each, no extra
    warm-up round: the short prefixes are the warm-up), which also returns each timed call's
    cache and output.
    """
    from kvstack.bench.timing import time_interleaved

    warmup_config = copy.deepcopy(config)
    warmup_config.max_new_tokens = warmup_config.min_new_tokens = WARMUP_NEW_TOKENS

    def warm_up(make_warmup_cache: Callable[[int], Any], attn: str) -> Callable[[], None]:
        def run() -> None:
            for length in _warmup_lengths(ids.shape[1]):
                _generate(model, ids[:, :length], make_warmup_cache(length), attn, warmup_config)

        return run

    def generate(make_cache: Callable[[], Any], attn: str) -> Callable[[], tuple[Any, Any]]:
        def run() -> tuple[Any, Any]:
            cache = make_cache()
            return cache, _generate(model, ids, cache, attn, config)

        return run

    warmups = time_interleaved(
        {label: warm_up(warmup, attn) for label, _, warmup, attn in cases}, repeats=1, warmup=0
    )
    timed = time_interleaved(
        {label: generate(make, attn) for label, make, _, attn in cases}, repeats=1, warmup=0
    )
    rows = []
    for label, *_ in cases:
        seconds = timed.median(label)
        say(f"  {label}: warm-up {warmups.median(label):.1f} s, generate {seconds:.1f} s")
        cache, out = timed.results[label]
        rows.append(_row(label, cache, out, seconds, ids=ids, tokenizer=tokenizer))
    return rows


def run_demo(options: DemoOptions, say: Callable[[str], None] = print) -> list[DemoRow]:
    """Run the demo, printing progress and the report with ``say``; return the three rows."""
    import torch
    from transformers import DynamicCache

    # Importing kvstack.hf registers attn_implementation="kvstack".
    from kvstack.hf import PagedCache, TokenTableCache

    options = check_options(options)
    text, source = read_prompt(options.prompt_file, quick=options.quick)
    say(
        "Loading "
        + ("SmolLM2-135M-Instruct" if options.model_path is None else str(options.model_path))
        + " ..."
    )
    model, tokenizer, model_name = load_model(options.model_path)
    ids = _prompt_ids(tokenizer, text)
    prompt_tokens = ids.shape[1]
    new_tokens = options.max_new_tokens
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if limit is not None and prompt_tokens + new_tokens > limit:
        raise InvalidArgumentError(
            f"prompt_file={source!r} has {prompt_tokens} tokens; with max_new_tokens="
            f"{new_tokens} that exceeds the {limit} positions of {model_name}"
        )
    # Exactly new_tokens tokens: EOS is suppressed until then, so that every cache does the
    # same number of decode steps.
    config = greedy_generation_config(model, tokenizer, new_tokens, min_new_tokens=new_tokens)

    policy_name = type(make_policy(options.policy)).__name__
    share = f"budget {options.budget}" if options.budget is not None else f"ratio {options.ratio:g}"
    evicting_label = f"TokenTableCache ({policy_name}, {share})"

    def token_table_cache(**size: Any) -> Any:
        return TokenTableCache(
            model.config, make_policy(options.policy), block_size=options.block_size, **size
        )

    def token_table_warmup(prompt_tokens: int) -> Any:
        # Half the warm-up prompt (if the policy allows), so the warm-up evicts and repacks too.
        policy = make_policy(options.policy)
        return token_table_cache(budget=max(policy.min_budget(), prompt_tokens // 2))

    # The budget per token table, as the cache computes it from the prompt (ratio) or takes it.
    budget = token_table_cache(budget=options.budget, ratio=options.ratio).budget_for(prompt_tokens)

    def dynamic_cache() -> Any:
        return DynamicCache(config=model.config)

    def paged_cache() -> Any:
        return PagedCache(model.config, block_size=options.block_size)

    # (label, cache for the timed run, cache for a warm-up of n prompt tokens, attention)
    cases = [
        ("DynamicCache", dynamic_cache, lambda n: dynamic_cache(), "sdpa"),
        ("PagedCache", paged_cache, lambda n: paged_cache(), "kvstack"),
        (
            evicting_label,
            lambda: token_table_cache(budget=options.budget, ratio=options.ratio),
            token_table_warmup,
            "kvstack",
        ),
    ]
    attention_layers = len(PagedCache(model.config).paged_layers)
    threads = torch.get_num_threads()
    say(
        f"{model_name}: {attention_layers} attention layers, float32, {model.device.type}, "
        f"{threads} thread{'s' if threads != 1 else ''}\n"
        f"Prompt: {source}, {prompt_tokens} tokens. {new_tokens} new tokens per cache, greedy "
        f"(end-of-sequence suppressed so every cache does the same work).\n"
        f"TokenTableCache keeps {budget} tokens per token table ({policy_name}, {share}), "
        f"block size {options.block_size}.\n"
        "Running: warm-up generates of each cache on the first "
        f"{' and '.join(map(str, _warmup_lengths(prompt_tokens)))} prompt tokens, then one "
        "timed generate of each:"
    )
    rows = _measure(cases, model=model, tokenizer=tokenizer, ids=ids, config=config, say=say)
    say("")
    say(format_report(rows, prompt_tokens=prompt_tokens, attention_layers=attention_layers))
    return rows


# ---------------------------------------------------------------------------------------------
# Report


def _shorten(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= TEXT_CHARS else line[: TEXT_CHARS - 1].rstrip() + "…"


def _agreement(got: list[int], expected: list[int]) -> str:
    if got == expected:
        return f"identical tokens ({len(got)} of {len(expected)})"
    same = 0
    while same < min(len(got), len(expected)) and got[same] == expected[same]:
        same += 1
    return f"the first {same} of {len(expected)} new tokens agree"


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def format_report(rows: list[DemoRow], *, prompt_tokens: int, attention_layers: int) -> str:
    """The generated texts, the table and its footnotes."""
    baseline = rows[0]
    width = max(len(row.cache) for row in rows)
    lines = [f"Generated text (first {TEXT_CHARS} characters):"]
    for row in rows:
        lines.append(f"  {row.cache:<{width}}  {_shorten(row.text)!r}")
    for row in rows[1:]:
        lines.append(
            f"{row.cache} vs DynamicCache: {_agreement(row.token_ids, baseline.token_ids)}"
        )
    lines.append("")

    header = ["cache", "KV memory blocks", "KV MiB", "live tokens", "tokens/s", "repacks"]
    body = [
        [
            row.cache,
            "—" if row.blocks is None else str(row.blocks),
            f"{row.kv_bytes / 2**20:.2f}",
            _number(row.live_tokens_per_layer),
            f"{row.tokens_per_second:.2f}",
            "—" if row.repacks is None else str(row.repacks),
        ]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]

    def table_line(cells: list[str]) -> str:
        padded = [cells[0].ljust(widths[0])]
        padded += [cell.rjust(w) for cell, w in zip(cells[1:], widths[1:], strict=True)]
        return "| " + " | ".join(padded) + " |"

    lines.append(table_line(header))
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines.extend(table_line(cells) for cells in body)
    saved = 1 - rows[-1].kv_bytes / rows[1].kv_bytes if rows[1].kv_bytes else math.nan
    lines += [
        "",
        f"KV MiB: real bytes of the cache's K/V memory at the end: its private arena's tensor "
        f"(DynamicCache: its K/V tensors), in MiB; TokenTableCache holds {saved:.0%} less than "
        "PagedCache.",
        f"live tokens: K/V token rows kept per attention layer ({attention_layers} layers).",
        "KV memory blocks: over all layers. A per-head policy (H2O, Scissorhands, SnapKV) keeps "
        "one token table per KV head, so its blocks hold one KV head each.",
        f"tokens/s: new tokens / wall time of one generate call (the {prompt_tokens}-token "
        "prefill included), measured after two short warm-up generates with the same cache "
        "type, so torch.compile time is excluded. CPU timings on a possibly shared machine: "
        "compare the rows of one run.",
    ]
    return "\n".join(lines)
