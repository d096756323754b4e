"""The engine's batched decode of evicting requests (``kvstack.serve.evicting_decode``) is the
general path's work, fused across requests: after every step each request's token tables
(slots, liveness, free lists, blocks) and policy scores are the ones the general path leaves,
and each request gets the same tokens.

Both engines run the same requests side by side; the general one has the batched path switched
off. Random tiny Llama models (fp32, CPU), on the reference attention and on the fastest
backend here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstack.hf
from kvstack.arena import KVArena
from kvstack.policies import H2O, TOVA, LogicalScores, SnapKV
from kvstack.serve import CacheSpec, Engine, evicting_decode
from spec_tests.tiny import tiny_serving_llama

BLOCK_BYTES = 16 * 1 * 16 * 2 * 4  # a per-head block: 16 tokens x 1 KV head x dim 16 x K, V x fp32


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama(max_position_embeddings=1024)


@pytest.fixture(params=["reference", None], ids=["reference", "fastest"])
def backend(request):
    kvstack.hf.set_backend(request.param)
    try:
        yield request.param
    finally:
        kvstack.hf.set_backend(None)


def prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 256, (length,), generator=gen).tolist()


class Counted:
    """``attend_steady_decodes`` that counts the requests it attends (batched_rows)."""

    def __init__(self, real):
        self.real, self.rows = real, 0

    def __call__(self, layers, *args):
        self.rows += len(layers)
        return self.real(layers, *args)


def tables_of(handle, slots: bool = True) -> list[tuple]:
    """Everything a request's evicting layers hold: per layer its tables' liveness, live
    counts, slots, free lists and blocks (unless ``slots`` is False), the policy's state
    (scores by logical index), and the live tokens' K/V."""
    cache = handle.cache
    if cache is None:
        return []
    held = []
    for layer in cache.paged_layers:
        if not layer.is_initialized:
            continue
        batch = layer.batch
        where = (
            (
                batch.slots.tolist(),
                [list(free) for free in batch.free_slots],
                [list(blocks) for blocks in batch.blocks],
            )
            if slots
            else None
        )
        held.append(
            (
                batch.num_tokens,
                batch.alive.tolist(),
                list(batch.num_live),
                where,
                plain(layer.state, batch.num_tokens),
                live_kv(layer),
            )
        )
    return held


def live_kv(layer) -> list:
    """Every table's live K/V rows, in logical order (whatever slots hold them)."""
    _, live = layer.batch.live_view()  # [N, L] slots, -1 padding
    keys, values = layer.pool.read(live.clamp(min=0).flatten())  # [N * L, heads, D]
    real = (live >= 0).flatten()
    return [keys[real].tolist(), values[real].tolist()]


def plain(state, num_tokens: int):
    """A policy state as plain values: its per-token scores up to ``num_tokens``."""
    if isinstance(state, LogicalScores):
        return state.at(num_tokens, state.values.device).tolist()
    if isinstance(state, torch.Tensor):
        return state.tolist()
    if isinstance(state, dict):
        return {key: plain(value, num_tokens) for key, value in state.items()}
    return state


def side_by_side(
    model, spec, requests, monkeypatch, capacity_blocks=400, compact=False, path=evicting_decode
):
    """Run ``requests`` (ids, new tokens, arrival step) on two engines, the batched decode on
    in the first and off in the second; after every step the two must hold the same tables
    and scores. ``compact``: the batched engine's arena compacts after each request's slots
    are taken (as a later request's room may make it), so slots differ and only what they
    hold is compared. ``path``: the batched path whose rows are counted (``evicting_decode``
    or ``headwise_decode``). Returns (its row count, the handles of both)."""
    counted = Counted(path.attend_steady_decodes)
    monkeypatch.setattr(path, "attend_steady_decodes", counted)
    if compact:
        real_take = evicting_decode.take_slots

        def take_then_compact(layer):
            real_take(layer)
            layer.pool.arena.compact()

        monkeypatch.setattr(evicting_decode, "take_slots", take_then_compact)
    engines = [
        Engine(
            model,
            KVArena(capacity_blocks * BLOCK_BYTES),
            cache=spec,
            max_batch_tokens=48,
            prefill_chunk=16,
        )
        for _ in range(2)
    ]
    handles: list[list] = [[], []]
    step = 0
    while step == 0 or any(e.has_work() for e in engines):
        for which, serving in enumerate(engines):
            for ids, n, arrival in requests:
                if arrival == step:
                    handles[which].append(serving.submit(ids, n))
            with contextlib.nullcontext() if which == 0 else evicting_decode.general_path_only():
                serving.step()
        for mine, general in zip(*handles, strict=True):
            assert mine.output_ids == general.output_ids
            assert tables_of(mine, not compact) == tables_of(general, not compact)
        step += 1
        assert step < 500, "the engines made no progress"
    for serving in engines:
        assert serving.arena.bytes_used == 0
        serving.arena.check_invariants()
    return counted.rows, handles


