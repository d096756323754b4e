"""Eviction policies pinned to their papers on hand-made attention weights.

Every expected answer is computed here, in plain Python, from the paper's rule (never by calling
the policy's own scoring code): H2O accumulates attention (Zhang et al., NeurIPS'23), TOVA reads
the newest query (Oren et al., 2024), Scissorhands counts importance over a history (Liu et al.,
NeurIPS'23), SnapKV pools the votes of an observation window (Li et al., 2024), StreamingLLM keeps
sinks and the recent tokens (Xiao et al., ICLR'24). The shared ``choose_victims`` is checked
against ``expected_victims`` below, and a hypothesis property runs every policy on random tables
with evicted gaps.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstack.errors import InvalidArgumentError
from kvstack.policies import (
    H2O,
    TOVA,
    EvictionPolicy,
    RandomEviction,
    Scissorhands,
    SnapKV,
    StreamingLLM,
)
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.token_table import TokenTable

# ----------------------------------------------------------------- helpers


def make_table(
    num_tokens: int, evicted: tuple[int, ...] = (), block_size: int = 4
) -> tuple[BlockPool, TokenTable]:
    """A table of ``num_tokens`` logical tokens, ``evicted`` of them dead (gaps)."""
    pool = BlockPool(64, block_size, num_kv_heads=1, head_dim=1)
    table = TokenTable(block_size)
    append(pool, table, num_tokens)
    if evicted:
        table.evict(list(evicted))
    return pool, table


def append(pool: BlockPool, table: TokenTable, n: int) -> None:
    table.append(pool, torch.zeros(n, 1, 1), torch.zeros(n, 1, 1))


def live(table: TokenTable) -> list[int]:
    return table.live_indices().tolist()


def weights_from(rows: dict[tuple[int, int], dict[int, float]], table, heads, queries):
    """[heads, T_q, L] weights: ``rows[(head, query)]`` maps a logical index to its weight."""
    order = live(table)
    w = torch.zeros(heads, queries, len(order))
    for (head, query), row in rows.items():
        for index, value in row.items():
            w[head, query, order.index(index)] = value
    return w


def enumerate_rows(rows: list[dict[int, float]]):
    """Rows of one head, query by query, as ``weights_from`` items."""
    return (((0, q), row) for q, row in enumerate(rows))


def expected_victims(score: dict[int, float], keep: set[int], alive: list[int], budget: int):
    """The shared rule by hand: the ``L - budget`` unprotected live tokens of lowest score, ties
    to the older (smaller logical index) token, returned in ascending order."""
    excess = len(alive) - budget
    if excess <= 0:
        return []
    candidates = sorted((score[i], i) for i in alive if i not in keep)
    return sorted(i for _, i in candidates[:excess])


# The policies work on the N tables of a layer at once, by logical index; these helpers run
# them on one reference table, with weights given over its live tokens in logical order.


def by_index(table: TokenTable, weights: torch.Tensor) -> torch.Tensor:
    """[heads, T_q, L] over the live tokens -> [1, heads, T_q, T] by logical index."""
    full = torch.zeros(*weights.shape[:2], table.num_tokens)
    full[:, :, table.live_indices()] = weights
    return full[None]


def observe(policy, state, table, weights) -> None:
    policy.observe(state, table.alive[None], by_index(table, weights))


def scores(policy, state, table) -> torch.Tensor:
    return policy.scores(state, table.alive[None])[0, table.live_indices()]


def protected(policy, num_live: int, budget: int) -> list[bool]:
    return policy.protected(torch.ones(1, num_live, dtype=torch.bool), [budget])[0].tolist()


def victims(policy, state, table, budget) -> list[int]:
    chosen = policy.choose_victims(state, table.alive[None], [budget])[0]
    return chosen.nonzero().flatten().tolist()


# ----------------------------------------------------------------- H2O


def test_h2o_accumulates_over_queries_heads_and_steps_by_logical_index():
    pool, table = make_table(6)
    policy = H2O(recent_fraction=0.0)
    state = policy.init_state(1)
    observed = []  # (live indices, {(head, query): {index: weight}}) in the order seen

    step1 = {
        (0, 0): {0: 0.5, 1: 0.25, 2: 0.25},
        (0, 1): {2: 0.75, 4: 0.25},
        (1, 0): {1: 0.5, 5: 0.5},
        (1, 1): {0: 0.125, 3: 0.875},
    }
    observe(policy, state, table, weights_from(step1, table, heads=2, queries=2))
    observed.append(step1)

    # Another decision evicts tokens 1 and 3; a new token 6 arrives. Scores must stay with
    # their logical tokens, not slide onto the live positions the dead tokens left.
    table.evict([1, 3])
    append(pool, table, 1)
    step2 = {
        (0, 0): {6: 1.0},
        (1, 0): {0: 0.25, 4: 0.75},
    }
    observe(policy, state, table, weights_from(step2, table, heads=2, queries=1))
    observed.append(step2)

    total = defaultdict(float)
    for step in observed:
        for row in step.values():
            for index, value in row.items():
                total[index] += value
    assert live(table) == [0, 2, 4, 5, 6]
    expected = [total[i] for i in live(table)]  # [0.875, 1.0, 1.0, 0.5, 1.0]
    assert scores(policy, state, table).tolist() == pytest.approx(expected)


def test_h2o_keeps_heavy_hitters_sinks_and_recent_fraction_of_budget():
    _, table = make_table(12, evicted=(4,))
    alive = live(table)  # [0..3, 5..11], L = 11
    budget = 6
    policy = H2O(recent_fraction=0.4, sink_tokens=1)
    state = policy.init_state(1)
    heavy = {2: 3.0, 6: 2.0, 9: 5.0}  # 9 is heavy but also recent; 0 is light but a sink
    rows = {(0, 0): {i: heavy.get(i, 0.1) for i in alive}}
    observe(policy, state, table, weights_from(rows, table, heads=1, queries=1))

    recent = int(0.4 * budget)  # 2 most recent: tokens 10, 11
    keep = set(alive[:1]) | set(alive[-recent:])
    expected = expected_victims(rows[(0, 0)], keep, alive, budget)
    assert expected == [1, 3, 5, 7, 8]
    assert victims(policy, state, table, budget) == expected
    kept = set(alive) - set(expected)
    assert {0, 2, 6, 9, 10, 11} == kept


@pytest.mark.parametrize("fraction, budget", [(0.0, 5), (0.25, 7), (0.5, 9), (0.9, 10)])
def test_h2o_protects_floor_of_recent_fraction_times_budget(fraction, budget):
    policy = H2O(recent_fraction=fraction, sink_tokens=2)
    recent = int(fraction * budget)
    expected = [i < 2 or i >= 20 - recent for i in range(20)]
    assert protected(policy, 20, budget) == expected


def h2o_smallest_budget(sinks: int, fraction: float) -> int:
    """The smallest budget that holds the sinks, the recent window and one heavy hitter."""
    budget = 1
    while sinks + int(fraction * budget) + 1 > budget:
        budget += 1
    return budget


@pytest.mark.parametrize("sinks, fraction", [(0, 0.5), (4, 0.5), (2, 0.9), (4, 0.0), (1, 0.3)])
def test_h2o_min_budget_never_forces_evicting_a_protected_token(sinks, fraction):
    policy = H2O(sink_tokens=sinks, recent_fraction=fraction)
    assert policy.min_budget() == h2o_smallest_budget(sinks, fraction)
    _, table = make_table(60)
    state = policy.init_state(1)
    observe(policy, state, table, torch.full((1, 1, 60), 1 / 60))
    budget = policy.min_budget()
    chosen = victims(policy, state, table, budget)
    assert len(chosen) == 60 - budget
    recent = int(fraction * budget)
    assert not set(chosen) & (set(range(sinks)) | set(range(60 - recent, 60)))


# ----------------------------------------------------------------- TOVA


def test_tova_newest_query_averaged_over_heads_decides():
    _, table = make_table(6)
    policy = TOVA()
    state = policy.init_state(1)
    # An old step and the older query of the newest step both favour tokens 1 and 2: forgotten.
    observe(policy, state, table, weights_from({(0, 0): {1: 1.0}, (1, 0): {2: 1.0}}, table, 2, 1))
    newest = {
        (0, 1): {0: 0.4, 3: 0.45, 4: 0.15},
        (1, 1): {0: 0.3, 3: 0.05, 4: 0.4, 5: 0.25},
    }
    older = {(0, 0): {1: 0.5, 2: 0.5}, (1, 0): {2: 1.0}}
    observe(policy, state, table, weights_from({**older, **newest}, table, heads=2, queries=2))

    mean = {i: (newest[(0, 1)].get(i, 0.0) + newest[(1, 1)].get(i, 0.0)) / 2 for i in range(6)}
    # mean: 0 -> .35, 3 -> .25, 4 -> .275, 5 -> .125 (the max over heads would keep 3 over 0)
    expected = expected_victims(mean, set(), list(range(6)), budget=2)
    assert expected == [1, 2, 3, 5]
    assert victims(policy, state, table, 2) == expected


def test_tova_state_follows_logical_tokens_across_an_eviction():
    _, table = make_table(6)
    policy = TOVA()
    state = policy.init_state(1)
    newest = {0: 0.1, 1: 0.3, 2: 0.05, 3: 0.2, 4: 0.15, 5: 0.2}
    observe(policy, state, table, weights_from({(0, 0): newest}, table, 1, 1))
    table.evict([1])  # decided elsewhere; the remaining tokens keep their scores
    assert victims(policy, state, table, 3) == expected_victims(newest, set(), live(table), 3)


# ----------------------------------------------------------------- Scissorhands


def test_scissorhands_counts_importance_over_the_last_history_queries():
    pool, table = make_table(4)
    policy = Scissorhands(history=3, recent_tokens=0)
    state = policy.init_state(1)
    queries = []  # (live indices, {index: weight}) per query, oldest first

    step1 = [{0: 0.5, 1: 0.25, 2: 0.125, 3: 0.125}, {0: 0.125, 1: 0.125, 2: 0.5, 3: 0.25}]
    observe(policy, state, table, weights_from(dict(enumerate_rows(step1)), table, 1, 2))
    queries += [(live(table), row) for row in step1]

    table.evict([1])
    append(pool, table, 1)  # live [0, 2, 3, 4], threshold still 1/4
    step2 = [{0: 0.5, 2: 0.25, 3: 0.125, 4: 0.125}, {0: 0.0625, 2: 0.0625, 3: 0.24, 4: 0.6375}]
    observe(policy, state, table, weights_from(dict(enumerate_rows(step2)), table, 1, 2))
    queries += [(live(table), row) for row in step2]

    counts = Counter()
    for alive, row in queries[-3:]:  # the first query is beyond the history
        counts.update(i for i in alive if row[i] >= 1 / len(alive))
    expected = [counts[i] for i in live(table)]
    assert expected == [1, 2, 1, 1]  # token 0 lost the count of the forgotten first query
    assert scores(policy, state, table).tolist() == expected


def test_scissorhands_threshold_is_uniform_over_the_live_tokens_then():
    _, table = make_table(10, evicted=(1, 2, 3, 4, 5, 6))  # L = 4: threshold 1/4, not 1/10
    policy = Scissorhands(history=8, recent_tokens=0)
    state = policy.init_state(1)
    row = {0: 0.25, 7: 0.5, 8: 0.125, 9: 0.125}
    observe(policy, state, table, weights_from({(0, 0): row}, table, 1, 1))
    assert scores(policy, state, table).tolist() == [1, 1, 0, 0]


def test_scissorhands_keeps_recent_tokens_and_evicts_the_least_persistent():
    _, table = make_table(8)
    policy = Scissorhands(history=4, recent_tokens=2, sink_tokens=1)
    state = policy.init_state(1)
    rows = [{1: 0.5, 3: 0.25, 4: 0.25}, {1: 0.5, 4: 0.5}, {1: 0.75, 2: 0.25}]
    observe(policy, state, table, weights_from(dict(enumerate_rows(rows)), table, 1, 3))
    counts = Counter(i for row in rows for i, w in row.items() if w >= 1 / 8)
    score = {i: counts[i] for i in range(8)}
    expected = expected_victims(score, {0, 6, 7}, list(range(8)), budget=5)
    assert expected == [2, 3, 5]  # 0 (a sink) and 6, 7 (recent) are never important, yet kept
    assert victims(policy, state, table, 5) == expected


# ----------------------------------------------------------------- SnapKV


def test_snapkv_votes_of_the_window_max_pooled_over_live_neighbours():
    _, table = make_table(9, evicted=(3,))
    alive = live(table)  # [0, 1, 2, 4, 5, 6, 7, 8]
    window, kernel = 2, 3
    policy = SnapKV(window=window, kernel_size=kernel)
    state = policy.init_state(1)
    rows = {
        # The two oldest queries form a window that the next one replaces: ignored.
        (0, 0): {5: 1.0},
        (1, 1): {4: 1.0},
        (0, 2): {2: 0.25, 7: 0.5, 8: 0.25},
        (1, 2): {2: 0.25, 6: 0.0625, 8: 0.6875},
        (0, 3): {6: 0.0625, 7: 0.9375},
        (1, 3): {7: 0.5, 8: 0.5},
    }
    observe(policy, state, table, weights_from(rows, table, heads=2, queries=4))

    votes = defaultdict(float)
    for (_, query), row in rows.items():
        if query >= 4 - window:
            for index, value in row.items():
                votes[index] += value
    # SnapKV (Listing 1): the window's own tokens are kept whole; only the prefix is pooled,
    # each token taking the max vote of its live neighbours (2 and 4 are neighbours).
    prefix = alive[:-window]
    half = kernel // 2
    pooled = {
        index: max(votes[j] for j in prefix[max(0, p - half) : p + half + 1])
        for p, index in enumerate(prefix)
    }
    assert pooled == {0: 0.0, 1: 0.5, 2: 0.5, 4: 0.5, 5: 0.125, 6: 0.125}
    expected = expected_victims(pooled, set(alive[-window:]), alive, budget=5)
    assert expected == [0, 5, 6]
    assert victims(policy, state, table, 5) == expected


def test_snapkv_always_keeps_the_window():
    _, table = make_table(12)
    policy = SnapKV(window=4, kernel_size=1)
    state = policy.init_state(1)
    rows = {(0, q): {i: 1 / 8 for i in range(8)} for q in range(4)}  # the window gets nothing
    observe(policy, state, table, weights_from(rows, table, 1, 4))
    assert victims(policy, state, table, 5) == [0, 1, 2, 3, 4, 5, 6]


def test_snapkv_window_hops_across_observe_calls():
    """Windows of ``window`` queries tile the query stream; the votes are the last closed
    window's plus the open one's, and a full open window closes and replaces the closed one."""
    pool, table = make_table(5)
    policy = SnapKV(window=2, kernel_size=1)
    state = policy.init_state(1)
    prompt = {(0, 0): {4: 1.0}, (0, 1): {0: 1.0}, (0, 2): {1: 0.5, 3: 0.5}}
    observe(policy, state, table, weights_from(prompt, table, 1, 3))
    # Queries 0 and 1 close the first window; query 2 opens the next: all three vote.
    assert scores(policy, state, table).tolist() == [1.0, 0.5, 0.0, 0.5, 1.0]
    assert state["open_queries"] == 1

    append(pool, table, 1)
    observe(policy, state, table, weights_from({(0, 0): {2: 1.0}}, table, 1, 1))
    # Queries 2 and 3 close the second window, which replaces the first (4 and 0 lose votes).
    votes = {0: 0.0, 1: 0.5, 2: 1.0, 3: 0.5}
    assert scores(policy, state, table)[:4].tolist() == [votes[i] for i in range(4)]
    assert state["open_queries"] == 0
    assert victims(policy, state, table, 4) == expected_victims(votes, {4, 5}, live(table), 4)
    assert victims(policy, state, table, 4) == [0, 1]

    append(pool, table, 1)
    observe(policy, state, table, weights_from({(0, 0): {5: 0.75, 6: 0.25}}, table, 1, 1))
    # One more query opens the third window: the closed two and this one vote.
    assert scores(policy, state, table).tolist() == [0.0, 0.5, 1.0, 0.5, 0.0, 0.75, 0.25]


@given(
    window=st.integers(1, 6),
    num_queries=st.integers(1, 20),
    cuts=st.lists(st.integers(1, 19), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_snapkv_votes_do_not_depend_on_how_queries_are_split(window, num_queries, cuts, seed):
    _, table = make_table(12)
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(2, num_queries, 12, generator=gen)
    policy = SnapKV(window=window, kernel_size=1)
    whole, split = policy.init_state(1), policy.init_state(1)
    observe(policy, whole, table, weights)
    bounds = sorted({0, num_queries, *(c for c in cuts if c < num_queries)})
    for start, end in zip(bounds, bounds[1:], strict=False):
        observe(policy, split, table, weights[:, start:end])
    assert whole["open_queries"] == split["open_queries"] == num_queries % window
    torch.testing.assert_close(scores(policy, whole, table), scores(policy, split, table))
    # By hand: the last closed window and the open one.
    voted = num_queries % window + (window if num_queries >= window else 0)
    expected = weights[:, num_queries - voted :].sum(dim=(0, 1))
    torch.testing.assert_close(policy.scores(whole, table.alive[None])[0], expected)


def test_snapkv_state_is_two_sums_not_window_rows():
    """Memory: whatever the window, the state is two [N, T] sums (and a count)."""
    pool, table = make_table(40)
    policy = SnapKV(window=16, kernel_size=3)
    state = policy.init_state(1)
    for _ in range(50):
        append(pool, table, 1)
        weights = torch.softmax(torch.randn(1, 1, len(live(table))), dim=-1)
        observe(policy, state, table, weights)
    tensors = [state["closed"].values, state["open"].values]
    assert sorted(state) == ["closed", "open", "open_queries"]
    assert all(t.shape[0] == 1 and t.shape[1] < 2 * table.num_tokens for t in tensors)


# ----------------------------------------------------------------- StreamingLLM


def test_streamingllm_keeps_sinks_and_most_recent_evicts_oldest():
    _, table = make_table(12, evicted=(3, 5))
    policy = StreamingLLM(sink_tokens=2)
    state = policy.init_state(1)
    alive = live(table)  # [0, 1, 2, 4, 6, 7, 8, 9, 10, 11]
    # Keep alive[:2] and the newest budget - 2 tokens; evict the rest, oldest first.
    expected = alive[2 : len(alive) - (6 - 2)]
    assert expected == [2, 4, 6, 7]
    assert victims(policy, state, table, 6) == expected


# ----------------------------------------------------------------- RandomEviction


def test_random_eviction_is_reproducible_per_seed_and_varies_across_seeds():
    _, table = make_table(30, evicted=(4, 9))

    def draw(seed):
        policy = RandomEviction(seed=seed, sink_tokens=2, recent_tokens=3)
        return victims(policy, policy.init_state(1), table, 14)

    first = draw(7)
    assert first == draw(7)
    assert len({tuple(draw(seed)) for seed in range(6)}) > 1
    alive = live(table)
    assert not set(first) & set(alive[:2] + alive[-3:])


def test_random_eviction_is_roughly_uniform_over_unprotected_tokens():
    _, table = make_table(12, evicted=(5,))
    alive = live(table)  # L = 11
    unprotected = alive[1:-2]  # 8 tokens
    counts = Counter()
    draws = 800
    for seed in range(draws):
        policy = RandomEviction(seed=seed, sink_tokens=1, recent_tokens=2)
        counts.update(victims(policy, policy.init_state(1), table, len(alive) - 2))
    assert set(counts) == set(unprotected)  # every unprotected token, and nothing else
    mean = 2 * draws / len(unprotected)  # 200
    assert all(0.6 * mean < counts[i] < 1.4 * mean for i in unprotected), counts


# ----------------------------------------------------------------- shared choose_victims


def test_choose_victims_count_order_ties_and_nothing_within_budget():
    _, table = make_table(10, evicted=(2, 7))
    alive = live(table)  # [0, 1, 3, 4, 5, 6, 8, 9]
    policy = TOVA(sink_tokens=1, recent_tokens=2)
    state = policy.init_state(1)
    observe(policy, state, table, torch.full((2, 1, len(alive)), 1 / len(alive)))  # all tie
    assert victims(policy, state, table, 5) == [1, 3, 4]  # the oldest unprotected
    assert victims(policy, state, table, len(alive) - 1) == [1]  # one victim (decode path)
    for budget in (len(alive), len(alive) + 3):
        chosen = policy.choose_victims(state, table.alive[None], [budget])
        assert chosen.dtype == torch.bool and chosen.shape == (1, table.num_tokens)
        assert not chosen.any()


def test_min_budget_values():
    assert StreamingLLM().min_budget() == 5
    assert StreamingLLM(sink_tokens=0).min_budget() == 1
    assert Scissorhands().min_budget() == 17
    assert Scissorhands(recent_tokens=3, sink_tokens=2).min_budget() == 6
    assert SnapKV(window=8).min_budget() == 9
    assert TOVA().min_budget() == 1
    assert RandomEviction(sink_tokens=1, recent_tokens=2).min_budget() == 4
    assert H2O().min_budget() == 1
    assert H2O(sink_tokens=4, recent_fraction=0.5).min_budget() == 9


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: StreamingLLM(sink_tokens=-1), "sink_tokens"),
        (lambda: RandomEviction(recent_tokens=-2), "recent_tokens"),
        (lambda: RandomEviction(sink_tokens=True), "sink_tokens"),
        (lambda: TOVA(sink_tokens=1.5), "sink_tokens"),
        (lambda: Scissorhands(history=0), "history"),
        (lambda: Scissorhands(recent_tokens=-1), "recent_tokens"),
        (lambda: H2O(recent_fraction=1.0), "recent_fraction"),
        (lambda: H2O(recent_fraction=-0.1), "recent_fraction"),
        (lambda: H2O(sink_tokens=-1), "sink_tokens"),
        (lambda: SnapKV(window=0), "window"),
        (lambda: SnapKV(kernel_size=4), "kernel_size"),
        (lambda: SnapKV(kernel_size=0), "kernel_size"),
        (lambda: SnapKV(kernel_size=3.0), "kernel_size"),
        (lambda: SnapKV(kernel_size="3"), "kernel_size"),
    ],
)
def test_constructor_rejects_bad_arguments_naming_them(make, argument):
    with pytest.raises(InvalidArgumentError, match=argument):
        make()


class EvictNewest(EvictionPolicy):
    """A whole new policy in a few lines: the newest unprotected tokens go first."""

    def scores(self, state, alive):
        return -torch.arange(alive.shape[1]).float().expand(alive.shape)


def test_a_new_policy_is_a_few_lines_on_the_interface():
    _, table = make_table(10, evicted=(8,))
    policy = EvictNewest(sink_tokens=1, recent_tokens=1)
    assert policy.min_budget() == 3
    assert victims(policy, policy.init_state(1), table, 5) == [4, 5, 6, 7]


# ----------------------------------------------------------------- property: every policy

POLICIES = {
    "h2o": lambda d: H2O(
        recent_fraction=d.draw(st.sampled_from([0.0, 0.3, 0.5, 0.9])),
        sink_tokens=d.draw(st.integers(0, 4)),
    ),
    "tova": lambda d: TOVA(sink_tokens=d.draw(st.integers(0, 3))),
    "scissorhands": lambda d: Scissorhands(
        history=d.draw(st.integers(1, 6)),
        recent_tokens=d.draw(st.integers(0, 4)),
        sink_tokens=d.draw(st.integers(0, 2)),
    ),
    "snapkv": lambda d: SnapKV(
        window=d.draw(st.integers(1, 5)), kernel_size=d.draw(st.sampled_from([1, 3, 5, 7]))
    ),
    "streamingllm": lambda d: StreamingLLM(sink_tokens=d.draw(st.integers(0, 4))),
    "random": lambda d: RandomEviction(
        seed=d.draw(st.integers(0, 99)),
        sink_tokens=d.draw(st.integers(0, 2)),
        recent_tokens=d.draw(st.integers(0, 3)),
    ),
    "evict_newest": lambda d: EvictNewest(sink_tokens=d.draw(st.integers(0, 2))),
}


def must_keep(policy, alive: list[int], budget: int) -> set[int]:
    """Sinks and the recent window each paper keeps, computed from the constructor arguments."""
    recent = policy.recent_tokens
    if isinstance(policy, H2O):
        recent = int(policy.recent_fraction * budget)
    return set(alive[: policy.sink_tokens]) | (set(alive[-recent:]) if recent else set())


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(data=st.data())
def test_choose_victims_returns_live_unprotected_tokens_of_the_right_count(name, data):
    policy = POLICIES[name](data)
    num_tokens = data.draw(st.integers(1, 40), label="num_tokens")
    block_size = data.draw(st.sampled_from([1, 3, 4, 16]), label="block_size")
    pool, table = make_table(num_tokens, block_size=block_size)
    state = policy.init_state(1)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    budget = data.draw(st.integers(policy.min_budget(), policy.min_budget() + 30), label="budget")
    for _ in range(data.draw(st.integers(1, 3), label="steps")):
        # Gaps from elsewhere (another layer's decision, a beam fork), then new tokens arrive.
        dead = data.draw(st.sets(st.sampled_from(live(table))), label="evict")
        if len(dead) < table.num_live:
            table.evict(sorted(dead))
        append(pool, table, data.draw(st.integers(0, 4), label="append"))
        alive = live(table)
        heads, queries = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
        weights = torch.rand(heads, queries, len(alive), generator=gen).softmax(-1)
        observe(policy, state, table, weights)
        # State is kept by logical index: an eviction decided elsewhere may come in between.
        late = data.draw(st.sets(st.sampled_from(alive), max_size=len(alive) - 1), label="late")
        table.evict(sorted(late))
        alive = live(table)

        chosen = victims(policy, state, table, budget)
        assert len(chosen) == max(len(alive) - budget, 0)
        assert chosen == sorted(set(chosen))
        assert set(chosen) <= set(alive)
        assert not set(chosen) & must_keep(policy, alive, budget)
        table.evict(chosen)
        assert table.num_live == min(len(alive), budget)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(data=st.data())
def test_a_batch_of_tables_decides_as_each_table_would_alone(name, data):
    """A layer's N tables are scored in one call; each must get exactly the victims it gets
    alone (live counts, ranks, windows, pooling and generators never leak between tables)."""
    policy = POLICIES[name](data)
    num_tables = data.draw(st.integers(2, 4), label="num_tables")
    num_tokens = data.draw(st.integers(1, 30), label="num_tokens")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    budgets = [
        data.draw(st.integers(policy.min_budget(), policy.min_budget() + 20), label="budget")
        for _ in range(num_tables)
    ]
    alive = torch.ones(num_tables, num_tokens, dtype=torch.bool)
    together = policy.init_state(num_tables)
    alone = [policy.init_state(1) for _ in range(num_tables)]
    for _ in range(data.draw(st.integers(1, 3), label="steps")):
        for row in range(num_tables):  # each table has its own gaps
            live = alive[row].nonzero().flatten().tolist()
            dead = data.draw(st.sets(st.sampled_from(live), max_size=len(live) - 1), label="gap")
            alive[row, sorted(dead)] = False
        heads, queries = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
        weights = torch.rand(num_tables, heads, queries, num_tokens, generator=gen)
        weights = weights.softmax(-1) * alive[:, None, None, :]  # by logical index, 0 if dead
        policy.observe(together, alive, weights)
        for row in range(num_tables):
            policy.observe(alone[row], alive[row : row + 1], weights[row : row + 1])
    chosen = policy.choose_victims(together, alive, budgets)
    for row in range(num_tables):
        own = policy.choose_victims(alone[row], alive[row : row + 1], [budgets[row]])[0]
        assert torch.equal(chosen[row], own), row
        assert int(chosen[row].sum()) == max(int(alive[row].sum()) - budgets[row], 0)


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(data=st.data())
def test_decode_fast_paths_decide_as_the_general_methods(name, data):
    """The decode step's shortcuts are the general rule, not an approximation: weights
    observed over the attention view's columns (``observe_columns``, also when only the first W
    columns come, as in a prefill chunk) leave the state that ``observe`` leaves with the same
    weights by logical index, and ``choose_one_victim_each`` (every table one over one budget)
    picks exactly the token ``choose_victims`` picks."""
    by_column = POLICIES[name](data)
    by_index = copy.deepcopy(by_column)  # the same policy, with its own state below
    num_tables = data.draw(st.integers(1, 4), label="num_tables")
    budget = data.draw(st.integers(by_column.min_budget(), by_column.min_budget() + 12))
    num_tokens = data.draw(st.integers(budget + 1, budget + 20), label="num_tokens")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    alive = torch.zeros(num_tables, num_tokens, dtype=torch.bool)
    for row in range(num_tables):  # budget + 1 live tokens in each table, gaps of its own
        keep = data.draw(st.permutations(range(num_tokens)), label="order")[: budget + 1]
        alive[row, keep] = True
    columns = alive.nonzero()[:, 1].view(num_tables, budget + 1)  # [N, L]: the view's indices
    states = by_column.init_state(num_tables), by_index.init_state(num_tables)
    for _ in range(data.draw(st.integers(1, 3), label="steps")):
        width = data.draw(st.integers(1, budget + 1), label="width")
        heads, queries = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
        weights = torch.rand(num_tables, heads, queries, width, generator=gen).softmax(-1)
        scattered = torch.zeros(num_tables, heads, queries, num_tokens)
        scattered.scatter_(3, columns[:, None, None, :width].expand(weights.shape), weights)
        by_column.observe_columns(states[0], alive, weights, columns[:, :width])
        by_index.observe(states[1], alive, scattered)
    victims = by_column.choose_one_victim_each(states[0], alive, columns, budget)
    expected = by_index.choose_victims(states[1], alive, [budget] * num_tables)
    if victims is None:  # the policy protects by a rule of its own: the general path serves
        assert type(by_column).protected is not EvictionPolicy.protected
        return
    assert expected.sum(dim=1).tolist() == [1] * num_tables
    assert victims.tolist() == expected.int().argmax(dim=1).tolist()


@pytest.mark.parametrize("name", sorted(POLICIES))
@given(data=st.data())
def test_observing_only_the_observed_queries_decides_as_observing_all(name, data):
    """A prefill computes weights only for the last ``observed_queries`` rows and announces the
    others with ``skip_queries``: over steps of any length (SnapKV: with its open window at any
    fill), the policy then scores and chooses exactly as it does after observing every row."""
    every = POLICIES[name](data)
    last = copy.deepcopy(every)  # the same policy, with its own state below
    num_tables = data.draw(st.integers(1, 3), label="num_tables")
    low = every.min_budget()
    num_tokens = data.draw(st.integers(low, low + 30), label="num_tokens")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    alive = torch.ones(num_tables, num_tokens, dtype=torch.bool)
    states = every.init_state(num_tables), last.init_state(num_tables)
    heads = data.draw(st.integers(1, 3), label="heads")
    for _ in range(data.draw(st.integers(1, 4), label="steps")):
        queries = data.draw(st.integers(1, 90), label="queries")
        weights = torch.rand(num_tables, heads, queries, num_tokens, generator=gen).softmax(-1)
        every.observe(states[0], alive, weights)
        observed = last.observed_queries(states[1], queries)
        assert 0 <= observed <= queries
        assert observed > 0 or not last.needs_attention_weights or queries == 0
        last.skip_queries(states[1], queries - observed)
        if observed:
            last.observe(states[1], alive, weights[:, :, queries - observed :])
    budget = data.draw(st.integers(low, num_tokens), label="budget")
    if every.needs_attention_weights:  # Random draws from its generators: scores once only
        torch.testing.assert_close(every.scores(states[0], alive), last.scores(states[1], alive))
    budgets = [budget] * num_tables
    assert torch.equal(
        every.choose_victims(states[0], alive, budgets),
        last.choose_victims(states[1], alive, budgets),
    )


def test_observed_queries_per_policy():
    """Which prefill rows each policy reads: none without weights, the newest for TOVA, the
    last ``history`` for Scissorhands, every one for H2O, and for SnapKV the open window plus
    the window before it (after the step)."""
    assert StreamingLLM().observed_queries(None, 100) == 0
    assert RandomEviction().observed_queries(None, 100) == 0
    assert TOVA().observed_queries(TOVA().init_state(1), 100) == 1
    assert Scissorhands(history=32).observed_queries(None, 100) == 32
    assert Scissorhands(history=32).observed_queries(None, 20) == 20
    assert H2O().observed_queries(None, 100) == 100
    snapkv = SnapKV(window=32)
    state = snapkv.init_state(1)
    assert snapkv.observed_queries(state, 100) == 32 + 100 % 32  # 36: windows [64, 96), [96, 100)
    assert snapkv.observed_queries(state, 40) == 40  # 32 + 8 >= 40: every row
    state["open_queries"] = 30
    assert snapkv.observed_queries(state, 100) == 32 + 130 % 32  # 34


def test_snapkv_skip_queries_must_end_at_a_window_boundary():
    """Skipping rows that would leave the tiling inside a window is refused, state unchanged."""
    snapkv = SnapKV(window=4)
    state = snapkv.init_state(1)
    state["open_queries"] = 1
    before = copy.deepcopy(state)
    with pytest.raises(InvalidArgumentError, match="window boundary"):
        snapkv.skip_queries(state, 2)
    assert state["open_queries"] == before["open_queries"]
    snapkv.skip_queries(state, 3)
    assert state["open_queries"] == 0
