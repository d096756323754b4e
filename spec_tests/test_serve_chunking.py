"""Adaptive chunking: the step-time line, the budget it gives, and an engine that fills each
step to that budget (decodes first) without changing any request's tokens; the TPOT target's
slack, and an engine that lets prefill into a step only within it."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.serve import Engine
from kvstack.serve import engine as engine_module
from kvstack.serve.chunking import StepTimeModel, tpot_slack
from kvstack.serve.request import RequestStats
from spec_tests.test_serve_engine import BLOCK_BYTES, PREFILL_CHUNK, SPECS, prompt, solo
from spec_tests.tiny import tiny_serving_llama

pytestmark = pytest.mark.usefixtures("reference_attention")


# Hypothesis runs of whole engine traces: slow examples, and the module's model shared by all.
ENGINE_RUNS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# (prompt tokens, new tokens) of 2 to 4 requests.
TRACE_LENGTHS = st.lists(st.tuples(st.integers(1, 60), st.integers(4, 30)), min_size=2, max_size=4)


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama(max_position_embeddings=1024)  # test_serve_engine's model


@given(
    fixed=st.floats(0.0, 0.1),
    per_decode=st.floats(1e-4, 5e-2),
    per_prefill=st.floats(1e-5, 1e-2),
    steps=st.lists(
        st.tuples(st.integers(0, 32), st.integers(0, 512)).filter(lambda s: sum(s) > 0),
        min_size=3,
        max_size=40,
    ),
)
def test_exact_step_times_give_back_their_costs(fixed, per_decode, per_prefill, steps):
    times = StepTimeModel()
    for decodes, prefill in steps:
        times.observe(decodes, prefill, fixed + per_decode * decodes + per_prefill * prefill)
    costs = times.costs()
    rank = int(
        torch.linalg.matrix_rank(torch.tensor([[1.0, d, p] for d, p in steps], dtype=torch.float64))
    )
    if rank < 3:  # the steps cannot tell the parts apart: no budget from them
        assert costs is None and times.prefill_budget(1.0, 4, 16, 512) == 508
        return
    assert costs == pytest.approx((fixed, per_decode, per_prefill), rel=1e-6, abs=1e-9)
    target = fixed + per_decode * 3 + per_prefill * 100
    assert times.prefill_budget(target, 3, 1, 10_000) in (99, 100)  # floor of inexact floats


def test_the_budget_is_clamped_and_waits_for_steps_that_separate_the_costs_then_keeps_them():
    times = StepTimeModel(history=4)
    assert times.costs() is None and times.prefill_budget(0.05, 4, 16, 512) == 508
    times.observe(2, 0, 0.05)
    times.observe(4, 0, 0.09)
    times.observe(6, 0, 0.13)
    assert times.costs() is None  # decode-only steps: the prefill cost is unknown
    times.observe(2, 100, 0.15)  # 10 ms fixed, 20 ms a decode, 1 ms a prefill token
    assert times.costs() == pytest.approx((0.01, 0.02, 0.001))
    assert times.prefill_budget(0.2, 5, 16, 512) == 90
    assert times.prefill_budget(0.001, 5, 16, 512) == 16  # prefill always progresses
    assert times.prefill_budget(10.0, 5, 16, 512) == 507  # never past max_batch_tokens
    assert times.prefill_budget(0.001, 510, 16, 512) == 2
    for _ in range(4):  # a window of decode-only steps cannot fit: the last fit stays
        times.observe(1, 0, 0.01)
    assert times.costs() == pytest.approx((0.01, 0.02, 0.001))
    for decodes, prefill in [(1, 0), (2, 0), (1, 10), (3, 20)]:  # the old steps are forgotten
        times.observe(decodes, prefill, 0.1 + 0.05 * decodes + 0.002 * prefill)
    assert times.costs() == pytest.approx((0.1, 0.05, 0.002))


def test_a_step_never_gets_cheaper_with_more_tokens():
    times = StepTimeModel()
    for decodes, prefill, seconds in [(1, 10, 0.05), (1, 100, 0.01), (4, 10, 0.02), (2, 50, 0.03)]:
        times.observe(decodes, prefill, seconds)  # noise: bigger steps ran faster
    fixed, per_decode, per_prefill = times.costs()
    assert per_decode > 0 and per_prefill > 0 and fixed >= 0


@pytest.mark.parametrize(
    ("decodes", "prefill", "seconds"),
    [(0, 0, 0.1), (-1, 5, 0.1), (1, -5, 0.1), (1, 5, -0.1), (1, 5, float("nan"))],
)
def test_a_bad_observation_is_refused_and_not_kept(decodes, prefill, seconds):
    times = StepTimeModel()
    with pytest.raises(InvalidArgumentError, match="decodes|seconds"):
        times.observe(decodes, prefill, seconds)
    assert times.costs() is None and "0 steps" in repr(times)


def _small_engine(model, spec_name: str, **targets) -> Engine:
    """An engine of 96 blocks and 48-token steps, with the given time targets."""
    return Engine(
        model,
        KVArena(96 * BLOCK_BYTES),
        cache=SPECS[spec_name],
        max_batch_tokens=48,
        prefill_chunk=PREFILL_CHUNK,
        **targets,
    )


class _FixedBudget:
    """Step costs that always allow ``tokens`` prefill tokens (the engine's clamps kept)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        pass

    def prefill_budget(self, target: float, decodes: int, min_prefill: int, max_tokens: int):
        return min(max(0, max_tokens - decodes), max(min_prefill, self.tokens))


@settings(max_examples=8, **ENGINE_RUNS)
@given(
    spec_name=st.sampled_from(["paged", "h2o"]),
    lengths=TRACE_LENGTHS,
    allowed=st.integers(1, 48),
)
def test_each_step_takes_its_decodes_first_within_the_budget_and_tokens_do_not_change(
    model, spec_name, lengths, allowed
):
    serving = _small_engine(model, spec_name, step_time_target=0.05)
    serving.step_times = _FixedBudget(allowed)
    requests = [(prompt(p, seed=70 + i), n) for i, (p, n) in enumerate(lengths)]
    handles = [serving.submit(ids, n) for ids, n in requests]
    batches = []
    choose = serving._choose_batch

    def recording():
        batch = choose()
        batches.append([(work.kind, work.tokens) for work in batch])
        return batch

    serving._choose_batch = recording
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]
    for batch in batches:
        kinds = [kind for kind, _ in batch]
        decodes = kinds.count("decode")
        # Decodes first (with at most 4 requests they always leave room for a prefill piece).
        assert kinds == ["decode"] * decodes + ["prefill"] * (len(kinds) - decodes)
        # Within the budget (a prefill piece of at most a block or chunk always fits).
        assert sum(tokens for _, tokens in batch) <= min(48, decodes + max(16, allowed))
    assert serving.arena.bytes_used == 0


