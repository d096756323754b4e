"""Adaptive chunking: the step-time line, the budget it gives, and an engine that fills each
step to that budget (decodes first) without changing any request's tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.serve import Engine
from kvstack.serve.chunking import StepTimeModel
from spec_tests.test_serve_engine import BLOCK_BYTES, PREFILL_CHUNK, SPECS, prompt, solo
from spec_tests.tiny import tiny_serving_llama

pytestmark = pytest.mark.usefixtures("reference_attention")


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


def test_the_budget_is_clamped_and_waits_for_steps_that_separate_the_costs():
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
    for _ in range(4):  # the history forgets the old steps
        times.observe(1, 0, 0.01)
    assert times.costs() is None


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


class _FixedBudget:
    """Step costs that always allow ``tokens`` prefill tokens (the engine's clamps kept)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        pass

    def prefill_budget(self, target: float, decodes: int, min_prefill: int, max_tokens: int):
        return min(max(0, max_tokens - decodes), max(min_prefill, self.tokens))


@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    spec_name=st.sampled_from(["paged", "h2o"]),
    lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(4, 30)), min_size=2, max_size=4),
    allowed=st.integers(1, 48),
)
def test_each_step_takes_its_decodes_first_within_the_budget_and_tokens_do_not_change(
    model, spec_name, lengths, allowed
):
    serving = Engine(
        model,
        KVArena(96 * BLOCK_BYTES),
        cache=SPECS[spec_name],
        max_batch_tokens=48,
        prefill_chunk=PREFILL_CHUNK,
        step_time_target=0.05,
    )
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
