"""Ragged decode attention over head groups' page tables (``kvstack.reference.ragged``, Tangram).

Every backend of the registered op is held to three properties (the compiled twin in slow runs,
in CI through its equivalence with the reference, ``test_equivalence.py``; the reference and the
C++ kernel in every run):

* it is dense attention over the whole sequence with each head's dropped entries masked — the
  kvpress way of head-wise compression, which ragged pages must match while holding less;
* the work list is a schedule, not a meaning: any split of the groups gives the same result;
* the work list Tangram plans ahead of time from a profile (``kvstack.head_groups``) runs it.

Bad input is refused with the argument named, for every backend.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstack import ops
from kvstack.errors import BackendUnavailable, InvalidArgumentError, SlotOutOfRangeError
from kvstack.head_groups import group_heads, plan_ahead_of_time, work_list
from spec_tests.strategies import (
    TOLERANCES,
    RaggedCase,
    dense_masked_decode,
    ragged_cases,
    ragged_tables,
)

OP = "ragged_decode_attention"
BACKENDS = [b for b in ops.operations()[OP].backends("cpu")]
# The reference and the C++ kernel meet the properties in CI; the compiled twin meets them
# through test_equivalence.py (the reference's result on the same random groups, lengths and
# work lists), and here directly in slow runs: each 0/1-sized dim hypothesis draws is a new
# graph, minutes of compiling on a cold cache for no case the equivalence test does not also
# cover.
PROPERTY_BACKENDS = [
    pytest.param(b, marks=pytest.mark.slow) if b == "compiled" else b for b in BACKENDS
]


def backend_op(backend: str):
    try:
        return ops.get(OP, backend)
    except BackendUnavailable as why:
        pytest.skip(str(why))


def assert_matches(result, out, lse, dtype):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(result.out.float(), out, atol=atol, rtol=rtol)
    assert torch.equal(result.lse == -math.inf, lse == -math.inf), "heads that see nothing"
    finite = lse > -math.inf
    torch.testing.assert_close(result.lse[finite], lse[finite], atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("backend", PROPERTY_BACKENDS)
def test_ragged_attention_is_dense_attention_with_the_dropped_entries_masked(backend):
    attention = backend_op(backend)

    @given(ragged_cases())
    def check(case: RaggedCase):
        out, lse = dense_masked_decode(case)
        assert_matches(attention(*case.args(), **case.kwargs()), out, lse, case.query.dtype)

    check()


@pytest.mark.parametrize("backend", PROPERTY_BACKENDS)
def test_the_work_list_is_a_schedule_not_a_meaning(backend):
    attention = backend_op(backend)

    @given(ragged_cases(), st.data())
    def check(case: RaggedCase, data):
        groups = case.members.shape[0]
        one_each = torch.tensor([[g, 0, 1] for g in range(groups)], dtype=case.work.dtype)
        whole = attention(*case.args()[:-1], one_each, **case.kwargs())
        counts = data.draw(st.lists(st.integers(1, 9), min_size=groups, max_size=groups))
        rows = [(g, part, n) for g, n in enumerate(counts) for part in range(n)]
        other = torch.tensor(data.draw(st.permutations(rows)), dtype=case.work.dtype)
        split = attention(*case.args()[:-1], other, **case.kwargs())
        assert_matches(split, whole.out.float(), whole.lse, case.query.dtype)

    check()


@pytest.mark.parametrize("backend", PROPERTY_BACKENDS)
def test_the_ahead_of_time_work_list_from_a_profile_runs_the_ragged_attention(backend):
    """Budgets -> sorted head groups -> Tangram's static list -> the op, which gives dense
    attention over each head's top ceil(B * N) tokens (by a random score) at every length."""
    attention = backend_op(backend)

    @given(
        st.integers(1, 6),  # KV heads
        st.integers(1, 3),  # heads per group
        st.integers(1, 40),  # workers
        st.lists(st.integers(1, 60), min_size=1, max_size=3),  # sequence lengths
        st.integers(0, 2**31 - 1),
    )
    def check(h_kv, h_p, workers, lengths, seed):
        gen = torch.Generator().manual_seed(seed)
        budgets = [[0.05 + 0.95 * float(torch.rand((), generator=gen)) for _ in range(h_kv)]]
        groups = group_heads(budgets, h_p, "sorted")
        work = torch.tensor(work_list(plan_ahead_of_time(groups, workers)[0]))
        members = torch.full((len(groups[0]), h_p), -1, dtype=torch.int64)
        for g, group in enumerate(groups[0]):
            members[g, : len(group.heads)] = torch.tensor(group.heads)
        batch, tokens, head_dim, per_kv = len(lengths), max(lengths), 8, 2
        kept = torch.zeros((batch, h_kv, tokens), dtype=torch.bool)
        for b, length in enumerate(lengths):
            for head in range(h_kv):
                score = torch.rand(length, generator=gen)
                top = score.topk(math.ceil(budgets[0][head] * length)).indices
                kept[b, head, top] = True
        dense_keys = torch.randn((batch, tokens, h_kv, head_dim), generator=gen)
        dense_values = torch.randn((batch, tokens, h_kv, head_dim), generator=gen)
        key_cache, value_cache, slots, table_lengths = ragged_tables(
            dense_keys, dense_values, kept, members, 4, gen
        )
        query = torch.randn((batch, 1, h_kv * per_kv, head_dim), generator=gen)
        case = RaggedCase(
            query,
            key_cache,
            value_cache,
            slots,
            table_lengths,
            members,
            work,
            dense_keys,
            dense_values,
            kept,
        )
        out, lse = dense_masked_decode(case)
        assert_matches(attention(*case.args()), out, lse, torch.float32)

    check()


