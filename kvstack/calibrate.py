"""Offline calibration of per-KV-head budgets (Tangram), and the profile file it writes.

Tangram observes that which heads need many tokens hardly depends on the input, and that each
head's share varies within narrow bounds; so per-head budgets can be measured once, on a few
dozen pilot samples, and fixed before serving. For each pilot sample:

1. One forward pass with eager attention. For each layer, SnapKV's score of every key that is
   not in the observation window: the attention it gets from the last ``window`` queries, summed
   over those queries and over the query heads that read its KV head, then max-pooled over
   ``kernel_size`` neighbours: the paper's score, once, from the sample's last ``window``
   queries. (kvstack.policies.SnapKV scores this way too, but its window hops through the query
   stream as decoding goes on, so at the end of a prompt it reads ``window`` to
   ``2 * window - 1`` queries.)
2. AdaKV's allocation of the layer's budget, ``ratio`` x (candidate keys) x (KV heads): every
   head first keeps its own ``floor`` share of an even split (its highest-scoring keys); the rest
   goes to the highest scores across the layer's heads. A head's share is the fraction of its
   candidate keys it keeps, so the shares of a layer average ``ratio``.

Over the samples, head h's budget is B_h = min(1, mu_h + alpha * sigma_h) (mean and standard
deviation of its shares): a head keeps what it needed on most inputs, not on average. The profile
also records how stable the head ranking is: for each sample, Spearman's correlation between its
shares and the mean shares of the other samples.

    profile = calibrate(model, pilot_samples(tokenizer, 50), ratio=0.25)
    profile.save("profile.json")
    profile = HeadProfile.load("profile.json", config=model.config)  # checks it fits the model
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvstack.errors import InvalidArgumentError, KVStackError

PROFILE_FORMAT = "kvstack.head_profile"
PROFILE_VERSION = 1
DEFAULT_ALPHA = 2.0
DEFAULT_WINDOW = 32  # kvstack.policies.SnapKV's defaults
DEFAULT_KERNEL_SIZE = 7
DEFAULT_FLOOR = 0.2  # AdaKV's safeguard: each head keeps at least this part of an even split
DEFAULT_SAMPLE_TOKENS = 1024


class ProfileError(KVStackError, ValueError):
    """A head profile file is unreadable, malformed, or made for another model."""


# --------------------------------------------------------------------------- the profile
def model_identity(config: Any) -> dict[str, Any]:
    """What a profile records of the model it was made for: its attention geometry (which a
    profile must match) and a hash of its whole config (which tells two checkpoints apart only
    when their configs differ)."""
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else "{}"
    # A composite config (a vision-language model's, say) keeps the decoder's geometry in its
    # text config; the hash still covers the whole config.
    decoder = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    num_heads = decoder.num_attention_heads
    return {
        "model_type": getattr(config, "model_type", None),
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "num_hidden_layers": decoder.num_hidden_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(decoder, "num_key_value_heads", None) or num_heads,
        "head_dim": getattr(decoder, "head_dim", None) or decoder.hidden_size // num_heads,
        "config_sha256": hashlib.sha256(text.encode()).hexdigest(),
    }


@dataclass(frozen=True)
class HeadProfile:
    """Per-layer, per-KV-head budgets: the fraction of a sequence's tokens each head keeps."""

    budgets: tuple[tuple[float, ...], ...]  # [layer][kv head], each in (0, 1]
    mean: tuple[tuple[float, ...], ...]  # mu per head over the samples
    std: tuple[tuple[float, ...], ...]  # sigma per head over the samples
    ratio: float  # the ratio the samples were allocated at
    alpha: float
    model: dict[str, Any]  # model_identity() of the calibrated model
    calibration: dict[str, Any]  # samples, tokens, window, kernel_size, floor, stability

    def __post_init__(self) -> None:
        check_budgets(self.budgets)
        shape = (len(self.budgets), len(self.budgets[0]))
        for name in ("mean", "std"):
            table = getattr(self, name)
            if len(table) != shape[0] or any(len(row) != shape[1] for row in table):
                raise InvalidArgumentError(
                    f"{name} has {[len(row) for row in table]} heads per layer; expected "
                    f"{shape[0]} layers of {shape[1]} like budgets"
                )
        if not (isinstance(self.ratio, float) and 0.0 < self.ratio <= 1.0):
            raise InvalidArgumentError(f"ratio={self.ratio!r}; expected a fraction in (0, 1]")
        if not (isinstance(self.alpha, float) and math.isfinite(self.alpha) and self.alpha >= 0):
            raise InvalidArgumentError(f"alpha={self.alpha!r}; expected a finite number >= 0")
        if not isinstance(self.calibration, dict):
            raise InvalidArgumentError(
                f"calibration={self.calibration!r}; expected a dict of how it was made"
            )
        # The model's geometry is what check_model compares: it must be there and agree with
        # the budgets' own shape, or a profile could pass the check and not fit.
        if not isinstance(self.model, dict):
            raise InvalidArgumentError(f"model={self.model!r}; expected model_identity()'s dict")
        geometry = {
            "num_hidden_layers": shape[0],
            "num_key_value_heads": shape[1],
            "head_dim": None,
        }
        for key, expected in geometry.items():
            value = self.model.get(key)
            if not (isinstance(value, int) and value >= 1):
                raise InvalidArgumentError(f"model[{key!r}]={value!r}; expected an int >= 1")
            if expected is not None and value != expected:
                raise InvalidArgumentError(
                    f"model[{key!r}]={value}; expected {expected}, the budgets' shape"
                )

    @property
    def num_layers(self) -> int:
        return len(self.budgets)

    @property
    def num_kv_heads(self) -> int:
        return len(self.budgets[0])

    @property
    def mean_budget(self) -> float:
        """The mean of every head's budget: the fraction of a prompt the whole cache keeps."""
        budgets = [budget for row in self.budgets for budget in row]
        return sum(budgets) / len(budgets)

    def check_model(self, config: Any) -> None:
        """Raise ProfileError unless ``config`` has this profile's layers, KV heads and head
        size."""
        theirs = model_identity(config)
        for key in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
            if theirs[key] != self.model[key]:
                raise ProfileError(
                    f"profile was made for a model with {key}={self.model[key]} "
                    f"({self.model.get('name_or_path') or self.model.get('model_type')}), but "
                    f"this model has {key}={theirs[key]}; calibrate this model "
                    "(kvstack calibrate --model-path ...)"
                )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model": self.model,
            "ratio": self.ratio,
            "alpha": self.alpha,
            "budgets": [list(layer) for layer in self.budgets],
            "mean": [list(layer) for layer in self.mean],
            "std": [list(layer) for layer in self.std],
            "calibration": self.calibration,
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON; atomically (a temporary file renamed over ``path``), so a
        failed write leaves an existing file as it was."""
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        try:
            temporary.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)  # a failed write leaves no half file beside it
            raise

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> HeadProfile:
        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ProfileError(
                f"{where} is not a kvstack head profile (no format {PROFILE_FORMAT!r})"
            )
        if data.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"{where} has version {data.get('version')!r}; this kvstack reads version "
                f"{PROFILE_VERSION}"
            )
        missing = [
            key
            for key in ("model", "ratio", "alpha", "budgets", "mean", "std", "calibration")
            if key not in data
        ]
        if missing:
            raise ProfileError(f"{where} lacks {missing}")
        for key in ("ratio", "alpha"):
            if isinstance(data[key], bool) or not isinstance(data[key], (int, float)):
                raise ProfileError(f"{where}: {key}={data[key]!r}; expected a number")
        try:
            return cls(
                budgets=_table(data["budgets"], "budgets", where),
                mean=_table(data["mean"], "mean", where),
                std=_table(data["std"], "std", where),
                ratio=float(data["ratio"]),
                alpha=float(data["alpha"]),
                model=data["model"],
                calibration=data["calibration"],
            )
        except InvalidArgumentError as error:
            raise ProfileError(f"{where}: {error}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str], config: Any | None = None) -> HeadProfile:
        """Read a profile; with ``config``, also check that it was made for that model."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as error:
            raise ProfileError(f"profile {str(path)!r} cannot be read: {error}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ProfileError(
                f"profile {str(path)!r} is not valid JSON (truncated or corrupt?): {error}"
            ) from None
        profile = cls.from_json(data, where=f"profile {str(path)!r}")
        if config is not None:
            profile.check_model(config)
        return profile


