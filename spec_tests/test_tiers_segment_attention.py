"""Multi-segment attention's adapter in TieredCache (AsymCache), without a model: keys split
into segments by a random assignment of positions (holes, any order, empty ones left out) give
what sdpa gives over all keys in order, and the scores of keys in segments are the scores of the
keys in order. Apart from test_tiers_segments.py because nothing here depends on transformers:
the oldest-transformers pass of `make test` need not run it twice."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack.tiers import attention as tiers_attention


@settings(deadline=None, max_examples=30)
@given(
    batch=st.integers(1, 2),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    seen=st.integers(1, 40),
    t_q=st.integers(1, 6),
    parts=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_segment_attention_equals_causal_attention_over_the_union(
    batch, kv_heads, group, seen, t_q, parts, seed, dtype
):
    """Keys split into up to four segments by a random assignment of positions (so a segment's
    positions have holes, and segments may come in any order; an empty one is left out, as the
    cache does), against sdpa over all keys in order with the causal mask of the step's
    newest ``t_q`` queries."""
    t_q = min(t_q, seen)
    generator = torch.Generator().manual_seed(seed)
    heads, dim = kv_heads * group, 8
    query = torch.randn(batch, heads, t_q, dim, generator=generator).to(dtype)
    keys = torch.randn(batch, kv_heads, seen, dim, generator=generator).to(dtype)
    values = torch.randn(batch, kv_heads, seen, dim, generator=generator).to(dtype)
    owner = torch.randint(0, parts, (seen,), generator=generator)
    order = torch.randperm(parts, generator=generator).tolist()
    segments = []
    for part in order:
        positions = (owner == part).nonzero()[:, 0]
        positions = positions[torch.randperm(len(positions), generator=generator)]  # any order
        if len(positions):
            segments.append(
                tiers_attention.Segment(
                    f"part{part}",
                    keys[:, :, positions].transpose(1, 2).contiguous(),  # [B, T_s, H, D]
                    values[:, :, positions].transpose(1, 2).contiguous(),
                    positions,
                )
            )
    got = tiers_attention.segment_attention(query, segments, seen, 0.4)  # [B, T_q, H, D]
    causal = torch.arange(seen)[None, :] <= torch.arange(seen - t_q, seen)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(),
        keys.float().repeat_interleave(group, dim=1),
        values.float().repeat_interleave(group, dim=1),
        attn_mask=causal,
        scale=0.4,
    ).transpose(1, 2)
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == (batch, t_q, heads, dim)
    torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


@settings(deadline=None, max_examples=20)
@given(
    seen=st.integers(1, 50),
    t_q=st.integers(1, 40),
    parts=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_scores_of_keys_in_segments_equal_the_scores_of_the_keys_in_order(seen, t_q, parts, seed):
    t_q = min(t_q, seen)
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(2, 6, t_q, 8, generator=generator)
    key = torch.randn(2, 3, seen, 8, generator=generator)
    owner = torch.randint(0, parts, (seen,), generator=generator)
    pieces = []
    for part in torch.randperm(parts, generator=generator).tolist():
        positions = (owner == part).nonzero()[:, 0]
        if len(positions):
            pieces.append((key[:, :, positions], positions))
    expected = tiers_attention.key_attention_mass(query, key, 0.3)
    got = tiers_attention.segments_attention_mass(query, pieces, seen, 0.3)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(-1), torch.ones(2))
