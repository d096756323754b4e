"""Hypothesis strategies shared by the spec tests: shapes, token tables and attention inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st

TOLERANCES = {
    # (atol, rtol). Every implementation accumulates in float32; bf16 differs from the reference
    # only by the final rounding of out to bf16 (half an ulp, 2^-9 relative) plus float32
    # reordering, so one bf16 ulp of slack is a tight bound.
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (1e-2, 1.6e-2),
}

dtypes = st.sampled_from([torch.float32, torch.bfloat16])


@dataclass
class AttentionCase:
    query: torch.Tensor  # [B, T_q, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, H_kv, D]
    value_cache: torch.Tensor
    slots: torch.Tensor  # [B, T_k], -1 padded
    key_positions: torch.Tensor  # [B, T_k]
    query_positions: torch.Tensor  # [B, T_q]
    window: int | None = None  # sliding window (keyword argument of paged_attention)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.slots,
            self.key_positions,
            self.query_positions,
        )

    def kwargs(self) -> dict:
        return {} if self.window is None else {"window": self.window}

    def __repr__(self) -> str:
        b, t_q, h_q, d = self.query.shape
        return (
            f"AttentionCase(B={b}, T_q={t_q}, H_q={h_q}, H_kv={self.key_cache.shape[2]}, D={d}, "
            f"block_size={self.key_cache.shape[1]}, dtype={self.query.dtype}, "
            f"lengths={(self.slots >= 0).sum(1).tolist()}, window={self.window})"
        )


@st.composite
def attention_cases(
    draw, *, max_tokens: int = 80, max_query: int = 6, device: str = "cpu", windows: bool = False
):
    """Ragged sequences whose live tokens sit in shuffled slots of one pool, with random
    evictions (gaps in positions), GQA ratios 1-4 and block sizes 1-64."""
    batch = draw(st.integers(1, 3))
    h_kv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    block_size = draw(st.sampled_from([1, 2, 3, 8, 16, 64]))
    t_q = draw(st.sampled_from([1, 1, draw(st.integers(2, max_query))]))
    dtype = draw(dtypes)
    seed = draw(st.integers(0, 2**31 - 1))
    lengths = [draw(st.integers(0, max_tokens)) for _ in range(batch)]

    gen = torch.Generator().manual_seed(seed)
    total = max(1, sum(lengths))
    num_blocks = -(-total // block_size) + 1
    shape = (num_blocks, block_size, h_kv, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    # Every sequence gets distinct slots of the pool in shuffled order (a scattered table).
    all_slots = torch.randperm(num_blocks * block_size, generator=gen)
    t_k = max(lengths)
    slots = torch.full((batch, t_k), -1, dtype=torch.int64)
    key_positions = torch.zeros((batch, t_k), dtype=torch.int64)
    query_positions = torch.zeros((batch, t_q), dtype=torch.int64)
    start = 0
    for b, length in enumerate(lengths):
        slots[b, :length] = all_slots[start : start + length]
        start += length
        # Original positions increase with gaps (evicted tokens), as in a token table.
        gaps = torch.randint(1, 3, (length,), generator=gen)
        key_positions[b, :length] = torch.cumsum(gaps, 0) - 1
        last = int(key_positions[b, length - 1]) if length else 0
        # Queries are the last t_q positions (a prefill chunk whose keys are in the table) and
        # may start before the last key, so some queries see only a prefix (causal).
        query_positions[b] = torch.arange(t_q) + max(0, last - t_q + 1)
    query = torch.randn((batch, t_q, h_kv * group, head_dim), generator=gen).to(dtype)
    window = draw(st.none() | st.integers(1, 30)) if windows else None
    case = AttentionCase(
        query, key_cache, value_cache, slots, key_positions, query_positions, window
    )
    if device != "cpu":
        case = AttentionCase(*(t.to(device) for t in case.args()), window)
    return case


ROPE_PARAMETERS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    # yarn has attention_scaling != 1: the case that tells rotation from re-rotation.
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 10000.0,
    },
}


def rotary_embedding(rope_type: str, head_dim: int) -> torch.nn.Module:
    """The real Hugging Face Llama rotary module for a tiny config of the given rope type."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        rope_parameters=dict(ROPE_PARAMETERS[rope_type]),
    )
    return LlamaRotaryEmbedding(config)
