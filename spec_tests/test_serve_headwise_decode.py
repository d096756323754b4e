"""The engine's batched decode of head-wise requests (``kvstack.serve.headwise_decode``) is the
general path's work, fused across requests: after every step each request's token tables
(slots, liveness, free lists, blocks), its policy state and its live K/V are the ones the
general path leaves, and each request gets the same tokens.

Both engines run the same requests side by side (``test_serve_evicting_decode.side_by_side``);
the general one has the batched paths switched off. Random tiny Llama models (fp32, CPU), on the
reference attention and on the fastest backend here.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstack.hf
from kvstack.policies import H2O, SnapKV
from kvstack.serve import CacheSpec, headwise_decode
from spec_tests.test_serve_engine import TINY_PROFILE
from spec_tests.test_serve_evicting_decode import prompt, side_by_side, side_by_side_compacting
from spec_tests.tiny import tiny_serving_llama


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama(max_position_embeddings=1024)  # TINY_PROFILE's model


@pytest.fixture(params=["reference", None], ids=["reference", "fastest"])
def backend(request):
    kvstack.hf.set_backend(request.param)
    try:
        yield request.param
    finally:
        kvstack.hf.set_backend(None)


SPEC = CacheSpec(policy=SnapKV(window=4, kernel_size=3), profile=TINY_PROFILE)


def decode_rows(handles, layers: int) -> int:
    """Layer steps that store a decode token: every output token but the last, in every layer
    (the prompt is compressed as its last chunk is attended, so every decode is past it)."""
    return sum(len(h.output_ids) - 1 for h in handles) * layers


def test_batched_headwise_decodes_leave_the_tables_the_general_path_leaves(
    model, backend, monkeypatch
):
    # Prompts of different lengths arriving over steps: decodes of tables of different widths
    # (each head at its own budget) share steps with each other and with prefill chunks.
    requests = [(prompt(20 + 11 * i, 140 + i), 10, 2 * i) for i in range(4)]
    rows, handles = side_by_side(model, SPEC, requests, monkeypatch, path=headwise_decode)
    assert rows == decode_rows(handles[0], model.config.num_hidden_layers)


def test_a_compaction_between_requests_slots_moves_them_and_the_rows_follow(model, monkeypatch):
    requests = [(prompt(20 + 9 * i, 150 + i), 4 + 3 * i, i) for i in range(4)]
    rows, moved = side_by_side_compacting(model, SPEC, requests, monkeypatch, path=headwise_decode)
    assert rows > 0 and moved > 0  # batched steps, and compactions that moved blocks


def test_a_prompt_of_one_chunk_and_a_one_token_last_chunk_share_steps_with_batched_decodes(
    model, monkeypatch
):
    # A 17-token prompt ends in a one-token chunk (prefill_chunk 16): that step's one-token
    # segment is a prompt's, attended on the general path with its weights observed, beside
    # the batched decodes of the requests that came before it.
    requests = [(prompt(30, 160), 12, 0), (prompt(40, 161), 12, 0), (prompt(17, 162), 6, 3)]
    rows, handles = side_by_side(model, SPEC, requests, monkeypatch, path=headwise_decode)
    assert rows == decode_rows(handles[0], model.config.num_hidden_layers)


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(
        st.tuples(st.integers(4, 60), st.integers(1, 10), st.integers(0, 6)), min_size=1, max_size=4
    ),
    budgets=st.lists(st.sampled_from([0.05, 0.3, 0.6, 1.0]), min_size=4, max_size=4),
    h2o=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_headwise_requests_batched_or_not_hold_the_same_tables(
    model, lengths, budgets, h2o, seed
):
    profile = dataclasses.replace(TINY_PROFILE, budgets=(tuple(budgets[:2]), tuple(budgets[2:])))
    policy = H2O() if h2o else SnapKV(window=4, kernel_size=3)
    with pytest.MonkeyPatch.context() as monkeypatch:
        kvstack.hf.set_backend("reference")
        try:
            requests = [(prompt(p, seed + i), n, a) for i, (p, n, a) in enumerate(lengths)]
            spec = CacheSpec(policy=policy, profile=profile)
            rows, handles = side_by_side(model, spec, requests, monkeypatch, path=headwise_decode)
            assert rows == decode_rows(handles[0], model.config.num_hidden_layers)
        finally:
            kvstack.hf.set_backend(None)
