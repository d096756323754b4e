"""Hypothesis strategies shared by the spec tests: shapes, token tables and attention inputs."""

from __future__ import annotations

import math
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


@dataclass
class RaggedCase:
    """A decode step over head groups' tables (``kvstack.reference.ragged``), built from a dense
    sequence: ``dense_keys``/``dense_values`` [B, N, H_kv, D] are every token's K/V and ``kept``
    [B, H_kv, N] says which tokens each head kept; member i of a group's table holds, in slot j,
    its head's j-th kept token. Cells no member reads hold large values, so reading one shows."""

    query: torch.Tensor  # [B, 1, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, H_p, D]
    value_cache: torch.Tensor
    slots: torch.Tensor  # [B, G, T], -1 padded
    lengths: torch.Tensor  # [B, G, H_p]
    members: torch.Tensor  # [G, H_p], -1 = no head
    work: torch.Tensor  # [W, 3] (group, part, parts)
    dense_keys: torch.Tensor  # [B, N, H_kv, D]
    dense_values: torch.Tensor
    kept: torch.Tensor  # [B, H_kv, N] bool
    scale: float | None = None

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.slots,
            self.lengths,
            self.members,
            self.work,
        )

    def kwargs(self) -> dict:
        return {"scale": self.scale}

    def __repr__(self) -> str:
        return (
            f"RaggedCase(B={self.query.shape[0]}, H_q={self.query.shape[2]}, "
            f"members={self.members.tolist()}, lengths={self.lengths.tolist()}, "
            f"work={self.work.tolist()}, block_size={self.key_cache.shape[1]}, "
            f"dtype={self.query.dtype})"
        )


