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
above the engine's ``max_batch_tokens``; until the steps seen vary enough to fit the three parts
(``line`` is None) the whole ``max_batch_tokens`` is allowed.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.checks import check_positive_int

# Steps the costs are fitted to: recent enough to follow the machine's load, enough to average
# out the noise of one step.
HISTORY = 64


class StepTimeModel:
    """Seconds of a step as ``fixed + per_decode * decodes + per_prefill * prefill_tokens``,
    fitted to the last ``history`` steps."""

    def __init__(self, history: int = HISTORY) -> None:
        self.history = check_positive_int("history", history)
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=history)

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
        """(fixed seconds, seconds per decode row, seconds per prefill token), or None while the
        steps seen cannot separate them (fewer than three, or the design matrix below full
        rank). The per-token costs are kept positive and the fixed part non-negative."""
        if len(self._steps) < 3:
            return None
        rows = torch.tensor(
            [[1.0, float(d), float(p)] for d, p, _ in self._steps], dtype=torch.float64
        )  # [steps, 3]: intercept, decode rows, prefill tokens
        seconds = torch.tensor([s for _, _, s in self._steps], dtype=torch.float64)[:, None]
        if int(torch.linalg.matrix_rank(rows)) < 3:
            return None
        fixed, per_decode, per_prefill = torch.linalg.lstsq(rows, seconds).solution[:, 0].tolist()
        return max(0.0, fixed), max(per_decode, 1e-9), max(per_prefill, 1e-9)

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


def check_step_time_target(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1e9:
        raise InvalidArgumentError(
            f"step_time_target must be seconds in (0, 1e9) or None, got {value!r}"
        )
    return float(value)


__all__ = ["HISTORY", "StepTimeModel", "check_step_time_target"]