@pytest.mark.parametrize(
    "policy, reclaim",
    [(H2O(), True), (H2O(), False), (H2O(sink_tokens=2, recent_fraction=0.25), True)],
    ids=["h2o", "h2o_naive", "h2o_sinks"],
)
def test_batched_decodes_leave_the_tables_and_scores_the_general_path_leaves(
    model, backend, policy, reclaim, monkeypatch
):
    # Prompts of different lengths (budgets 10 to 25 at ratio 0.5), arriving over steps, so
    # that decodes of different widths share steps with each other and with prefill chunks.
    requests = [(prompt(20 + 10 * i, 40 + i), 12, 2 * i) for i in range(4)]
    spec = CacheSpec(policy=policy, ratio=0.5, reclaim=reclaim)
    rows, handles = side_by_side(model, spec, requests, monkeypatch)
    # The prefill evicts down to the budget, so every decode step (each stores an output token
    # but the last) of every request ran batched, in every layer.
    decode_steps = sum(len(h.output_ids) - 1 for h in handles[0])
    layers = model.config.num_hidden_layers
    assert rows == decode_steps * layers


@pytest.mark.parametrize("window", [1, 4])
def test_snapkv_decodes_batched_keep_its_window_votes_and_pooling(
    model, backend, window, monkeypatch
):
    # Windows of 1 query close at every step; of 4, every fourth: both swaps are exercised.
    # Budgets of 12 to 20 tokens: rows of different widths pool beside each other's padding.
    requests = [(prompt(24 + 8 * i, 70 + i), 10, i) for i in range(3)]
    spec = CacheSpec(policy=SnapKV(window=window, kernel_size=3), ratio=0.5)
    rows, handles = side_by_side(model, spec, requests, monkeypatch)
    decode_steps = sum(len(h.output_ids) - 1 for h in handles[0])
    assert rows == decode_steps * model.config.num_hidden_layers


def test_a_compaction_between_requests_slots_moves_them_and_the_rows_follow(model, monkeypatch):
    # Requests that finish at different times leave holes, so compactions move blocks, slots
    # taken for this step's tokens among them; the tokens' K/V must land where their tables
    # say after the move.
    requests = [(prompt(20 + 9 * i, 110 + i), 4 + 3 * i, i) for i in range(4)]
    rows, moved = side_by_side_compacting(
        model, CacheSpec(policy=H2O(), ratio=0.5), requests, monkeypatch
    )
    assert rows > 0 and moved > 0  # batched steps, and compactions that moved blocks


def side_by_side_compacting(model, spec, requests, monkeypatch, path=evicting_decode):
    """``side_by_side(..., compact=True)``, counting what the compactions moved. Returns (the
    batched path's row count, the compactions that moved blocks)."""
    moved = []
    real_compact = KVArena.compact

    def counted(arena, **kwargs):
        before = arena.compactions
        real_compact(arena, **kwargs)
        moved.append(arena.compactions - before)

    monkeypatch.setattr(KVArena, "compact", counted)
    rows, _ = side_by_side(model, spec, requests, monkeypatch, compact=True, path=path)
    return rows, sum(moved)


class ScoresLikeH2OButOlderFirst(H2O):
    """A subclass that changes H2O's scores: it inherits the batched scores, not their meaning."""

    def scores(self, state, alive):
        return -super().scores(state, alive)


def test_a_subclass_that_changes_what_the_batched_scores_stand_for_keeps_the_general_path(
    model, monkeypatch
):
    requests = [(prompt(24 + 8 * i, 80 + i), 6, 0) for i in range(3)]
    spec = CacheSpec(policy=ScoresLikeH2OButOlderFirst(), ratio=0.5)
    rows, _ = side_by_side(model, spec, requests, monkeypatch)
    assert rows == 0


def test_a_policy_without_a_batched_decode_keeps_the_general_path(model, monkeypatch):
    requests = [(prompt(24 + 8 * i, 75 + i), 6, 0) for i in range(3)]
    spec = CacheSpec(policy=TOVA(), ratio=0.5)
    rows, _ = side_by_side(model, spec, requests, monkeypatch)
    assert rows == 0


def test_a_table_below_its_budget_keeps_the_general_path_until_it_reaches_it(model, monkeypatch):
    # A budget of 40 tokens and prompts of 20 and 30: the tables fill by decoding, evict
    # nothing until they hold 40, and only then are batched.
    requests = [(prompt(20, 90), 24, 0), (prompt(30, 91), 14, 0)]
    spec = CacheSpec(policy=H2O(), budget=40)
    rows, handles = side_by_side(model, spec, requests, monkeypatch)
    layers = model.config.num_hidden_layers
    # Request 0 reaches 40 tokens after its 20th new token is stored, request 1 after its 10th:
    # decode steps that store tokens 41.. are batched.
    batched_steps = (20 + 23 - 40) + (30 + 13 - 40)
    assert rows == batched_steps * layers


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(4, 60), st.integers(1, 10), st.integers(0, 6)), min_size=1, max_size=4
    ),
    ratio=st.sampled_from([0.3, 0.5, 1.0]),
    sinks=st.integers(0, 2),
    seed=st.integers(0, 1000),
)
def test_random_requests_batched_or_not_hold_the_same_tables(model, lengths, ratio, sinks, seed):
    with pytest.MonkeyPatch.context() as monkeypatch:
        kvstack.hf.set_backend("reference")
        try:
            requests = [(prompt(p, seed + i), n, a) for i, (p, n, a) in enumerate(lengths)]
            spec = CacheSpec(policy=H2O(sink_tokens=sinks), ratio=ratio)
            side_by_side(model, spec, requests, monkeypatch)
        finally:
            kvstack.hf.set_backend(None)