def _table(value: Any, name: str, where: str) -> tuple[tuple[float, ...], ...]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(row, list) and row for row in value)
    ):
        raise ProfileError(f"{where}: {name} must be a non-empty list of non-empty lists per layer")
    if len({len(row) for row in value}) != 1:
        raise ProfileError(f"{where}: {name} has layers with different head counts")
    try:
        return tuple(tuple(float(x) for x in row) for row in value)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: {name} holds a value that is not a number") from None


def check_budgets(budgets: Sequence[Sequence[float]]) -> None:
    """Raise InvalidArgumentError unless every budget is a fraction in (0, 1]."""
    if not budgets or not all(len(row) for row in budgets):
        raise InvalidArgumentError("budgets must hold at least one layer of at least one head")
    for layer, row in enumerate(budgets):
        for head, budget in enumerate(row):
            if not (math.isfinite(budget) and 0.0 < budget <= 1.0):
                raise InvalidArgumentError(
                    f"budgets[{layer}][{head}] = {budget!r}; expected a fraction in (0, 1]"
                )


# --------------------------------------------------------------------------- the algorithm
def snapkv_scores(
    weights: torch.Tensor, num_kv_heads: int, window: int, kernel_size: int
) -> torch.Tensor:
    """SnapKV's scores [H_kv, N - window] of the keys before the observation window, from one
    layer's attention weights [H_q, N, N] (one sequence)."""
    num_heads, n, _ = weights.shape
    group = num_heads // num_kv_heads
    votes = weights[:, n - window :, : n - window].float()  # [H_q, window, N - window]
    votes = votes.reshape(num_kv_heads, group * window, n - window).sum(dim=1)  # [H_kv, N - w]
    pooled = F.max_pool1d(votes.unsqueeze(1), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.squeeze(1)  # [H_kv, N - window]


def adakv_shares(scores: torch.Tensor, ratio: float, floor: float) -> torch.Tensor:
    """AdaKV's allocation of one layer's budget over its heads: the fraction [H_kv] of its
    candidate keys each head keeps, given their scores [H_kv, n].

    The layer keeps round(ratio * n * H_kv) keys. Each head first takes its
    ``floor(floor * ratio * n)`` best keys; the remaining budget goes to the best of all the
    other keys, across heads."""
    num_heads, n = scores.shape
    total = round(ratio * n * num_heads)
    per_head_floor = min(n, math.floor(floor * ratio * n))
    ranked = scores.sort(dim=1, descending=True).values  # [H_kv, n]
    counts = torch.full((num_heads,), per_head_floor, dtype=torch.long, device=scores.device)
    rest = total - per_head_floor * num_heads
    if rest > 0:
        candidates = ranked[:, per_head_floor:]  # [H_kv, n - floor]: keys not yet kept
        owner = torch.arange(num_heads, device=scores.device).unsqueeze(1).expand_as(candidates)
        best = candidates.flatten().topk(rest).indices
        counts += torch.bincount(owner.flatten()[best], minlength=num_heads)
    return counts.float() / n


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two 1-D tensors (ties get their mean rank)."""

    def ranks(x: torch.Tensor) -> torch.Tensor:
        x = x.double()
        order = x.argsort()
        rank = torch.empty_like(x)
        rank[order] = torch.arange(len(x), dtype=torch.double)
        for value in x.unique():  # mean rank over ties
            tied = x == value
            if tied.sum() > 1:
                rank[tied] = rank[tied].mean()
        return rank

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def head_budgets(
    shares: torch.Tensor, alpha: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(budgets, mean, std) [L, H_kv] from shares [S, L, H_kv]: B = min(1, mu + alpha * sigma),
    never below the smallest share observed (so never 0)."""
    mean = shares.mean(dim=0)
    std = shares.std(dim=0, unbiased=True)
    budgets = (mean + alpha * std).clamp(max=1.0)
    budgets = torch.maximum(budgets, shares.amin(dim=0).clamp(min=1e-6))
    return budgets, mean, std


def check_calibration_args(
    num_samples: int,
    ratio: float,
    alpha: float,
    window: int,
    kernel_size: int,
    floor: float,
    sample_tokens: int | None = None,
) -> None:
    """Raise InvalidArgumentError for arguments ``calibrate`` cannot use (before any work)."""
    if num_samples < 2:
        raise InvalidArgumentError(
            f"samples must hold at least 2 sequences (a standard deviation needs two), got "
            f"{num_samples}"
        )
    if not (isinstance(ratio, (int, float)) and 0.0 < ratio <= 1.0):
        raise InvalidArgumentError(f"ratio must be a fraction in (0, 1], got {ratio!r}")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha >= 0):
        raise InvalidArgumentError(f"alpha must be a finite number >= 0, got {alpha!r}")
    if not (isinstance(window, int) and window >= 1):
        raise InvalidArgumentError(f"window must be an int >= 1, got {window!r}")
    if not (isinstance(kernel_size, int) and kernel_size >= 1 and kernel_size % 2 == 1):
        raise InvalidArgumentError(f"kernel_size must be a positive odd int, got {kernel_size!r}")
    if not (isinstance(floor, (int, float)) and 0.0 <= floor <= 1.0):
        raise InvalidArgumentError(f"floor must be a fraction in [0, 1], got {floor!r}")
    if sample_tokens is not None and not (
        isinstance(sample_tokens, int) and sample_tokens > window + kernel_size
    ):
        raise InvalidArgumentError(
            f"sample_tokens must be an int > window + kernel_size = {window + kernel_size} (keys "
            f"outside the observation window to score), got {sample_tokens!r}"
        )


