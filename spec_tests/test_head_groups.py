"""Tangram's head groups and work lists: properties over random budgets, known cases, bad
input."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstack import head_groups as hg
from kvstack.errors import InvalidArgumentError

budget = st.floats(0.01, 1.0, allow_nan=False)
profiles = st.integers(1, 8).flatmap(
    lambda heads: st.lists(st.lists(budget, min_size=heads, max_size=heads), min_size=1, max_size=4)
)


@given(budgets=profiles, heads_per_group=st.integers(1, 5), order=st.sampled_from(hg.ORDERS))
def test_groups_partition_each_layers_heads(budgets, heads_per_group, order):
    groups = hg.group_heads(budgets, heads_per_group, order)
    for layer, (row, layer_groups) in enumerate(zip(budgets, groups, strict=True)):
        members = [head for group in layer_groups for head in group.heads]
        assert sorted(members) == list(range(len(row)))
        for group in layer_groups:
            assert group.layer == layer
            assert 1 <= len(group.heads) <= heads_per_group
            assert group.budget == max(row[head] for head in group.heads)
        if order == "sorted":
            assert [g.budget for g in layer_groups] == sorted(
                (g.budget for g in layer_groups), reverse=True
            )


@given(budgets=profiles, heads_per_group=st.integers(1, 5))
def test_sorting_never_reserves_more_than_adjacent_groups(budgets, heads_per_group):
    sorted_over = hg.overallocation(budgets, hg.group_heads(budgets, heads_per_group, "sorted"))
    adjacent_over = hg.overallocation(budgets, hg.group_heads(budgets, heads_per_group, "adjacent"))
    assert -1e-12 <= sorted_over <= adjacent_over + 1e-12
    assert hg.overallocation(budgets, hg.group_heads(budgets, 1)) == pytest.approx(0.0, abs=1e-12)


@given(
    row=st.lists(st.sampled_from([0.1, 0.25, 0.5, 0.75, 1.0]), min_size=1, max_size=6),
    heads_per_group=st.integers(1, 4),
)
def test_sorted_groups_reserve_the_least_of_any_grouping_into_those_sizes(row, heads_per_group):
    """Brute force over every order of the heads, chunked into the same group sizes in every
    arrangement: none reserves less than the sorted groups."""
    import itertools

    groups = hg.group_heads([row], heads_per_group)[0]
    best = sum(group.reserved for group in groups)
    sizes = [len(group.heads) for group in groups]
    for order in itertools.permutations(range(len(row))):
        for layout in set(itertools.permutations(sizes)):
            start, total = 0, 0.0
            for size in layout:
                total += size * max(row[head] for head in order[start : start + size])
                start += size
            assert best <= total + 1e-12


def test_overallocation_of_a_known_layer():
    budgets = [[0.9, 0.1, 0.8, 0.2]]
    # sorted: {0.9, 0.8} and {0.2, 0.1} reserve 2*0.9 + 2*0.2 = 2.2 for 2.0 needed
    assert hg.overallocation(budgets, hg.group_heads(budgets, 2)) == pytest.approx(0.1)
    # adjacent: {0.9, 0.1} and {0.8, 0.2} reserve 1.8 + 1.6 = 3.4
    assert hg.overallocation(budgets, hg.group_heads(budgets, 2, "adjacent")) == pytest.approx(0.7)
    # Three heads in groups of two: where the short group goes depends on the budgets.
    for row in ([0.5, 0.5, 1.0], [0.5, 1.0, 1.0]):
        assert hg.overallocation([row], hg.group_heads([row], 2)) == pytest.approx(0.0)


@given(budgets=profiles, heads_per_group=st.integers(1, 4), workers=st.integers(1, 160))
def test_the_ahead_of_time_list_tiles_every_group_in_about_tau_sized_splits(
    budgets, heads_per_group, workers
):
    groups = hg.group_heads(budgets, heads_per_group)
    plan = hg.plan_ahead_of_time(groups, workers)
    for layer_groups, splits in zip(groups, plan, strict=True):
        tau = sum(g.reserved for g in layer_groups) / workers
        for index, group in enumerate(layer_groups):
            mine = [s for s in splits if s.group == index]
            assert len(mine) == max(1, round(group.reserved / tau))
            assert mine[0].start == 0.0 and mine[-1].end == 1.0
            assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False))
        # In whole keys, the splits of a group read its whole table, each key once.
        for length in (1, 37, 1000):
            total = sum(split.keys(groups, length) for split in splits)
            assert total == sum(len(g.heads) * math.ceil(g.budget * length) for g in layer_groups)


@given(
    budgets=profiles,
    workers=st.integers(1, 40),
    length=st.integers(1, 3000),
    block_size=st.sampled_from([1, 16]),
)
def test_a_split_reads_the_whole_keys_the_ragged_attention_gives_it(
    budgets, workers, length, block_size
):
    groups = hg.group_heads(budgets, 2)
    for splits in hg.plan_ahead_of_time(groups, workers):
        for split in splits:
            group = groups[split.layer][split.group]
            held = math.ceil(group.budget * length / block_size) * block_size
            # kvstack.reference.ragged: part p of n reads keys [p * used // n, (p + 1) * used // n)
            keys = range(split.part * held // split.parts, (split.part + 1) * held // split.parts)
            assert split.keys(groups, length, block_size) == len(group.heads) * len(keys)


def test_budgets_given_as_a_tensor_group_like_the_same_numbers():
    torch = pytest.importorskip("torch")
    rows = [[0.9, 0.1, 0.8, 0.2], [0.5, 0.5, 0.25, 0.25]]
    groups = hg.group_heads(torch.tensor(rows, dtype=torch.float64), 2)
    assert groups == hg.group_heads(rows, 2)
    assert all(type(group.budget) is float for layer in groups for group in layer)
    with pytest.raises(InvalidArgumentError, match=r"budgets has shape \(4,\)"):
        hg.group_heads(torch.tensor(rows[0]), 2)


@given(
    works=st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=40),
    workers=st.integers(1, 12),
)
def test_launch_order_keeps_the_work_and_the_list_scheduling_bound(works, workers):
    loads = hg.run_in_launch_order(works, workers)
    assert len(loads) == workers
    assert sum(loads) == pytest.approx(sum(works))
    assert max(loads) <= sum(works) / workers + max(works) + 1e-9
    if sum(works) > 0:
        assert hg.imbalance(loads) >= 1.0 - 1e-12


def test_equal_splits_filling_every_worker_are_perfectly_balanced():
    assert hg.imbalance(hg.run_in_launch_order([2.0] * 12, 4)) == 1.0
    # five splits on four workers: one runs two, loads [4, 2, 2, 2], max / mean = 4 / 2.5
    assert hg.imbalance(hg.run_in_launch_order([2.0] * 5, 4)) == pytest.approx(1.6)


@given(
    budgets=profiles,
    lengths=st.lists(st.integers(1, 4096), min_size=1, max_size=8),
    workers=st.integers(1, 64),
    block_size=st.sampled_from([1, 16]),
)
def test_the_per_step_plan_cuts_exactly_the_batchs_work_into_one_wave(
    budgets, lengths, workers, block_size
):
    groups = hg.group_heads(budgets, 2)[0]
    pieces = hg.plan_per_step(groups, lengths, workers, block_size)
    expected = sum(
        len(g.heads) * math.ceil(g.budget * n / block_size) * block_size
        for n in lengths
        for g in groups
    )
    assert sum(pieces) == pytest.approx(expected)
    assert len(pieces) <= max(workers, len(lengths) * len(groups))
    assert pieces == sorted(pieces, reverse=True)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: hg.group_heads([[0.5, 0.0]], 1), r"budgets\[0\]\[1\] = 0.0"),
        (lambda: hg.group_heads([[0.5, 1.2]], 1), r"budgets\[0\]\[1\] = 1.2"),
        (lambda: hg.group_heads([], 1), "at least one layer"),
        (lambda: hg.group_heads([[0.5]], 0), "heads_per_group must be"),
        (lambda: hg.group_heads([[0.5]], 1, "random"), "order must be one of"),
        (lambda: hg.plan_ahead_of_time(hg.group_heads([[0.5]], 1), 0), "workers must be"),
        (lambda: hg.run_in_launch_order([1.0], 0), "workers must be"),
        (lambda: hg.plan_per_step(hg.group_heads([[0.5]], 1)[0], [8], 0), "workers must be"),
        (lambda: hg.plan_per_step(hg.group_heads([[0.5]], 1)[0], [8], 4, 0), "block_size must"),
        (lambda: hg.imbalance([0.0, 0.0]), "positive total"),
        (lambda: hg.plan_per_step([], [8], 4), "groups is empty"),
        (lambda: hg.plan_per_step(hg.group_heads([[0.5]], 1)[0], [], 4), r"lengths=\[\]"),
        (lambda: hg.plan_per_step(hg.group_heads([[0.5]], 1)[0], [0], 4), r"lengths=\[0\]"),
        (lambda: hg.group_heads([["a", 0.5]], 1), "expected rows"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call()
