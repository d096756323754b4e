"""What runs in a step: the work each running request could do, and the rule that orders it.

Every step, each running request offers one piece of ``Work``: a prefill chunk (its prompt, or
after a preemption the tokens it must recompute) or one decode token. A ``BatchRule`` orders
the offers and the engine takes them in that order while the step's token budget lasts.

The rule is pluggable because what "cheap" means depends on where pages live. With one tier
every page is resident; the tiers issue marks work whose pages sit on host or disk
(``Work.resident`` False) and can weigh the transfer. ``PageAwareRule``, the default, takes
resident work first and, among it, the request that has waited longest since it last ran, so
no request starves: a waiting prefill ages until it is first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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


class BatchRule(Protocol):
    def order(self, work: Sequence[Work], step: int) -> list[Work]:
        """``work`` in the order the engine should take it at ``step``."""


class PageAwareRule:
    """Resident work first; then the request that has not run for longest (FIFO on ties)."""

    def order(self, work: Sequence[Work], step: int) -> list[Work]:
        return sorted(
            work, key=lambda w: (not w.resident, w.request.last_scheduled_step, w.request.id)
        )


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
