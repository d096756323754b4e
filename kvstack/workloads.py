"""Request-length distributions that ship with kvstack, and seeded request traces drawn from them.

``load_length_distribution("sharegpt")`` reads ``kvstack/data/sharegpt_lengths.json``: ShareGPT-
like prompt and output lengths in tokens. What is published and what is assumed:

* the means are ShareGPT's as the vLLM paper reports them (Kwon et al., SOSP 2023, Sec. 6.1 and
  Fig. 11a): 161.31 prompt tokens and 337.99 output tokens per request;
* the support is vLLM's ShareGPT benchmark filter (``benchmarks/benchmark_serving.py``,
  ``sample_sharegpt_requests``): both lengths >= 4, prompt <= 1024, prompt + output <= 2048;
* the shape is an assumption: independent log-normals (sigma 1.0 for prompts, 0.8 for outputs,
  in log space), their mu fitted so that the filtered means equal the published ones. The raw
  dataset could not be downloaded where this was written, so this is a parametric stand-in with
  the published means and bounds, not the empirical distribution.

``LengthDistribution.sample(n, seed=..., max_context=...)`` draws ``n`` (prompt, output) pairs
by rejection (the filter above), then scales both lengths by ``max_context / 2048`` (rounding
down, at least 1 token) so that prompt + output <= ``max_context``. ``draw_trace`` adds arrival
steps (all at step 0, or a Poisson process of a given rate per decode step) and returns
``TraceRequest`` objects, which ``kvstack.reference.arena_layouts`` and the serving engine read.

Everything is drawn with ``random.Random`` seeded explicitly, so a seed gives the same trace on
every machine with the same Python version (``random`` guarantees its ``random()`` sequence
across versions, not the algorithms of ``lognormvariate`` and ``expovariate`` built on it).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstack.errors import InvalidArgumentError

DATA_DIR = Path(__file__).resolve().parent / "data"
DISTRIBUTIONS = {"sharegpt": "sharegpt_lengths.json"}


@dataclass(frozen=True)
class LengthDistribution:
    """Prompt and output lengths (tokens): log-normal(mu, sigma) each, rejected unless
    ``min_tokens <= prompt <= max_prompt_tokens``, ``output >= min_tokens`` and
    ``prompt + output <= max_total_tokens``."""

    name: str
    description: str
    source: dict[str, str]
    prompt_mu: float
    prompt_sigma: float
    output_mu: float
    output_sigma: float
    min_tokens: int
    max_prompt_tokens: int
    max_total_tokens: int
    published_prompt_mean: float
    published_output_mean: float

    def sample(self, n: int, *, seed: int, max_context: int | None = None) -> list[tuple[int, int]]:
        """``n`` (prompt_tokens, output_tokens) pairs; with ``max_context``, both scaled by
        ``max_context / max_total_tokens`` (floored, at least 1), so their sum fits it."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"n must be a non-negative integer, got {n!r}")
        _check_seed(seed)
        if max_context is not None and (
            isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2
        ):
            raise InvalidArgumentError(
                f"max_context must be an integer >= 2 (a prompt and an output token), got "
                f"{max_context!r}"
            )
        rng = random.Random(seed)
        pairs = []
        while len(pairs) < n:
            prompt = round(rng.lognormvariate(self.prompt_mu, self.prompt_sigma))
            output = round(rng.lognormvariate(self.output_mu, self.output_sigma))
            if (
                prompt < self.min_tokens
                or output < self.min_tokens
                or prompt > self.max_prompt_tokens
                or prompt + output > self.max_total_tokens
            ):
                continue
            pairs.append((prompt, output))
        if max_context is None:
            return pairs
        # Floors keep prompt + output <= max_context: floor(a s) + floor(b s) <= floor((a+b) s).
        scale = max_context / self.max_total_tokens
        return [(max(1, math.floor(p * scale)), max(1, math.floor(o * scale))) for p, o in pairs]


def load_length_distribution(name: str = "sharegpt") -> LengthDistribution:
    """The shipped length distribution called ``name`` (see the module doc)."""
    if name not in DISTRIBUTIONS:
        raise InvalidArgumentError(f"name must be one of {sorted(DISTRIBUTIONS)}, got {name!r}")
    data: dict[str, Any] = json.loads((DATA_DIR / DISTRIBUTIONS[name]).read_text())
    return LengthDistribution(
        name=data["name"],
        description=data["description"],
        source=dict(data["source"]),
        prompt_mu=float(data["prompt"]["mu"]),
        prompt_sigma=float(data["prompt"]["sigma"]),
        output_mu=float(data["output"]["mu"]),
        output_sigma=float(data["output"]["sigma"]),
        min_tokens=int(data["filter"]["min_tokens"]),
        max_prompt_tokens=int(data["filter"]["max_prompt_tokens"]),
        max_total_tokens=int(data["filter"]["max_total_tokens"]),
        published_prompt_mean=float(data["prompt"]["published_mean"]),
        published_output_mean=float(data["output"]["published_mean"]),
    )


@dataclass(frozen=True, eq=False)  # eq=False: two requests of equal lengths are two requests
class TraceRequest:
    """One request of a trace: it arrives before decode step ``arrival_step``."""

    request_id: int
    arrival_step: int
    prompt_tokens: int
    output_tokens: int


def draw_trace(
    n: int,
    *,
    seed: int,
    max_context: int | None = None,
    arrival_rate: float | None = None,
    distribution: str = "sharegpt",
) -> list[TraceRequest]:
    """``n`` requests with lengths from ``distribution`` (``LengthDistribution.sample``) and
    arrival steps: all 0 when ``arrival_rate`` is None, else a Poisson process of
    ``arrival_rate`` requests per decode step (exponential gaps, floored to steps). Lengths and
    arrivals use separate seeded streams, so the rate does not change the lengths."""
    if arrival_rate is not None and (
        isinstance(arrival_rate, bool)
        or not isinstance(arrival_rate, (int, float))
        or not arrival_rate > 0
        or not math.isfinite(arrival_rate)
    ):
        raise InvalidArgumentError(
            f"arrival_rate must be a positive number of requests per step or None, got "
            f"{arrival_rate!r}"
        )
    lengths = load_length_distribution(distribution).sample(n, seed=seed, max_context=max_context)
    arrivals = [0] * n
    if arrival_rate is not None:
        rng, clock = random.Random(f"{seed}/arrivals"), 0.0
        for index in range(n):
            clock += rng.expovariate(arrival_rate)
            arrivals[index] = math.floor(clock)
    return [
        TraceRequest(index, arrival, prompt, output)
        for index, ((prompt, output), arrival) in enumerate(zip(lengths, arrivals, strict=True))
    ]


def _check_seed(seed: object) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidArgumentError(f"seed must be an int, got {seed!r}")