def ragged_tables(
    dense_keys: torch.Tensor,
    dense_values: torch.Tensor,
    kept: torch.Tensor,
    members: torch.Tensor,
    block_size: int,
    gen: torch.Generator,
    *,
    extra_columns: int = 0,
    junk: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out each head's kept tokens in its group's table, the way Tangram's ragged pages do:
    returns (key_cache, value_cache, slots [B, G, T], lengths [B, G, H_p]). T is the longest
    member's length plus ``extra_columns`` (0 when nothing is kept and no column is added).
    Unread cells hold large values, or with ``junk`` NaN and inf, and padding slots -1, or with
    ``junk`` any integer (the spec reads neither)."""
    batch, _, _, head_dim = dense_keys.shape
    groups, h_p = members.shape
    counts = kept.sum(dim=2)  # [B, H_kv]
    lengths = torch.zeros((batch, groups, h_p), dtype=torch.int64)
    for g in range(groups):
        for i, head in enumerate(members[g].tolist()):
            if head >= 0:
                lengths[:, g, i] = counts[:, head]
    table_len = (int(lengths.max()) if lengths.numel() else 0) + extra_columns
    num_blocks = -(-batch * groups * table_len // block_size) + 1
    shape = (num_blocks, block_size, h_p, head_dim)
    if junk:  # unread cells: NaN and inf, which poison any sum that reads them
        unread = torch.tensor([math.nan, math.inf, -math.inf])
        pick = torch.randint(0, 3, shape, generator=gen)
        key_cache = unread[pick].to(dense_keys.dtype)
        value_cache = unread[torch.randint(0, 3, shape, generator=gen)].to(dense_keys.dtype)
    else:
        key_cache = 100 * torch.randn(shape, generator=gen).to(dense_keys.dtype)
        value_cache = 100 * torch.randn(shape, generator=gen).to(dense_keys.dtype)
    order = torch.randperm(num_blocks * block_size, generator=gen)  # scattered tables
    if junk:  # padding past a table's used length: anything, even slots beyond the pool
        slots = torch.randint(
            -1, num_blocks * block_size + 50, (batch, groups, table_len), generator=gen
        )
    else:
        slots = torch.full((batch, groups, table_len), -1, dtype=torch.int64)
    key_rows, value_rows = key_cache.view(-1, h_p, head_dim), value_cache.view(-1, h_p, head_dim)
    cursor = 0
    for b in range(batch):
        for g in range(groups):
            used = int(lengths[b, g].max())
            slots[b, g, :used] = order[cursor : cursor + used]
            cursor += used
            for i, head in enumerate(members[g].tolist()):
                if head < 0:
                    continue
                tokens = kept[b, head].nonzero().flatten()  # in order
                table = slots[b, g, : len(tokens)]
                key_rows[table, i] = dense_keys[b, tokens, head]
                value_rows[table, i] = dense_values[b, tokens, head]
    return key_cache, value_cache, slots, lengths


@st.composite
def ragged_cases(draw, *, max_tokens: int = 40):
    """Head groups of H_p (one short, anywhere), random per-head kept tokens (some heads keep
    none, some cases nothing at all, tables of width 0 among them), scattered tables whose
    unread cells and padding may be junk (NaN, inf, any slot), and a random work list: every
    group split into 1-5 parts (more parts than keys leaves splits empty), its rows in random
    order."""
    batch, h_kv = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    h_p = draw(st.integers(1, 3))
    per_kv, head_dim = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([8, 16]))
    block_size = draw(st.sampled_from([1, 4, 16]))
    dtype = draw(dtypes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    heads = draw(st.permutations(range(h_kv)))
    groups = -(-h_kv // h_p)
    sizes = [h_p] * (h_kv // h_p)
    if h_kv % h_p:
        sizes.insert(draw(st.integers(0, len(sizes))), h_kv % h_p)
    members = torch.full((groups, h_p), -1, dtype=torch.int64)
    start = 0
    for g, size in enumerate(sizes):
        members[g, :size] = torch.tensor(heads[start : start + size])
        start += size

    tokens = draw(st.integers(0, max_tokens))
    dense_keys = torch.randn((batch, tokens, h_kv, head_dim), generator=gen).to(dtype)
    dense_values = torch.randn((batch, tokens, h_kv, head_dim), generator=gen).to(dtype)
    keep_fraction = draw(st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    kept = torch.rand((batch, h_kv, tokens), generator=gen) < keep_fraction
    key_cache, value_cache, slots, lengths = ragged_tables(
        dense_keys,
        dense_values,
        kept,
        members,
        block_size,
        gen,
        extra_columns=draw(st.sampled_from([0, 0, 1, 3])),
        junk=draw(st.booleans()),
    )
    rows = [
        (g, part, parts)
        for g in range(groups)
        for parts in [draw(st.integers(1, 5))]
        for part in range(parts)
    ]
    rows = draw(st.permutations(rows))
    work = torch.tensor(rows, dtype=torch.int64).view(-1, 3)
    index_dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    query = torch.randn((batch, 1, h_kv * per_kv, head_dim), generator=gen).to(dtype)
    return RaggedCase(
        query,
        key_cache,
        value_cache,
        slots.to(index_dtype),
        lengths.to(index_dtype),
        members.to(index_dtype),
        work.to(index_dtype),
        dense_keys,
        dense_values,
        kept,
        draw(st.none() | st.floats(0.05, 2.0)),
    )


def dense_masked_decode(case: RaggedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of each query head over every token of the sequence with the entries its
    KV head did not keep masked (-inf before the softmax): out [B, 1, H_q, D] float32, lse
    [B, 1, H_q]; a head that kept nothing gets out 0, lse -inf."""
    batch, _, h_q, head_dim = case.query.shape
    h_kv = case.kept.shape[1]
    per_kv = h_q // h_kv
    scale = head_dim**-0.5 if case.scale is None else case.scale
    query = case.query.float().view(batch, h_kv, per_kv, head_dim)  # [B, H_kv, per_kv, D]
    keys = case.dense_keys.float().permute(0, 2, 1, 3)  # [B, H_kv, N, D]
    values = case.dense_values.float().permute(0, 2, 1, 3)
    scores = scale * query @ keys.transpose(-1, -2)  # [B, H_kv, per_kv, N]
    scores = scores.masked_fill(~case.kept[:, :, None, :], -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [B, H_kv, per_kv]
    safe = torch.where(lse == -torch.inf, torch.zeros_like(lse), lse)
    out = torch.exp(scores - safe[..., None]) @ values  # [B, H_kv, per_kv, D]
    return out.reshape(batch, 1, h_q, head_dim), lse.reshape(batch, 1, h_q)