@pytest.mark.parametrize("spec_name", ["paged", "h2o"])
@pytest.mark.parametrize("target", [1e-9, 1e6])
def test_any_target_serves_every_request_its_solo_tokens(model, spec_name, target):
    # The fitted costs drive the budget; a target no step can meet still prefills a piece per
    # step, even where one chunk is the whole step budget (prefill_chunk == max_batch_tokens),
    # and one every step meets takes the whole budget. Swapping too, where the cache allows.
    requests = [(prompt(20 + 9 * i, seed=90 + i), 12 + 3 * i) for i in range(4)]
    serving = Engine(
        model,
        KVArena(24 * BLOCK_BYTES),
        cache=SPECS[spec_name],
        max_batch_tokens=PREFILL_CHUNK,
        prefill_chunk=PREFILL_CHUNK,
        step_time_target=target,
        swap_bytes="1MiB" if spec_name == "paged" else None,
    )
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]
    assert serving.step_times.costs() is not None  # the steps varied enough to fit the costs
    assert serving.arena.bytes_used == 0


def test_a_bad_step_time_target_is_refused(model):
    for bad in (0, -1.0, float("nan"), "fast", True):
        with pytest.raises(InvalidArgumentError, match="step_time_target"):
            Engine(model, KVArena(64 * BLOCK_BYTES), step_time_target=bad)


