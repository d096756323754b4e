"""What runs in a step: the work each running request could do, and the rule that orders it.

Every step, each running request offers one piece of ``Work``: a prefill chunk (its prompt, or
after a preemption the tokens it must recompute) or one decode token. A ``BatchRule`` orders
the offers and the engine takes them in that order while the step's token budget lasts.

The rule is pluggable because what "cheap" means depends on where pages live. Work whose
pages were swapped to the host (``Engine(swap_bytes=...)``) is ``resident=False`` and says how
many bytes taking it would fetch (``fetch_bytes``); taking it may push a newer request out.

* ``PageAwareRule``, the default, minimises the bytes fetched per generated token: resident
  work first (it fetches nothing), then the non-resident work that fetches the fewest bytes.
  Among equals, the request that has waited longest since it last ran goes first, so a waiting
  prefill ages until it is first. Its fairness bound: a request that has not run for more than
  ``max_wait`` steps goes before every request that has, wherever its pages are. When the
  engine must swap a request out to make room, it picks the one holding the fewest bytes
  (``choose_victim``): what goes out comes back in, so the smallest sufficient moves are the
  cheapest.
* ``FIFORule``: the oldest request first, wherever its pages are (vLLM's default priority);
  the engine's default victim, the newest request.
* ``RoundRobinRule``: the request that ran least recently first, wherever its pages are;
  the newest request is the victim.

The last two are the baselines the tiers benchmark compares the page-aware rule with
(``tiers.scheduler_bytes_ratio``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstack.reference.checks import check_positive_int
from kvstack.serve.request import Request


@dataclass
class Work:
    """One request's offer for this step: feed ``tokens`` of its tokens from ``request.computed``.
    ``flexible`` work (a lossless prefill) may be cut to fewer tokens to fit the budget."""

    request: Request
    tokens: int
    kind: str  # "prefill" or "decode"
    flexible: bool = False
    resident: bool = True  # every page the work reads is in the arena
    fetch_bytes: int = 0  # bytes copied back to the arena before the work can run


class BatchRule(Protocol):
    """Orders each step's offers. A rule may also define ``choose_victim(candidates) ->
    Request``: which resident request an engine with a swap tier moves out to make room (else
    the newest; without a swap tier always the newest, which loses the least recomputed work)."""

    def order(self, work: Sequence[Work], step: int) -> list[Work]:
        """``work`` in the order the engine should take it at ``step``."""


# Steps a request may go without running before the page-aware rule takes it first, wherever
# its pages are: long enough that a swapped request usually comes back when a finished one frees
# room (fetching nothing extra), short enough that none waits unboundedly behind new work.
DEFAULT_MAX_WAIT = 128


class PageAwareRule:
    """Fewest bytes fetched first: resident work, then non-resident work by ``fetch_bytes``;
    the request that has not run for longest first among equals (FIFO on ties). A request that
    has not run for more than ``max_wait`` steps goes before all that have."""

    def __init__(self, max_wait: int = DEFAULT_MAX_WAIT) -> None:
        self.max_wait = check_positive_int("max_wait", max_wait)

    def __repr__(self) -> str:
        return f"PageAwareRule(max_wait={self.max_wait})"

    def order(self, work: Sequence[Work], step: int) -> list[Work]:
        def key(w: Work) -> tuple:
            # Waiting since it last ran, or since it was admitted if it never has.
            since = max(w.request.last_scheduled_step, w.request.admitted_at_step or 0)
            overdue = step - since > self.max_wait
            fetch = 0 if overdue else w.fetch_bytes
            return (not overdue, fetch, w.request.last_scheduled_step, w.request.id)

        return sorted(work, key=key)

    def choose_victim(self, candidates: Sequence[Request]) -> Request:
        """The request holding the fewest arena bytes (the newest on ties): one that has not
        started holds none and only goes back to the queue."""
        return min(candidates, key=lambda request: (_held_bytes(request), -request.id))


def _held_bytes(request: Request) -> int:
    return 0 if request.cache is None else int(request.cache.stats()["bytes_used"])


class FIFORule:
    """The oldest request first (by submission), wherever its pages are."""

    def __repr__(self) -> str:
        return "FIFORule()"

    def order(self, work: Sequence[Work], step: int) -> list[Work]:
        return sorted(work, key=lambda w: w.request.id)


class RoundRobinRule:
    """The request that ran least recently first (FIFO on ties), wherever its pages are."""

    def __repr__(self) -> str:
        return "RoundRobinRule()"

    def order(self, work: Sequence[Work], step: int) -> list[Work]:
        return sorted(work, key=lambda w: (w.request.last_scheduled_step, w.request.id))


def fill_batch(ordered: Sequence[Work], max_batch_tokens: int) -> list[Work]:
    """Take ``ordered`` work while ``max_batch_tokens`` lasts. Flexible work is cut to what is
    left; the first piece is always taken (a prompt larger than the budget then runs alone); a
    piece that does not fit ends the batch, so nothing overtakes it."""
    batch: list[Work] = []
    left = max_batch_tokens
    for work in ordered:
        if work.tokens > left and work.flexible and left > 0:
            work.tokens = left
        if work.tokens > left and batch:
            break
        batch.append(work)
        left -= work.tokens
        if left <= 0:
            break
    return batch
