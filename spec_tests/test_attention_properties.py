"""Properties of the attention reference itself, checked against independent formulations.

* ``paged_attention`` over a scattered token table equals torch's SDPA over the same live tokens
  laid out contiguously, with the causal-by-position mask written as a dense boolean mask.
* Multi-segment attention (AsymCache): attention over several segments, merged by log-sum-exp,
  equals attention over their union, for every backend, whatever the cut points and even when a
  segment is empty or lives in another pool.
* Merging is commutative and an empty segment (lse = -inf) is the identity.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from kvstack import ops
from kvstack.reference import merge_attention_states, paged_attention
from spec_tests.strategies import TOLERANCES, attention_cases


def dense_attention(case):
    """SDPA per sequence on contiguous copies of the live tokens; lse from the dense scores."""
    batch, t_q, h_q, head_dim = case.query.shape
    h_kv = case.key_cache.shape[2]
    key_rows = case.key_cache.reshape(-1, h_kv, head_dim)
    value_rows = case.value_cache.reshape(-1, h_kv, head_dim)
    outs, lses = [], []
    for b in range(batch):
        valid = case.slots[b] >= 0
        keys = key_rows[case.slots[b][valid]].float().transpose(0, 1)  # [H_kv, L, D]
        values = value_rows[case.slots[b][valid]].float().transpose(0, 1)
        keys = keys.repeat_interleave(h_q // h_kv, dim=0)  # [H_q, L, D]
        values = values.repeat_interleave(h_q // h_kv, dim=0)
        key_pos, query_pos = case.key_positions[b][valid][None, :], case.query_positions[b][:, None]
        mask = key_pos <= query_pos  # [T_q, L]
        if case.window is not None:
            mask &= key_pos > query_pos - case.window
        query = case.query[b].float().transpose(0, 1)  # [H_q, T_q, D]
        seen = mask.any(-1)  # SDPA gives NaN for a row that sees nothing; the rule says 0
        out = torch.zeros(h_q, t_q, head_dim)
        if seen.any():
            out[:, seen] = F.scaled_dot_product_attention(
                query[:, seen], keys, values, attn_mask=mask[seen]
            )
        scores = (query @ keys.transpose(-1, -2)) / math.sqrt(head_dim)
        lse = torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1)  # [H_q, T_q]
        outs.append(out.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.stack(outs), torch.stack(lses)


@given(attention_cases(windows=True))
def test_reference_equals_dense_sdpa_over_live_tokens(case):
    expected_out, expected_lse = dense_attention(case)
    got = paged_attention(*case.args(), **case.kwargs())
    atol, rtol = TOLERANCES[case.query.dtype]
    torch.testing.assert_close(got.out.float(), expected_out, atol=atol, rtol=rtol)
    assert torch.equal(got.lse == -math.inf, expected_lse == -math.inf)
    finite = expected_lse > -math.inf
    torch.testing.assert_close(got.lse[finite], expected_lse[finite], atol=1e-4, rtol=1e-5)


@given(attention_cases(windows=True))
def test_weights_are_a_distribution_over_visible_tokens(case):
    got = paged_attention(*case.args(), **case.kwargs(), return_weights=True)
    sums = got.weights.sum(-1)  # [B, H_q, T_q]
    seen = (got.lse > -math.inf).permute(0, 2, 1)
    torch.testing.assert_close(sums[seen], torch.ones_like(sums[seen]), atol=1e-5, rtol=0)
    assert torch.all(sums[~seen] == 0)
    padding = (case.slots < 0)[:, None, None, :].expand_as(got.weights)
    assert torch.all(got.weights[padding] == 0)


@pytest.mark.parametrize("backend", ["reference", "compiled"])
@given(case=attention_cases(), data=st.data())
def test_multi_segment_attention_equals_attention_over_union(backend, case, data):
    attention = ops.get("paged_attention", backend)
    multi_segment = ops.get("multi_segment_attention", backend)
    t_k = case.slots.shape[1]
    cuts = sorted(data.draw(st.lists(st.integers(0, t_k), max_size=3)))
    bounds = [0, *cuts, t_k]
    segments = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        # Each segment gets its own pool holding only its rows: segments need not share memory.
        slots = case.slots[:, a:b]
        own = slots[slots >= 0]
        key_cache, value_cache = (
            torch.zeros_like(case.key_cache),
            torch.zeros_like(case.value_cache),
        )
        key_cache.view(-1, *key_cache.shape[2:])[own] = case.key_cache.view(
            -1, *key_cache.shape[2:]
        )[own]
        value_cache.view(-1, *value_cache.shape[2:])[own] = case.value_cache.view(
            -1, *value_cache.shape[2:]
        )[own]
        segments.append((key_cache, value_cache, slots, case.key_positions[:, a:b]))
    union = attention(*case.args())
    merged = multi_segment(case.query, segments, case.query_positions)
    atol, rtol = TOLERANCES[case.query.dtype]
    torch.testing.assert_close(merged.out.float(), union.out.float(), atol=atol, rtol=rtol)
    assert torch.equal(merged.lse == -math.inf, union.lse == -math.inf)
    finite = union.lse > -math.inf
    torch.testing.assert_close(merged.lse[finite], union.lse[finite], atol=1e-4, rtol=1e-5)


@given(st.integers(0, 2**31 - 1), st.integers(2, 4))
def test_merge_is_commutative_and_empty_is_identity(seed, count):
    gen = torch.Generator().manual_seed(seed)
    outputs = [torch.randn(3, 2, 8, generator=gen) for _ in range(count)]
    lses = [5 * torch.randn(3, 2, generator=gen) for _ in range(count)]
    out, lse = merge_attention_states(outputs, lses)
    out_rev, lse_rev = merge_attention_states(outputs[::-1], lses[::-1])
    torch.testing.assert_close(out_rev, out)
    torch.testing.assert_close(lse_rev, lse)
    empty_out, empty_lse = torch.zeros(3, 2, 8), torch.full((3, 2), -math.inf)
    out_e, lse_e = merge_attention_states([*outputs, empty_out], [*lses, empty_lse])
    torch.testing.assert_close(out_e, out, atol=0, rtol=0)
    torch.testing.assert_close(lse_e, lse, atol=0, rtol=0)
    none_out, none_lse = merge_attention_states([empty_out, empty_out], [empty_lse, empty_lse])
    assert torch.all(none_out == 0) and torch.all(none_lse == -math.inf)