def _attention_modules(model: Any) -> list[Any]:
    """The model's attention modules in layer order (modules with a ``layer_idx`` named
    ``*self_attn``, as in transformers' Llama-family models)."""
    found = [
        module
        for name, module in model.named_modules()
        if name.endswith("self_attn") and hasattr(module, "layer_idx")
    ]
    return sorted(found, key=lambda module: module.layer_idx)


@torch.no_grad()
def sample_shares(
    model: Any,
    input_ids: torch.Tensor,
    ratio: float,
    *,
    window: int = DEFAULT_WINDOW,
    kernel_size: int = DEFAULT_KERNEL_SIZE,
    floor: float = DEFAULT_FLOOR,
) -> torch.Tensor:
    """Each KV head's share [L, H_kv] of one sample ``input_ids`` [1, N] (steps 1-2 above)."""
    config = model.config
    identity = model_identity(config)
    num_kv_heads = identity["num_key_value_heads"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InvalidArgumentError(
            f"input_ids must be one sequence [1, N], got shape {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] <= window + kernel_size:
        raise InvalidArgumentError(
            f"a sample of {input_ids.shape[1]} tokens leaves no keys outside the observation "
            f"window of {window}; expected more than window + kernel_size = "
            f"{window + kernel_size} tokens"
        )
    modules = _attention_modules(model)
    if len(modules) != identity["num_hidden_layers"]:
        raise InvalidArgumentError(
            f"found {len(modules)} attention modules (named *self_attn with a layer_idx) in a "
            f"model with {identity['num_hidden_layers']} layers; calibration supports models "
            "whose every layer is attention"
        )
    shares: list[torch.Tensor | None] = [None] * len(modules)

    def hook(module: Any, args: Any, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise KVStackError(
                f"{type(module).__name__} returned no attention weights under eager attention"
            )
        scores = snapkv_scores(weights[0], num_kv_heads, window, kernel_size)
        shares[module.layer_idx] = adakv_shares(scores, ratio, floor)

    previous = model.config._attn_implementation
    handles = [module.register_forward_hook(hook) for module in modules]
    try:
        model.set_attn_implementation("eager")
        # Pilot samples are built on the CPU; the pass runs where the model's weights are.
        model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.set_attn_implementation(previous)
    return torch.stack([s for s in shares if s is not None]).cpu()  # [L, H_kv]: few numbers


def calibrate(
    model: Any,
    samples: Sequence[torch.Tensor],
    ratio: float,
    *,
    alpha: float = DEFAULT_ALPHA,
    window: int = DEFAULT_WINDOW,
    kernel_size: int = DEFAULT_KERNEL_SIZE,
    floor: float = DEFAULT_FLOOR,
    progress: Callable[[int, int], None] | None = None,
) -> HeadProfile:
    """The head profile of ``model`` from pilot ``samples`` (each [1, N] token ids)."""
    check_calibration_args(len(samples), ratio, alpha, window, kernel_size, floor)
    per_sample = []
    for index, ids in enumerate(samples):
        per_sample.append(
            sample_shares(model, ids, ratio, window=window, kernel_size=kernel_size, floor=floor)
        )
        if progress is not None:
            progress(index + 1, len(samples))
    shares = torch.stack(per_sample)  # [S, L, H_kv]
    budgets, mean, std = head_budgets(shares, alpha)
    flat = shares.flatten(1)  # [S, L * H_kv]
    stability = [
        spearman(flat[s], torch.cat([flat[:s], flat[s + 1 :]]).mean(dim=0))
        for s in range(len(flat))
    ]
    return HeadProfile(
        budgets=_rows(budgets),
        mean=_rows(mean),
        std=_rows(std),
        ratio=float(ratio),
        alpha=float(alpha),
        model=model_identity(model.config),
        calibration={
            "method": "AdaKV allocation over SnapKV scores",
            "samples": len(samples),
            "sample_tokens": [int(ids.shape[1]) for ids in samples],
            "window": window,
            "kernel_size": kernel_size,
            "floor": floor,
            "spearman_vs_others": stability,
            "spearman_mean": sum(stability) / len(stability),
            "spearman_min": min(stability),
            "mean_budget": float(budgets.mean()),
        },
    )


def _rows(table: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(x) for x in row) for row in table.tolist())


# --------------------------------------------------------------------------- pilot text
def pilot_samples(
    tokenizer: Any,
    count: int,
    tokens: int = DEFAULT_SAMPLE_TOKENS,
    *,
    texts: Sequence[str] | None = None,
    seed: int = 0,
) -> list[torch.Tensor]:
    """``count`` pilot samples [1, tokens] of token ids: paragraphs of ``texts`` (default: the
    passages that ship with kvstack's benchmarks) shuffled anew for each sample and joined
    until the sample is ``tokens`` long. Deterministic for a seed."""
    if not (isinstance(count, int) and count >= 1):
        raise InvalidArgumentError(f"count must be an int >= 1, got {count!r}")
    if not (isinstance(tokens, int) and tokens >= 2):
        raise InvalidArgumentError(f"tokens must be an int >= 2, got {tokens!r}")
    if texts is None:
        from kvstack.bench.prompts import DATA_DIR

        texts = [path.read_text(encoding="utf-8") for path in sorted(DATA_DIR.glob("*.txt"))]
    paragraphs = [p.strip() for text in texts for p in text.split("\n\n") if p.strip()]
    if not paragraphs:
        raise InvalidArgumentError("texts hold no paragraphs to build pilot samples from")
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in paragraphs]
    available = sum(len(ids) for ids in encoded) + len(encoded)
    if available < tokens:
        raise InvalidArgumentError(
            f"tokens={tokens}, but the pilot texts hold only {available} tokens"
        )
    separator = tokenizer("\n\n", add_special_tokens=False)["input_ids"]
    generator = random.Random(seed)
    samples = []
    for _ in range(count):
        order = list(range(len(encoded)))
        generator.shuffle(order)
        ids: list[int] = []
        for index in order:
            ids += encoded[index] + separator
            if len(ids) >= tokens:
                break
        samples.append(torch.tensor([ids[:tokens]], dtype=torch.long))
    return samples
