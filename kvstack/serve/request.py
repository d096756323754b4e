"""A request's handle, its statistics, and how its next token is drawn.

A ``Request`` is what ``Engine.submit`` returns: the caller reads ``output_ids`` (the generated
token ids so far), ``done``, ``finish_reason`` and ``stats``; the engine keeps the rest (the
request's cache while it runs, how many of its tokens the cache holds).

Sampling is greedy unless a temperature is given. Token i of a sampled request is drawn with
a generator seeded from (seed, i), so neither batching nor preemption (which recomputes a
request and skips the draws of tokens it already has) changes its random stream; the logits it
draws from are the same up to the last bits of a batched forward. Requests that share a seed
share the stream: give each its own seed for independent draws.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.checks import check_positive_int


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature`` is 0; otherwise softmax(logits / temperature) restricted to
    the ``top_k`` likeliest tokens (0: all) and the smallest set whose probability reaches
    ``top_p``, drawn with ``seed``."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not (
            isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature < math.inf
        ):
            raise InvalidArgumentError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidArgumentError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not (
            isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0
        ):
            raise InvalidArgumentError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgumentError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def next_token(self, logits: torch.Tensor, index: int) -> int:
        """The ``index``-th generated token (0-based) from this position's ``logits`` [vocab]."""
        if self.greedy:
            return int(logits.argmax())
        scores = logits.float() / self.temperature
        if self.top_k:
            kth = torch.topk(scores, min(self.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep each token whose predecessors' mass is still below top_p (the first always).
            drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        generator = torch.Generator(device=probs.device).manual_seed(
            self.seed * 1_000_003 + index  # one stream per (seed, position): see the module doc
        )
        return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class RequestStats:
    """Per-request timings (seconds, from ``time.perf_counter``) and counts."""

    submitted_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens: int = 0  # generated tokens
    preemptions: int = 0
    peak_pages: int = 0  # the most arena KV blocks its cache held at the end of a step
    peak_bytes: int = 0  # the most arena bytes its cache held at once

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: submit to the first generated token."""
        if self.first_token_at is None:
            return None
        return self.first_token_at - self.submitted_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None until two tokens exist)."""
        if self.first_token_at is None or self.tokens < 2:
            return None
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return (end - self.first_token_at) / (self.tokens - 1)


@dataclass(eq=False)
class Request:
    """One submitted request (the handle ``Engine.submit`` returns)."""

    id: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampling: Sampling
    stats: RequestStats
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "stop" or "cancelled" once done
    # Engine state: the request's cache while it runs, and how many of its tokens (prompt, then
    # outputs) the cache holds; a preempted request drops its cache and starts again from 0.
    cache: Any = None
    computed: int = 0
    # Its pages while they sit in the engine's host swap tier (``kvstack.serve.swap``): it is
    # still running, with ``computed`` tokens, but holds no arena pages until swapped back in.
    swapped: Any = None
    admitted_at_step: int | None = None
    last_scheduled_step: int = -1
    # K/V the caller gave for the prompt's first tokens (``Engine.submit(prefix_kv=...)``): keys
    # and values [L, n, H_kv, D], keys rotated at positions 0..n-1. Written into the cache at
    # admission (again after a preemption) instead of computed.
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    # ``Engine.submit(keep_kv=True)``: when it finishes (stop or length), the K/V its cache
    # held, copied out before its pages are freed: keys and values [L, n, H_kv, D] for its
    # prompt and all outputs but the last (never fed back, so never computed). A conversation's
    # next turn passes them as ``prefix_kv`` (``kvstack.tiers.TurnStore`` keeps them between).
    keep_kv: bool = False
    kept_kv: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        state = self.finish_reason or (
            "running"
            if self.cache is not None
            else "swapped"
            if self.swapped is not None
            else "waiting"
        )
        return (
            f"Request(id={self.id}, prompt={len(self.prompt_ids)} tokens, "
            f"output={len(self.output_ids)}/{self.max_new_tokens}, {state})"
        )

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list[int]:
        """Every token the request's cache must hold in order: the prompt, then the outputs."""
        return self.prompt_ids + self.output_ids


def token_ids(name: str, value: Any) -> list[int]:
    """``value`` (a list of ints, or a [T] / [1, T] tensor) as a non-empty list of token ids."""
    if isinstance(value, torch.Tensor):
        if value.dim() == 2 and value.shape[0] == 1:
            value = value[0]
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise InvalidArgumentError(
                f"{name} must be a [T] or [1, T] integer tensor, got shape "
                f"{tuple(value.shape)} of {value.dtype}"
            )
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidArgumentError(f"{name} must be a non-empty list of token ids, got {value!r}")
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidArgumentError(
                f"{name} must hold non-negative integer token ids, got {token!r} at index {index}"
            )
    return list(value)


def stop_set(eos_token_id: int | Iterable[int] | None, stop_ids: Iterable[int] | None) -> frozenset:
    """The ids that end a request: the EOS id(s) and any extra stop ids."""
    ids: list[Any] = []
    for name, value in (("eos_token_id", eos_token_id), ("stop_ids", stop_ids)):
        if value is None:
            continue
        if isinstance(value, (int, str, bytes)) or not isinstance(value, Iterable):
            items = [value]  # one id; a str is not a sequence of ids
        else:
            items = list(value)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in items):
            raise InvalidArgumentError(f"{name} must be token ids (integers >= 0), got {value!r}")
        ids += items
    return frozenset(ids)


def check_max_new_tokens(value: Any) -> int:
    return check_positive_int("max_new_tokens", value)
