"""Adaptive chunking (AsymCache): the step's prefill sized to keep its time near a target.

A step's forward pass costs a fixed part (reading the weights, a kernel launch per layer and
op), a part per decode row and a part per prefill token. The two per-token parts differ: a
decode row is a matrix-vector product against every weight, while prefill tokens share them in
a matrix-matrix product, and on a CPU a decode row can cost as much as ten prefill tokens. With
a fixed ``max_batch_tokens`` a step that takes a large prefill or recompute chunk runs long,
and every request decoding in that step waits for it: its time per output token jumps.

``StepTimeModel`` learns the three parts from the steps the engine ran (least squares over the
recent (decode rows, prefill tokens, seconds) triples) and gives the most prefill tokens a step
of a given number of decodes can take within the target. ``Engine(step_time_target=...)`` then
takes every decode token first and prefill and recompute work after it, in the rule's order,
cut to that many tokens (lossless prefill is cut at any token; an evicting cache's chunks stay
whole, because where a chunk ends decides what it keeps).

The prefill budget never goes below ``min_prefill`` (prefill must progress) and the step never
above the engine's ``max_batch_tokens``; until the steps seen first vary enough to fit the three
parts (``costs`` is None) the whole ``max_batch_tokens`` is allowed. Afterwards a run of steps
that cannot separate them (decode-only steps, say, while prefill is held back) keeps the last fit.

A TPOT target (``Engine(tpot_target=...)``) bounds what serving SLAs bound: each request's time
per output token, the mean over its life (``RequestStats.tpot_s``). A step target must be met by
every step, which a compute-bound prefill chunk alone can break; a request's mean instead
banks what its fast decode steps leave under the target (``tpot_slack``) and spends it on the
steps that carry someone's prefill. So a prefill piece joins a step only when the step, at its
fitted cost, keeps every request decoding in it within the target at its next token; else the
prefill waits, and the decodes run alone. Decodes are not held back for it, and each ends, so no
prefill waits forever. (Sarathi-Serve instead sizes every step's token budget to the SLO.) The
slack counts the forward pass's fitted time; the step's sampling and bookkeeping come on top,
and the slack each request banks afterwards is measured on the clock, so they are paid back.
A preempted request's recompute waits like any prefill, while its own time per token runs on.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.checks import check_positive_int
from kvstack.serve.request import RequestStats

# Steps the costs are fitted to: recent enough to follow the machine's load, enough to average
# out the noise of one step.
HISTORY = 64


class StepTimeModel:
    """Seconds of a step as ``fixed + per_decode * decodes + per_prefill * prefill_tokens``,
    fitted to the last ``history`` steps."""

    def __init__(self, history: int = HISTORY) -> None:
        self.history = check_positive_int("history", history)
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=history)
        self._last_fit: tuple[float, float, float] | None = None

    def __repr__(self) -> str:
        costs = self.costs()
        fitted = (
            "unfitted"
            if costs is None
            else f"{costs[0]:.3g} s + {costs[1]:.3g} s/decode + {costs[2]:.3g} s/prefill token"
        )
        return f"StepTimeModel({fitted}, {len(self._steps)} steps)"

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        """A step of ``decodes`` decode rows and ``prefill_tokens`` prefill tokens took
        ``seconds``."""
        if decodes < 0 or prefill_tokens < 0 or decodes + prefill_tokens == 0:
            raise InvalidArgumentError(
                f"a step needs decodes >= 0 and prefill_tokens >= 0, not both 0, got {decodes} "
                f"and {prefill_tokens}"
            )
        if not (seconds >= 0.0 and math.isfinite(seconds)):
            raise InvalidArgumentError(f"seconds must be finite and >= 0, got {seconds}")
        self._steps.append((decodes, prefill_tokens, seconds))

    def costs(self) -> tuple[float, float, float] | None:
        """(fixed seconds, seconds per decode row, seconds per prefill token) fitted to the last
        ``history`` steps. When those cannot separate them (fewer than three, or the design
        matrix below full rank: a run of decode-only steps), the last fit that could; None
        before any. The per-token costs are kept positive and the fixed part non-negative."""
        if len(self._steps) < 3:
            return self._last_fit
        rows = torch.tensor(
            [[1.0, float(d), float(p)] for d, p, _ in self._steps], dtype=torch.float64
        )  # [steps, 3]: intercept, decode rows, prefill tokens
        seconds = torch.tensor([s for _, _, s in self._steps], dtype=torch.float64)[:, None]
        if int(torch.linalg.matrix_rank(rows)) < 3:
            return self._last_fit
        fixed, per_decode, per_prefill = torch.linalg.lstsq(rows, seconds).solution[:, 0].tolist()
        self._last_fit = (max(0.0, fixed), max(per_decode, 1e-9), max(per_prefill, 1e-9))
        return self._last_fit

    def prefill_budget(
        self, target_seconds: float, decodes: int, min_prefill: int, max_tokens: int
    ) -> int:
        """The most prefill tokens a step with ``decodes`` decode rows can add and stay within
        ``target_seconds``: at least ``min_prefill``, and at most what ``max_tokens`` leaves."""
        room = max(0, max_tokens - decodes)
        costs = self.costs()
        if costs is None:
            return room
        fixed, per_decode, per_prefill = costs
        tokens = math.floor((target_seconds - fixed - per_decode * decodes) / per_prefill)
        return min(room, max(min_prefill, tokens))


def tpot_slack(target: float, decoding: Iterable[RequestStats], now: float) -> float | None:
    """The most seconds the next step may take so that no request of ``decoding`` (the stats of
    the requests that decode in it) has spent more than ``target`` seconds per output token after
    its first (``RequestStats.tpot_s``) once the step gives it its next token: the least over
    them of ``target * tokens - (now - first_token_at)``. Negative when one is already over;
    None when none decodes (or none has a first token yet)."""
    slack = [
        target * stats.tokens - (now - stats.first_token_at)
        for stats in decoding
        if stats.first_token_at is not None and stats.tokens >= 1
    ]
    return min(slack, default=None)


def check_seconds(name: str, value: float | None) -> float | None:
    """``value`` as seconds in (0, 1e9), or None; else an error naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1e9:
        raise InvalidArgumentError(f"{name} must be seconds in (0, 1e9) or None, got {value!r}")
    return float(value)


__all__ = ["HISTORY", "StepTimeModel", "check_seconds", "tpot_slack"]
