"""Chunked RoPE (InferScale): re-rotation by a delta equals direct rotation at the new position,
and rotating pre-RoPE keys equals what the Hugging Face model itself does, for the rope types
whose frequencies do not depend on sequence length (default, linear, llama3, yarn)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvstack import ops
from spec_tests.strategies import ROPE_PARAMETERS, rotary_embedding

ROPE_TYPES = sorted(ROPE_PARAMETERS)


@st.composite
def keys_and_positions(draw):
    head_dim = draw(st.sampled_from([8, 32, 64]))
    tokens, heads = draw(st.integers(1, 32)), draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(tokens, heads, head_dim, generator=gen)
    positions = torch.randint(0, 2048, (tokens,), generator=gen)
    delta = torch.randint(-positions.min().item(), 2048, (tokens,), generator=gen)
    return keys, positions, delta


@pytest.mark.parametrize("backend", ["reference", "compiled"])
@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@given(drawn=keys_and_positions())
def test_rerotation_equals_direct_rotation(backend, rope_type, drawn):
    keys, positions, delta = drawn
    emb = rotary_embedding(rope_type, keys.shape[-1])
    rotate, rerotate = ops.get("rotate_keys", backend), ops.get("rerotate_keys", backend)
    moved = rerotate(rotate(keys, positions, emb), delta, emb)
    direct = rotate(keys, positions + delta, emb)
    # float32 angles at positions up to 4k: p * theta carries ~4e-4 absolute error per angle.
    torch.testing.assert_close(moved, direct, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
@given(drawn=keys_and_positions())
def test_rotate_keys_equals_the_models_own_rotation(rope_type, drawn):
    keys, positions, _ = drawn
    emb = rotary_embedding(rope_type, keys.shape[-1])
    cos, sin = emb(keys, positions[None, :])  # [1, T, D], includes attention_scaling
    as_hf = keys.transpose(0, 1)[None]  # [1, H, T, D]: Hugging Face's layout
    _, expected = apply_rotary_pos_emb(as_hf, as_hf, cos, sin)
    got = ops.get("rotate_keys", "reference")(keys, positions, emb)
    torch.testing.assert_close(got, expected[0].transpose(0, 1), atol=1e-6, rtol=1e-5)


def test_rerotation_by_zero_is_identity_even_with_attention_scaling():
    emb = rotary_embedding("yarn", 32)
    assert emb.attention_scaling != 1.0  # yarn: the case where dividing it out matters
    keys = torch.randn(5, 2, 32)
    got = ops.get("rerotate_keys", "reference")(keys, torch.zeros(5, dtype=torch.int64), emb)
    torch.testing.assert_close(got, keys, atol=1e-6, rtol=1e-6)
