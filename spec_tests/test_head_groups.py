"""Tangram's head groups: properties over random budgets, a known layer, and bad input."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: hg.group_heads([[0.5, 0.0]], 1), r"budgets\[0\]\[1\] = 0.0"),
        (lambda: hg.group_heads([[0.5, 1.2]], 1), r"budgets\[0\]\[1\] = 1.2"),
        (lambda: hg.group_heads([], 1), "at least one layer"),
        (lambda: hg.group_heads([[0.5]], 0), "heads_per_group must be"),
        (lambda: hg.group_heads([[0.5]], 1, "random"), "order must be one of"),
    ],
)
def test_bad_input_is_refused(call, match):
    with pytest.raises(InvalidArgumentError, match=match):
        call()
