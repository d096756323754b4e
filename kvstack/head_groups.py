"""Tangram's head groups, from a calibrated head profile (kvstack.calibrate.HeadProfile).

Ragged pages: a layer's KV heads are sorted by budget and chunked into groups of
``heads_per_group``; each group gets one page table, sized by the largest budget in it, so a
group reserves ``len(group) * max(budget)`` of a full head's KV per head slot. Sorting first puts
heads of similar budget together, which keeps that reservation close to the sum of the budgets;
grouping adjacent heads (by index) is the baseline that shows why.

The ahead-of-time work partition (per layer, tau = sum of budgets / workers, and max(1,
round(group budget / tau)) KV splits per group) comes with the ragged attention that runs it.

Everything here is plain Python over the profile's numbers (no tensors): it runs once, before
serving, and its output is data for the ragged attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstack.calibrate import check_budgets
from kvstack.errors import InvalidArgumentError

ORDERS = ("sorted", "adjacent")


@dataclass(frozen=True)
class HeadGroup:
    """KV heads of one layer that share a page table."""

    layer: int
    heads: tuple[int, ...]  # KV head indices, highest budget first when sorted
    budget: float  # the largest budget among them: what the group's table is sized for

    @property
    def reserved(self) -> float:
        """Fraction of one full head's KV, times heads: what the group's pages hold."""
        return len(self.heads) * self.budget


def group_heads(
    budgets: Sequence[Sequence[float]], heads_per_group: int, order: str = "sorted"
) -> list[list[HeadGroup]]:
    """Each layer's head groups: heads sorted by budget (highest first) or by index
    (``"adjacent"``), chunked into groups of ``heads_per_group`` (the last may be smaller)."""
    check_budgets(budgets)
    if not (isinstance(heads_per_group, int) and heads_per_group >= 1):
        raise InvalidArgumentError(f"heads_per_group must be an int >= 1, got {heads_per_group!r}")
    if order not in ORDERS:
        raise InvalidArgumentError(f"order must be one of {ORDERS}, got {order!r}")
    layers = []
    for layer, row in enumerate(budgets):
        heads = list(range(len(row)))
        if order == "sorted":
            heads.sort(key=lambda head: (-row[head], head))  # ties by index: deterministic
        groups = []
        for start in range(0, len(heads), heads_per_group):
            members = tuple(heads[start : start + heads_per_group])
            groups.append(HeadGroup(layer, members, max(row[head] for head in members)))
        layers.append(groups)
    return layers


def overallocation(
    budgets: Sequence[Sequence[float]], groups: Sequence[Sequence[HeadGroup]]
) -> float:
    """What the groups reserve beyond the sum of the budgets, as a fraction of that sum."""
    needed = sum(sum(row) for row in budgets)
    reserved = sum(group.reserved for layer in groups for group in layer)
    return reserved / needed - 1.0