# ----------------------------------------------------------------------------- bad input
def good_case() -> RaggedCase:
    """Two groups of two (the second short), three KV heads, two sequences."""
    gen = torch.Generator().manual_seed(0)
    members = torch.tensor([[2, 0], [1, -1]])
    kept = torch.rand((2, 3, 12), generator=gen) < 0.6
    keys, values = torch.randn((2, 12, 3, 8), generator=gen), torch.randn((2, 12, 3, 8))
    key_cache, value_cache, slots, lengths = ragged_tables(keys, values, kept, members, 4, gen)
    work = torch.tensor([[0, 0, 2], [0, 1, 2], [1, 0, 1]])
    query = torch.randn((2, 1, 6, 8), generator=gen)
    return RaggedCase(
        query, key_cache, value_cache, slots, lengths, members, work, keys, values, kept
    )


BAD = {
    "query with two tokens": (
        lambda c: {"query": c.query.expand(2, 2, 6, 8)},
        InvalidArgumentError,
        "query has 2 tokens",
    ),
    "a part missing": (
        lambda c: {"work": torch.tensor([[0, 0, 2], [1, 0, 1]])},
        InvalidArgumentError,
        "group 0",
    ),
    "a part twice": (
        lambda c: {"work": torch.tensor([[0, 0, 2], [0, 0, 2], [0, 1, 2], [1, 0, 1]])},
        InvalidArgumentError,
        "group 0",
    ),
    "a group with no rows": (
        lambda c: {"work": torch.tensor([[0, 0, 1]])},
        InvalidArgumentError,
        "group 1",
    ),
    "a group out of range": (
        lambda c: {"work": torch.tensor([[0, 0, 1], [1, 0, 1], [2, 0, 1]])},
        InvalidArgumentError,
        "work names group 2",
    ),
    "two part counts for one group": (
        lambda c: {"work": torch.tensor([[0, 0, 2], [0, 1, 3], [1, 0, 1]])},
        InvalidArgumentError,
        "group 0",
    ),
    "a head named twice": (
        lambda c: {"members": torch.tensor([[2, 0], [0, -1]])},
        InvalidArgumentError,
        "members must name each KV head",
    ),
    "a head beyond the count": (
        lambda c: {"members": torch.tensor([[3, 0], [1, -1]])},
        InvalidArgumentError,
        "members must name each KV head",
    ),
    "query heads not a multiple": (
        lambda c: {"query": c.query[:, :, :5]},
        InvalidArgumentError,
        "not a multiple",
    ),
    "a length beyond the table": (
        lambda c: {"lengths": c.lengths + c.slots.shape[2]},
        InvalidArgumentError,
        "lengths holds values",
    ),
    "entries for no head": (
        lambda c: {
            "lengths": c.lengths.index_put(
                (torch.tensor([0]), torch.tensor([1]), torch.tensor([1])), torch.tensor(1)
            )
        },
        InvalidArgumentError,
        "no head",
    ),
    "a read slot beyond the pool": (
        lambda c: {
            "slots": c.slots.index_put(
                (torch.tensor([0]), torch.tensor([0]), torch.tensor([0])), torch.tensor(10**6)
            )
        },
        SlotOutOfRangeError,
        "slots holds values",
    ),
    "a -1 slot where a member reads": (
        lambda c: {
            "slots": c.slots.index_put(
                (torch.tensor([0]), torch.tensor([0]), torch.tensor([0])), torch.tensor(-1)
            )
        },
        SlotOutOfRangeError,
        "slots holds values in \\[-1",
    ),
    "a member below -1": (
        lambda c: {"members": torch.tensor([[2, 0], [1, -2]])},
        InvalidArgumentError,
        "members must name each KV head",
    ),
    "zero parts": (
        lambda c: {"work": torch.tensor([[0, 0, 0], [1, 0, 1]])},
        InvalidArgumentError,
        "group 0",
    ),
    "a work list of two columns": (
        lambda c: {"work": c.work[:, :2]},
        InvalidArgumentError,
        "work must have shape",
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(BAD))
def test_ragged_attention_bad_input_is_refused_by_name(backend, case):
    attention = backend_op(backend)
    good = good_case()
    change, error, message = BAD[case]
    names = ("query", "key_cache", "value_cache", "slots", "lengths", "members", "work")
    args = dict(zip(names, good.args(), strict=True))
    before = {name: value.clone() for name, value in args.items()}
    args.update(change(good))
    with pytest.raises(error, match=message):
        attention(*(args[name] for name in names))
    for name, value in before.items():  # nothing it was given changed
        assert torch.equal(getattr(good, name), value), name


def test_the_good_case_of_the_bad_input_test_runs():
    case = good_case()
    out, lse = dense_masked_decode(case)
    for backend in BACKENDS:
        assert_matches(backend_op(backend)(*case.args()), out, lse, torch.float32)
