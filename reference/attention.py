"""Attention over a token table (decode and prefill chunks), with its log-sum-exp.

Inputs (B sequences, T_q query tokens each, T_k table entries each):

    query            [B, T_q, H_q, D]
    key_cache        [num_blocks, block_size, H_kv, D]  the pool (``block_pool.py``)
    value_cache      [num_blocks, block_size, H_kv, D]
    slots            [B, T_k] int   live slots in logical order, -1 = padding (``TokenTable.live_slots``)
    key_positions    [B, T_k] int   the tokens' original positions
    query_positions  [B, T_q] int

Rule: query head h reads KV head h // (H_q / H_kv) (grouped-query attention); query i of
sequence b sees key j iff slots[b, j] >= 0 and key_positions[b, j] <= query_positions[b, i]
(causal by position, so evicted tokens and prefill chunks need no other mask), and, with a
sliding ``window`` W, also key_positions[b, j] > query_positions[b, i] - W (Mistral, Gemma's
local layers; the rule transformers' ``sliding_window_overlay`` uses). Scores are
computed in float32:

    s_ij = scale * q_i . k_j,   lse_i = log sum_j exp(s_ij)   (natural log),
    out_i = sum_j exp(s_ij - lse_i) v_j.

A query that sees no key has lse = -inf and out = 0: the identity of ``merge.py``.
Returns ``out`` [B, T_q, H_q, D] (query's dtype), ``lse`` [B, T_q, H_q] float32, and when asked
the attention weights [B, H_q, T_q, T_k] float32 (0 where masked) for eviction policies.

``decode_attention`` is the decode step's special case: one query per sequence over a live
view with no padding, where every listed slot is visible (no positions, no window).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from kvstack.errors import InvalidArgumentError, SlotOutOfRangeError
from kvstack.reference.checks import FLOAT_DTYPES, check_positive_int, check_tensor

INDEX_DTYPES = (torch.int64, torch.int32)


class AttentionOutput(NamedTuple):
    out: torch.Tensor  # [B, T_q, H_q, D]
    lse: torch.Tensor  # [B, T_q, H_q] float32
    weights: torch.Tensor | None  # [B, H_q, T_q, T_k] float32, or None


def check_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    window: int | None = None,
) -> None:
    """Shape, dtype and device checks shared by every implementation of ``paged_attention``."""
    if window is not None:
        check_positive_int("window", window)
    check_tensor("query", query, ndim=4, dtypes=FLOAT_DTYPES)
    batch, t_q, h_q, head_dim = query.shape
    check_tensor("key_cache", key_cache, ndim=4, dtypes=FLOAT_DTYPES, device=query.device)
    h_kv = key_cache.shape[2]
    check_tensor("key_cache", key_cache, shape=(None, None, h_kv, head_dim))
    check_tensor(
        "value_cache",
        value_cache,
        shape=tuple(key_cache.shape),
        dtypes=FLOAT_DTYPES,
        device=query.device,
    )
    if h_q % h_kv:
        raise InvalidArgumentError(
            f"query has {h_q} heads, which is not a multiple of key_cache's {h_kv} KV heads"
        )
    check_tensor("slots", slots, ndim=2, dtypes=INDEX_DTYPES, device=query.device)
    check_tensor("slots", slots, shape=(batch, None))
    check_tensor(
        "key_positions",
        key_positions,
        shape=tuple(slots.shape),
        dtypes=INDEX_DTYPES,
        device=query.device,
    )
    check_tensor(
        "query_positions",
        query_positions,
        shape=(batch, t_q),
        dtypes=INDEX_DTYPES,
        device=query.device,
    )
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    if slots.numel():
        lowest, highest = (int(bound) for bound in torch.aminmax(slots))
        if lowest < -1 or highest >= num_slots:
            raise SlotOutOfRangeError(
                f"slots holds values in [{lowest}, {highest}], expected -1 (padding) or "
                f"0 <= slot < {num_slots}"
            )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    key_positions: torch.Tensor,
    query_positions: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    return_weights: bool = False,
    check: bool = True,
) -> AttentionOutput:
    """Attention of each query over the K/V rows its sequence's table names (see module doc).

    ``check=False`` skips ``check_attention_args``: for a caller that built the arguments from
    its own token tables (the HF attention function), where the checks would cost a decode step
    more than the attention itself. Attention changes no state, so a bad argument there fails
    inside torch (an index error; on CUDA a device assert) without corrupting any table."""
    if check:
        check_attention_args(
            query, key_cache, value_cache, slots, key_positions, query_positions, window
        )
    batch, t_q, h_q, head_dim = query.shape
    h_kv = key_cache.shape[2]
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    key_rows = key_cache.reshape(-1, h_kv, head_dim)  # [S, H_kv, D]
    value_rows = value_cache.reshape(-1, h_kv, head_dim)

    out = torch.zeros(batch, t_q, h_q, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((batch, t_q, h_q), -math.inf, dtype=torch.float32, device=query.device)
    weights = torch.zeros(batch, h_q, t_q, slots.shape[1], dtype=torch.float32, device=query.device)
    for b in range(batch):
        valid = slots[b] >= 0  # [T_k]
        keys = key_rows[slots[b][valid]].float()  # [L, H_kv, D]
        values = value_rows[slots[b][valid]].float()
        key_pos, query_pos = key_positions[b][valid][None, :], query_positions[b][:, None]
        visible = key_pos <= query_pos  # [T_q, L]
        if window is not None:
            visible &= key_pos > query_pos - window
        for h in range(h_q):
            kv_head = h // group
            scores = scale * query[b, :, h].float() @ keys[:, kv_head].T  # [T_q, L]
            scores = scores.masked_fill(~visible, -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)  # [T_q]
            seen = row_lse > -math.inf  # rows that see no key keep out = 0, lse = -inf
            probs = torch.exp(scores[seen] - row_lse[seen, None])  # [T_seen, L]
            out[b, seen, h] = probs @ values[:, kv_head]
            lse[b, :, h] = row_lse
            weights[b, h, seen.nonzero().flatten()[:, None], valid.nonzero().flatten()[None, :]] = (
                probs
            )
    return AttentionOutput(out.to(query.dtype), lse, weights if return_weights else None)


def check_decode_args(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """``check_attention_args`` for ``decode_attention``: one query per sequence, and at least
    one slot per row, none of them padding."""
    check_tensor("query", query, ndim=4, dtypes=FLOAT_DTYPES)
    if query.shape[1] != 1:
        raise InvalidArgumentError(
            f"query has {query.shape[1]} tokens per sequence, expected 1 for decode_attention "
            "(use paged_attention for prefill chunks)"
        )
    check_tensor("slots", slots, ndim=2, dtypes=INDEX_DTYPES, device=query.device)
    if slots.shape[1] == 0:
        raise InvalidArgumentError(
            f"slots has shape {tuple(slots.shape)}, expected at least one slot per sequence"
        )
    positions = torch.zeros_like(slots)  # all visible: the rule decode_attention computes
    check_attention_args(query, key_cache, value_cache, slots, positions, positions[:, :1])
    if int(slots.min()) < 0:
        raise SlotOutOfRangeError(
            "slots holds -1 (padding), expected only live slots: decode_attention reads every "
            "slot it is given (use paged_attention for padded views)"
        )


def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    scale: float | None = None,
    return_weights: bool = False,
    check: bool = True,
) -> AttentionOutput:
    """The decode step over a live view: each sequence's one query [B, 1, H_q, D] attends to
    every slot its row of ``slots`` [B, T_k] names.

    A token table's live view (``TokenTable.live_slots``) already says what the newest token may
    read: causality and eviction are in the slot list itself, so no positions and no mask are
    needed. This is ``paged_attention`` with every key visible (all key positions <= the
    query's, no window, no padding), and is specified as exactly that call. ``check=False`` as
    for ``paged_attention``."""
    if check:
        check_decode_args(query, key_cache, value_cache, slots)
    key_positions = torch.zeros_like(slots)  # [B, T_k]: every key at position 0 ...
    query_positions = torch.zeros((slots.shape[0], 1), dtype=slots.dtype, device=slots.device)
    return paged_attention(  # ... visible to the query at position 0
        query,
        key_cache,
        value_cache,
        slots,
        key_positions,
        query_positions,
        scale=scale,
        return_weights=return_weights,
        check=False,
    )