@given(
    target=st.floats(1e-3, 1.0),
    decoding=st.lists(
        st.tuples(st.integers(1, 200), st.floats(0.0, 50.0), st.booleans()), max_size=6
    ),
)
def test_the_tpot_slack_is_the_most_any_decoding_request_can_spare(target, decoding):
    now = 100.0
    stats = [
        RequestStats(submitted_at=0.0, first_token_at=now - elapsed if started else None, tokens=n)
        for n, elapsed, started in decoding
    ]
    slack = tpot_slack(target, stats, now)
    started = [s for s in stats if s.first_token_at is not None]
    if not started:
        assert slack is None
        return
    # A step of exactly the slack keeps every request within the target at its next token
    # (TPOT then counts its tokens - 1 + 1 gaps since the first) and puts one exactly on it.
    tpots = [(now + slack - s.first_token_at) / s.tokens for s in started]
    assert max(tpots) == pytest.approx(target, rel=1e-9, abs=1e-9)


class _FixedCosts(StepTimeModel):
    """Step costs fixed by the test, whatever the steps really took."""

    def __init__(self, fixed: float, per_decode: float, per_prefill: float) -> None:
        super().__init__()
        self.fixed_costs = (fixed, per_decode, per_prefill)

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        pass

    def costs(self) -> tuple[float, float, float]:
        return self.fixed_costs

    def seconds(self, decodes: int, prefill_tokens: int) -> float:
        fixed, per_decode, per_prefill = self.fixed_costs
        return fixed + per_decode * decodes + per_prefill * prefill_tokens


def _recorded_tpot_run(model, spec_name, requests, costs, target, monkeypatch, step_target=None):
    """Run ``requests`` on an engine with ``tpot_target=target`` (and ``step_time_target``) and
    fixed step ``costs`` (None: the engine's own); returns the engine, the handles and, per
    chosen batch, (decodes, prefill tokens, the slack the engine computed for it or None).
    Checks that the slack came from the stats of exactly the batch's decoding requests, at the
    time the batch was chosen."""
    serving = _small_engine(model, spec_name, tpot_target=target, step_time_target=step_target)
    if costs is not None:  # else the engine's own fitted model, unfitted at first
        serving.step_times = _FixedCosts(*costs)
    slacks = []

    def recording_slack(target_seconds, decoding, now):
        decoding = list(decoding)
        slacks.append((tpot_slack(target_seconds, decoding, now), decoding, now))
        return slacks[-1][0]

    monkeypatch.setattr(engine_module, "tpot_slack", recording_slack)
    handles = [serving.submit(ids, n) for ids, n in requests]
    batches = []
    choose = serving._choose_batch

    def recording():
        seen, before = len(slacks), time.perf_counter()
        batch = choose()
        after = time.perf_counter()
        decoding = [work.request.stats for work in batch if work.kind == "decode"]
        slack = None
        if len(slacks) > seen:
            slack, passed, now = slacks[-1]
            assert before <= now <= after
            assert sorted(map(id, passed)) == sorted(map(id, decoding))
        decodes = len(decoding)
        prefill = sum(work.tokens for work in batch if work.kind != "decode")
        batches.append((decodes, prefill, slack))
        return batch

    serving._choose_batch = recording
    serving.run()
    assert serving.arena.bytes_used == 0
    return serving, handles, batches


@settings(max_examples=6, **ENGINE_RUNS)
@given(
    spec_name=st.sampled_from(["paged", "h2o"]),
    lengths=TRACE_LENGTHS,
    per_prefill=st.sampled_from([1e-9, 0.004, 0.01, 10.0]),
)
def test_prefill_joins_a_step_only_within_the_decodes_tpot_slack_and_tokens_do_not_change(
    model, spec_name, lengths, per_prefill, monkeypatch
):
    # A 0.3 s target against a 16-token piece of 16 prefill * per_prefill seconds: from always
    # fitting to never; the tiny model's real steps take milliseconds, so the slack grows.
    requests = [(prompt(p, seed=110 + i), n) for i, (p, n) in enumerate(lengths)]
    serving, handles, batches = _recorded_tpot_run(
        model, spec_name, requests, (0.001, 0.002, per_prefill), 0.3, monkeypatch
    )
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]
    for decodes, prefill, slack in batches:
        if decodes and prefill:  # a step that makes decoding requests wait for a prefill
            assert slack is not None
            assert serving.step_times.seconds(decodes, prefill) <= slack + 1e-9
    if per_prefill == 10.0:  # no prefill piece ever fits beside a decode
        assert not any(decodes and prefill for decodes, prefill, _ in batches)


