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
    (``"adjacent"``), chunked into groups of ``heads_per_group``. When the heads do not split
    evenly, one group is short: last for adjacent heads; for sorted heads, wherever it makes the
    layer reserve least (the first of those places on a tie)."""
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
        sizes = _group_sizes(len(heads), heads_per_group)
        if order == "sorted":
            sizes = min(_placements(sizes), key=lambda layout: _reserved(row, heads, layout))
        ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
        starts = [0, *ends[:-1]]
        groups = []
        for start, end in zip(starts, ends, strict=True):
            members = tuple(heads[start:end])
            groups.append(HeadGroup(layer, members, max(row[head] for head in members)))
        layers.append(groups)
    return layers


def _group_sizes(num_heads: int, heads_per_group: int) -> list[int]:
    """Full groups, then the short one (if the heads do not split evenly)."""
    full, short = divmod(num_heads, heads_per_group)
    return [heads_per_group] * full + ([short] if short else [])


def _placements(sizes: list[int]) -> list[list[int]]:
    """Every order of the group sizes that moves the short group (the last) to another place.
    Which place is best depends on the budgets: a group reserves len x its largest budget."""
    if len(sizes) < 2 or sizes[-1] == sizes[0]:
        return [sizes]
    full, short = sizes[:-1], sizes[-1]
    return [full[:place] + [short] + full[place:] for place in range(len(sizes))]


def _reserved(row: Sequence[float], heads: Sequence[int], sizes: Sequence[int]) -> float:
    """What chunking ``heads`` (in this order) by ``sizes`` reserves."""
    total, start = 0.0, 0
    for size in sizes:
        total += size * max(row[head] for head in heads[start : start + size])
        start += size
    return total


def overallocation(
    budgets: Sequence[Sequence[float]], groups: Sequence[Sequence[HeadGroup]]
) -> float:
    """What the groups reserve beyond the sum of the budgets, as a fraction of that sum."""
    needed = sum(sum(row) for row in budgets)
    reserved = sum(group.reserved for layer in groups for group in layer)
    return reserved / needed - 1.0
