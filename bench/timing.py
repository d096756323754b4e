"""The one timing helper for whole-program measurements (``generate``, a demo run).

Microbenchmarks (one op call) use pytest-benchmark (``bench/test_core.py``); anything that runs
a model end to end uses ``time_interleaved``:

* ``warmup`` untimed rounds first (torch.compile, allocator and cache warm-up);
* then ``repeats`` rounds, each calling every function once, with the order rotated from round
  to round, so a burst of load from other processes on a shared machine hits every function
  alike instead of biasing whichever ran then;
* each call is bracketed by ``torch.cuda.synchronize()`` when CUDA is initialised, so queued
  GPU work is inside the call that queued it;
* the figure is the median over repeats.

The last return value of each function is kept, so callers can check outputs (equal tokens,
finite values) of exactly what was timed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from kvstack.errors import InvalidArgumentError


@dataclass
class Timings:
    """Seconds per call of each function, in the order the rounds ran, and its last result."""

    seconds: dict[str, list[float]] = field(default_factory=dict)
    results: dict[str, object] = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_interleaved(
    fns: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    *,
    on_round: Callable[[int | None], None] | None = None,
) -> Timings:
    """Time every function of ``fns`` ``repeats`` times, interleaved (see the module doc).

    ``on_round(i)`` (untimed) runs before round ``i``, and ``on_round(None)`` before each
    warm-up round: a workload that changes from round to round (the next prompt) sets it there,
    and ``seconds[name][i]`` is then the time of round ``i``.
    """
    if not fns:
        raise InvalidArgumentError("fns must name at least one function, got none")
    if not isinstance(repeats, int) or repeats < 1:
        raise InvalidArgumentError(f"repeats must be an int >= 1, got {repeats!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise InvalidArgumentError(f"warmup must be an int >= 0, got {warmup!r}")
    names = list(fns)
    timings = Timings(seconds={name: [] for name in names})
    for _ in range(warmup):
        if on_round is not None:
            on_round(None)
        for name in names:
            timings.results[name] = fns[name]()
    for round_index in range(repeats):
        if on_round is not None:
            on_round(round_index)
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # who goes first rotates
            _synchronize()
            start = time.perf_counter()
            timings.results[name] = fns[name]()
            _synchronize()
            timings.seconds[name].append(time.perf_counter() - start)
    return timings