def test_where_every_step_meets_the_target_the_same_requests_mix_prefill_into_decodes(
    model, monkeypatch
):
    # The check above is not vacuous: these requests do overlap, and a target every step meets
    # (a prefill token costing nothing) lets their prefill into the decodes' steps.
    requests = [(prompt(30 + 11 * i, seed=120 + i), 12) for i in range(3)]
    _, handles, batches = _recorded_tpot_run(
        model, "h2o", requests, (0.0, 1e-9, 1e-9), 0.3, monkeypatch
    )
    assert any(decodes and prefill for decodes, prefill, _ in batches)
    assert [h.output_ids for h in handles] == [solo(model, "h2o", i, n) for i, n in requests]


def test_a_bad_tpot_target_is_refused(model):
    for bad in (0, -1.0, float("nan"), "fast", True):
        with pytest.raises(InvalidArgumentError, match="tpot_target"):
            Engine(model, KVArena(64 * BLOCK_BYTES), tpot_target=bad)


def test_with_a_step_time_target_too_both_hold(model, monkeypatch):
    # A prefill token costs next to nothing, so the TPOT target alone would let prefill into the
    # decodes' steps (the test above); a step time no step can meet holds it back from them,
    # while prefill alone still progresses a piece a step (no decodes: the step target's rule).
    requests = [(prompt(30 + 11 * i, seed=120 + i), 12) for i in range(3)]
    _, handles, batches = _recorded_tpot_run(
        model, "h2o", requests, (0.0, 1e-9, 1e-9), 0.3, monkeypatch, step_target=1e-12
    )
    assert not any(decodes and prefill for decodes, prefill, _ in batches)
    assert [h.output_ids for h in handles] == [solo(model, "h2o", i, n) for i, n in requests]


def test_a_decode_only_window_keeps_the_last_fit():
    # While a TPOT target holds prefill back, the steps are decode-only and cannot fit the
    # prefill cost; the last fit stays, so the wait does not turn the limit off (without it,
    # 64 such steps would leave no fit, and an unfitted model lets any prefill in).
    times = StepTimeModel()
    times.observe(1, 100, 0.51)  # no fixed part, 10 ms a decode, 5 ms a prefill token
    times.observe(2, 0, 0.02)
    times.observe(1, 50, 0.26)
    assert times.costs() == pytest.approx((0.0, 0.01, 0.005), abs=1e-9)
    for _ in range(times.history):
        times.observe(1, 0, 0.01)
    assert times.costs() == pytest.approx((0.0, 0.01, 0.005), abs=1e-9)
    assert times.prefill_budget(0.0525, 1, 0, 512) == 8  # (0.0525 - 0.01) / 0.005 = 8.5
    assert times.prefill_budget(-0.1, 1, 0, 512) == 0  # no slack: nothing joins


@pytest.mark.parametrize("spec_name", ["paged", "h2o"])
def test_a_target_no_step_can_meet_keeps_prefill_out_of_decode_steps_fitted_or_not(
    model, spec_name, monkeypatch
):
    # The engine's own step model: unfitted for the first steps (no costs: only the sign of the
    # slack can hold prefill back), fitted after. Every decode step has spent more than 1 us per
    # token, so no prefill ever joins one, and every request still ends with its solo tokens.
    requests = [(prompt(25 + 13 * i, seed=130 + i), 10) for i in range(3)]
    serving, handles, batches = _recorded_tpot_run(
        model, spec_name, requests, None, 1e-6, monkeypatch
    )
    assert not any(decodes and prefill for decodes, prefill, _ in batches)
    assert any(prefill for _, prefill, _ in batches[1:])  # prefill went on between decodes
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]
