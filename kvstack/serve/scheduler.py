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
  ``max_wait`` steps goes before every request that has, wherever its pages are. (Under an
  engine's ``step_time_target`` or ``tpot_target`` the engine puts every decode token first and
  may hold prefill work back, so the bound then holds among decodes only.) It looks
  ahead (``Outlook``: each request's length is bounded by its ``max_new_tokens``), so that
  what it moves stays moved:

  - a swapped request comes back (``may_swap_in``) only when it and the resident requests can
    all grow until the first of them finishes; one brought back sooner would be swapped out
    again before any room frees, and its bytes would move twice;
  - when the engine must swap a request out to make room (``choose_victim``), it picks, of
    those whose leaving lets the rest grow until the first of them finishes, the one holding
    the fewest bytes: what goes out comes back in, so the smallest sufficient move is the
    cheapest. If no one request is enough, the one holding the most goes (the fewest moves).
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


@dataclass(frozen=True)
class Outlook:
    """The arena over the coming steps, as an engine with a swap tier sees it: its capacity in
    pages of ``block_size`` tokens, the step's prefill chunk, and the ``resident`` requests
    (those whose pages are in the arena).

    A running request's future is bounded by what it has been given: it still feeds the
    tokens it knows but has not computed (its prompt, or after a preemption its prompt and
    outputs), a chunk a step, and then one token a step until ``max_new_tokens``; its last
    output is never fed. Counted as if it ran every step, that gives the fewest steps until it
    finishes and the most pages it holds meanwhile. A stop token may end it sooner and a full
    step budget may slow it: the outlook is a forecast for the rule, not a reservation."""

    capacity_pages: int
    block_size: int
    prefill_chunk: int
    resident: tuple[Request, ...]

    @staticmethod
    def known_tokens(request: Request) -> int:
        """Tokens ``request`` knows but has not computed: fed in chunks before its next output."""
        return len(request.prompt_ids) + len(request.output_ids) - request.computed

    def steps_to_finish(self, request: Request) -> int:
        """The fewest steps until ``request`` makes its last token (and frees its pages)."""
        known = self.known_tokens(request)
        outputs_left = request.max_new_tokens - len(request.output_ids)
        # The known tokens take ceil(known / chunk) steps and end with one output; each later
        # step feeds the previous output and makes the next.
        return -(-known // self.prefill_chunk) + max(0, outputs_left - 1)

    def pages_after(self, request: Request, steps: int) -> int:
        """The most pages ``request`` holds after ``steps`` more steps."""
        known = self.known_tokens(request)
        chunk_steps = -(-known // self.prefill_chunk)
        if steps <= chunk_steps:
            fed = min(known, steps * self.prefill_chunk)
        else:
            fed = known + steps - chunk_steps
        final = len(request.prompt_ids) + request.max_new_tokens - 1
        tokens = min(request.computed + fed, final)
        return -(-tokens // self.block_size)

    def fits_until_a_finish(self, requests: Sequence[Request]) -> bool:
        """Whether ``requests`` can all run every step until the first of them finishes (its
        pages then free), in the arena's pages."""
        if not requests:
            return True
        horizon = min(self.steps_to_finish(request) for request in requests)
        pages = sum(self.pages_after(request, horizon) for request in requests)
        return pages <= self.capacity_pages


class BatchRule(Protocol):
    """Orders each step's offers. With a swap tier an engine also asks a rule that defines them:

    * ``choose_victim(candidates, outlook) -> Request``: which resident request to move out to
      make room (else the newest; without a swap tier always the newest, which loses the least
      recomputed work);
    * ``may_swap_in(work, outlook, step) -> bool``: whether a swapped request's work may come
      back this step (else it may whenever its pages fit). Work it holds back waits, unless
      nothing else could run."""

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
            overdue = self._overdue(w, step)
            fetch = 0 if overdue else w.fetch_bytes
            return (not overdue, fetch, w.request.last_scheduled_step, w.request.id)

        return sorted(work, key=key)

    def may_swap_in(self, work: Work, outlook: Outlook, step: int) -> bool:
        """Bring a swapped request back only if it and the resident requests can all grow
        until the first of them finishes, or once it is overdue (``max_wait``)."""
        if self._overdue(work, step):
            return True
        return outlook.fits_until_a_finish([*outlook.resident, work.request])

    def choose_victim(self, candidates: Sequence[Request], outlook: Outlook) -> Request:
        """Of the candidates whose leaving lets the other resident requests grow until the
        first of them finishes, the one holding the fewest arena bytes (the newest on ties):
        one that has not started holds none and only goes back to the queue. If none is
        enough alone, the one holding the most (the newest on ties)."""

        def enough(victim: Request) -> bool:
            rest = [request for request in outlook.resident if request is not victim]
            return outlook.fits_until_a_finish(rest)

        sufficient = [request for request in candidates if enough(request)]
        if sufficient:
            return min(sufficient, key=lambda request: (_held_bytes(request), -request.id))
        return max(candidates, key=lambda request: (_held_bytes(request), request.id))

    def _overdue(self, work: Work, step: int) -> bool:
        # Waiting since it last ran, or since it was admitted if it never has.
        since = max(work.request.last_scheduled_step, work.request.admitted_at_step or 0)
        return step - since > self.max_wait


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
