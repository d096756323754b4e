"""Which pages leave a tier first: LRU, attention-aware (KVDrive) and cost-aware (AsymCache).

A rule ranks the pages whose home is a full tier; the store demotes them in that order (to the
next tier down) until the bytes it needs are free. Rules only rank: they never move a page, so
a new rule cannot break the store's invariants.

* ``LRU``: the page used longest ago first.
* ``AttentionAware`` (KVDrive): the page with the lowest recent attention mass first (the
  store keeps, per page, an exponential average of the attention its tokens received); LRU
  breaks ties.
* ``CostAware`` (AsymCache): the page with the smallest expected cost of needing it again:
  reuse probability × the cheaper way to bring it back. Bringing it back costs either the
  transfer from the tier it goes to (bytes ÷ that tier's bandwidth) or recomputing its tokens,
  whose cost grows with their position (each token attends to every token before it: a page of
  ``n`` tokens starting at position ``p`` costs about ``n · (c_token + c_attend · (p + n/2))``).
  Reuse probability is the page's use frequency, (uses + 1) ÷ (reads since it was stored + 1),
  so a page read often is kept and a page read once long ago goes first; the + 1 counts a page
  not read yet as about to be (a layer reads the page it just stored in the same step: ranking
  it last-to-be-used would drop what is needed next).

  Dropping (``demote_to=None``, lossless recompute) in a store that holds one sequence's pages
  (``TieredCache``): a dropped page is recomputed with every other dropped page in one span, from
  the first dropped position to the last, in every layer at once. So ``CostAware.rank_drops``
  prices a page by what it adds to that span: nothing if the span covers it already (the same
  block of another layer), else the tokens by which it extends the span. Rules without
  ``rank_drops`` rank drops with ``rank``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstack.errors import InvalidArgumentError

TIERS = ("device", "host", "disk")  # fastest first; a demoted page goes one tier down


@dataclass
class PageInfo:
    """What the store knows about a page, as the rules see it."""

    key: str
    nbytes: int
    home: str  # one of TIERS
    copies: set[str] = field(default_factory=set)  # tiers holding a copy besides the home
    position: int = 0  # the first token's position in its sequence
    tokens: int = 0  # tokens the page holds (0: not a KV page, recompute impossible)
    stored_at: int = 0  # store clock when it was put
    last_used: int = 0
    uses: int = 0
    attention: float = 0.0  # exponential average of the attention mass its tokens received


class EvictionRule(Protocol):
    def rank(self, pages: Sequence[PageInfo], now: int, demote_to: str | None) -> list[PageInfo]:
        """``pages`` (homed on the full tier) in the order they should leave it, the first
        first. ``demote_to`` is the tier they would go to (None: the last tier; they would be
        dropped and recomputed)."""


class LRU:
    def rank(self, pages, now, demote_to):
        return sorted(pages, key=lambda p: (p.last_used, p.key))


class AttentionAware:
    uses_attention = True  # TieredCache must see the attention: the "kvstack_tiers" attention

    def rank(self, pages, now, demote_to):
        return sorted(pages, key=lambda p: (p.attention, p.last_used, p.key))


@dataclass
class CostAware:
    """AsymCache's rule. Bandwidths in bytes per second of reading a page back from the tier it
    would go to; recompute constants in seconds (per token, and per token per earlier token).
    The defaults are estimates for a small model on a CPU, not measured here: pass a machine's
    own where they matter."""

    bandwidth: dict[str, float] = field(default_factory=lambda: {"host": 10e9, "disk": 1e9})
    seconds_per_token: float = 2e-4
    seconds_per_token_per_context: float = 2e-8

    def __post_init__(self) -> None:
        """Refuse parameters that would rank by nonsense: a NaN cost compares false with
        everything (``sorted`` would then keep an arbitrary order), a negative one ranks the
        dearest page first, and a missing bandwidth fails only at the first demotion there."""
        demoted_to = TIERS[1:]  # the tiers a page can be demoted to, each priced by a bandwidth
        if not isinstance(self.bandwidth, dict) or set(self.bandwidth) != set(demoted_to):
            raise InvalidArgumentError(
                f"bandwidth={self.bandwidth!r}; expected a dict with exactly the keys "
                f"{list(demoted_to)} (bytes per second of reading a page back from each)"
            )
        for tier, value in self.bandwidth.items():
            if not _real(value) or not math.isfinite(value) or value <= 0:
                raise InvalidArgumentError(
                    f"bandwidth[{tier!r}]={value!r}; expected a finite number of bytes per "
                    "second > 0"
                )
        for name in ("seconds_per_token", "seconds_per_token_per_context"):
            value = getattr(self, name)
            if not _real(value) or not math.isfinite(value) or value < 0:
                raise InvalidArgumentError(
                    f"{name}={value!r}; expected a finite number of seconds >= 0"
                )
        # A copy: a later change to the caller's dict cannot slip past these checks.
        self.bandwidth = dict(self.bandwidth)

    def restore_seconds(self, page: PageInfo, demote_to: str | None) -> float:
        """The cheaper of transferring the page back and recomputing its tokens."""
        recompute = (
            page.tokens
            * (
                self.seconds_per_token
                + self.seconds_per_token_per_context * (page.position + page.tokens / 2)
            )
            if page.tokens
            else float("inf")
        )
        if demote_to is None:
            return recompute
        return min(recompute, page.nbytes / self.bandwidth[demote_to])

    @staticmethod
    def reuse_probability(page: PageInfo, now: int) -> float:
        return min(1.0, (page.uses + 1) / (now - page.stored_at + 1))

    def rank(self, pages, now, demote_to):
        return sorted(
            pages,
            key=lambda p: (
                self.reuse_probability(p, now) * self.restore_seconds(p, demote_to),
                p.last_used,
                p.key,
            ),
        )

    def recompute_seconds(self, start: int, end: int) -> float:
        """Recomputing the tokens at positions ``start`` .. ``end - 1``."""
        tokens = end - start
        midpoint = start + tokens / 2
        return tokens * (self.seconds_per_token + self.seconds_per_token_per_context * midpoint)

    def rank_drops(
        self, pages: Sequence[PageInfo], now: int, dropped: Sequence[PageInfo]
    ) -> list[PageInfo]:
        """``pages`` (KV pages of one sequence) in the order they should be dropped, given the
        pages already ``dropped``: by reuse probability × the recompute they add to the span
        of dropped positions (none inside it); the earliest position breaks ties."""
        if dropped:
            low = min(p.position for p in dropped)
            high = max(p.position + p.tokens for p in dropped)

        def added_seconds(page: PageInfo) -> float:
            start, end = page.position, page.position + page.tokens
            if not dropped:
                return self.recompute_seconds(start, end)
            # The span grows to cover the page: what it then costs beyond what it costs now.
            grown = self.recompute_seconds(min(start, low), max(end, high))
            return grown - self.recompute_seconds(low, high)

        return sorted(
            pages,
            key=lambda p: (
                self.reuse_probability(p, now) * added_seconds(p),
                p.position,
                p.key,
            ),
        )


def _real(value: object) -> bool:
    """Whether ``value`` is an int or float (a bool is neither here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


RULES = {"lru": LRU, "attention": AttentionAware, "cost": CostAware}
