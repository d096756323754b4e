"""Tangram's head groups, from a calibrated head profile (kvstack.calibrate.HeadProfile).

Ragged pages: a layer's KV heads are sorted by budget and chunked into groups of
``heads_per_group``; each group gets one page table, sized by the largest budget in it, so a
group reserves ``len(group) * max(budget)`` of a full head's KV per head slot. Sorting first puts
heads of similar budget together, which keeps that reservation close to the sum of the budgets;
grouping adjacent heads (by index) is the baseline that shows why.

Load balancing: per layer, tau = (sum of budgets) / workers, and each group gets max(1,
round(group budget / tau)) KV splits (``plan_ahead_of_time``): a static work list, computed once
and reused at every step and batch size, since budgets are fractions of a sequence.
``plan_per_step``, the baseline, splits the exact work of the batch at hand at every step.
``run_in_launch_order`` gives each worker's load when the splits run the way a GPU hands out
thread blocks, and ``imbalance`` is max / mean of those loads.

Everything here is plain Python over the profile's numbers (budgets given as a tensor are read
as numbers first): it runs once, before serving, and its output is data for the ragged
attention.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
    budgets = budget_rows(budgets)
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


def budget_rows(budgets: Any) -> list[list[float]]:
    """``budgets`` [layer][kv head] (nested sequences or a 2-D tensor) as lists of floats,
    checked to be fractions in (0, 1]: a group's budget is then a number, not a 0-d tensor."""
    if isinstance(budgets, torch.Tensor):
        if budgets.dim() != 2:
            raise InvalidArgumentError(
                f"budgets has shape {tuple(budgets.shape)}; expected [layers, kv heads]"
            )
        budgets = budgets.tolist()
    try:
        rows = [[float(budget) for budget in row] for row in budgets]
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"budgets={budgets!r}; expected rows (one per layer) of numbers (one per KV head)"
        ) from None
    check_budgets(rows)
    return rows


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
    """What the groups' tables would reserve beyond the sum of the budgets, as a fraction of
    that sum: a count from the budgets alone (no block rounding, no tensors). The real bytes are
    the arena's, once ragged pages hold these groups."""
    needed = sum(sum(row) for row in budget_rows(budgets))
    reserved = sum(group.reserved for layer in groups for group in layer)
    return reserved / needed - 1.0


# --------------------------------------------------------------------------- load balancing
@dataclass(frozen=True)
class Split:
    """One KV split of one head group: part ``part`` of ``parts`` equal parts of its table, the
    key range ``[start, end)`` as fractions of the table (``keys`` gives the whole keys it reads
    of one sequence, cut the way the ragged attention cuts them)."""

    layer: int
    group: int  # index into the layer's groups
    part: int
    parts: int

    @property
    def start(self) -> float:
        return self.part / self.parts

    @property
    def end(self) -> float:
        return (self.part + 1) / self.parts

    def keys(self, groups: Sequence[Sequence[HeadGroup]], length: int, block_size: int = 1) -> int:
        """Whole keys this split reads of a sequence of ``length`` tokens, over all its
        group's heads. The group's table holds ``ceil(budget * length)`` keys per head, in whole
        blocks of ``block_size`` (the per-step planner counts a table the same way), and the
        split reads ``[part * n // parts, (part + 1) * n // parts)`` of those n, as
        ``kvstack.reference.ragged`` cuts them: so the splits of one sequence are not all equal,
        and a short table leaves some of them empty."""
        group = groups[self.layer][self.group]
        held = math.ceil(group.budget * length / block_size) * block_size
        start, end = self.part * held // self.parts, (self.part + 1) * held // self.parts
        return len(group.heads) * (end - start)


def plan_ahead_of_time(groups: Sequence[Sequence[HeadGroup]], workers: int) -> list[list[Split]]:
    """Tangram's static work list, per layer: tau = (the layer's reservation) / ``workers``, and
    a group reserving G gets max(1, round(G / tau)) equal splits, so every split reads about
    tau of a sequence. Budgets are fractions of a sequence, so the list serves every length and
    batch size unchanged. (tau is the issue's sum of budgets / workers with each group counted
    at its reservation: sorted groups reserve within a few percent of their budgets.)"""
    if not (isinstance(workers, int) and workers >= 1):
        raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
    plan = []
    for layer_groups in groups:
        tau = sum(group.reserved for group in layer_groups) / workers
        splits = []
        for index, group in enumerate(layer_groups):
            count = max(1, round(group.reserved / tau))
            splits += [Split(group.layer, index, part, count) for part in range(count)]
        plan.append(splits)
    return plan


def work_list(splits: Sequence[Split]) -> list[tuple[int, int, int]]:
    """One layer's splits as the rows ``(group, part, parts)`` that the ragged decode attention
    runs (``kvstack.reference.ragged``: ``torch.tensor(work_list(plan[layer]))``)."""
    return [(split.group, split.part, split.parts) for split in splits]


def run_in_launch_order(works: Sequence[float], workers: int) -> list[float]:
    """Each worker's load when ``works`` are launched in order and each goes to the worker that
    frees first (how a GPU hands thread blocks to its multiprocessors)."""
    if not (isinstance(workers, int) and workers >= 1):
        raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
    loads = [(0.0, worker) for worker in range(workers)]  # (busy until, worker): a min-heap
    for work in works:
        load, worker = heapq.heappop(loads)
        heapq.heappush(loads, (load + work, worker))
    return [load for load, _ in sorted(loads, key=lambda pair: pair[1])]


def plan_per_step(
    groups: Sequence[HeadGroup], lengths: Sequence[int], workers: int, block_size: int = 1
) -> list[float]:
    """The baseline: at every step, split the exact work of the batch at hand, FlashInfer's
    way. Each (sequence, group) reads ``len(heads) * ceil(budget * length / block) * block``
    keys; the chunk size is the smallest multiple of ``block_size`` that cuts all of them into
    at most ``workers`` pieces (one wave). Returns the pieces' works, longest first."""
    if not (isinstance(workers, int) and workers >= 1):
        raise InvalidArgumentError(f"workers must be an int >= 1, got {workers!r}")
    if not (isinstance(block_size, int) and block_size >= 1):
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    if not groups:
        raise InvalidArgumentError("groups is empty; expected one layer's head groups")
    if not lengths or not all(isinstance(n, int) and n >= 1 for n in lengths):
        raise InvalidArgumentError(
            f"lengths={list(lengths)!r}; expected at least one sequence length, each an int >= 1"
        )
    keys = [
        math.ceil(group.budget * length / block_size) * block_size
        for length in lengths
        for group in groups
    ]
    heads = [len(group.heads) for _ in lengths for group in groups]
    if len(keys) > workers:  # more tables than workers: one piece each
        chunk = max(keys)
    else:
        low, high = 1, max(1, math.ceil(max(keys) / block_size))  # in blocks
        while low < high:  # the fewest blocks per chunk that fit one wave
            middle = (low + high) // 2
            if sum(math.ceil(k / (middle * block_size)) for k in keys) <= workers:
                high = middle
            else:
                low = middle + 1
        chunk = low * block_size
    pieces = []
    for table_keys, table_heads in zip(keys, heads, strict=True):
        full, rest = divmod(table_keys, chunk)
        pieces += [float(table_heads * chunk)] * full + (
            [float(table_heads * rest)] if rest else []
        )
    return sorted(pieces, reverse=True)


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of the workers' loads (1 is perfect balance)."""
    if not loads or sum(loads) <= 0:
        raise InvalidArgumentError(f"loads must hold a positive total, got {list(loads)!r}")
    return max(loads) * len(loads) / sum(loads)
