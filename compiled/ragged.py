"""torch.compile implementation of ``kvstack.reference.ragged.ragged_decode_attention``.

Same inputs, outputs and rule as the reference (see its docstring). The work is laid out the way
a GPU kernel runs the list, one tile per work row: row w of group g reads, for every sequence,
its key range of g's table into a tile of ``tile`` positions (the longest range of any row), all
H_p members at once (they share the table's slots), and produces a partial state per member's
query heads. The partial states are then merged per KV head by log-sum-exp in one reduction over
(row, member). No Python loop over rows, sequences or heads; for one sequence the tiles hold
about the keys its tables hold (the work list balances the ranges), not W copies of a table.

The tile width and the KV head count are read before the call (two host syncs per call); every
other shape is dynamic, the scale is applied in eager and the KV head count enters as a shape,
so one graph per dtype serves batches, lengths, head layouts and work lists (dynamo still
specialises dims of size 0 or 1, e.g. batch 1, into graphs of their own). The tile is the
longest range of any row over the batch: a batch mixing long and short sequences pads the
short ones' tiles to it.
"""

from __future__ import annotations

import math

import torch

from kvstack.reference.attention import AttentionOutput
from kvstack.reference.ragged import check_ragged_args


@torch.compile(dynamic=True)
def _ragged(query, key_rows, value_rows, slots, lengths, members, work, kv_heads, tile: int):
    # query: float32, already scaled; index tensors int64; kv_heads = arange(H_kv).
    batch, _, h_q, head_dim = query.shape
    h_kv = kv_heads.shape[0]
    group, part, parts = work[:, 0], work[:, 1], work[:, 2]  # [W] each
    used = lengths.amax(dim=2)[:, group]  # [B, W]: the row's table's used length
    start = part * used // parts  # [B, W]
    end = (part + 1) * used // parts
    pos = start[..., None] + torch.arange(tile, device=slots.device)  # [B, W, L]
    in_range = pos < end[..., None]  # [B, W, L]
    pos_safe = pos.clamp(max=slots.shape[2] - 1)
    # Positions past a row's range may hold any padding (the spec reads only below each used
    # length): they read slot 0, whose value is then masked.
    slot = torch.where(in_range, slots[:, group].gather(2, pos_safe), 0)  # [B, W, L]
    keys = key_rows[slot].float()  # [B, W, L, H_p, D]: every member of the row's group
    member_len = lengths[:, group]  # [B, W, H_p]
    visible = in_range[:, :, None, :] & (pos[:, :, None, :] < member_len[..., None])  # [B,W,H_p,L]
    # Cells no member reads (a short member's tail) may hold anything, NaN included: zero their
    # values, since a masked probability of 0 times NaN would still be NaN.
    values = value_rows[slot].float().masked_fill(~visible.transpose(2, 3)[..., None], 0.0)

    heads = members[group]  # [W, H_p]: each member's KV head, -1 = none
    q = query.reshape(batch, h_kv, h_q // h_kv, head_dim)  # [B, H_kv, per_kv, D]
    q_rows = q[:, heads.clamp(min=0)]  # [B, W, H_p, per_kv, D]
    scores = torch.einsum("bwipd,bwlid->bwipl", q_rows, keys)  # [B, W, H_p, per_kv, L]
    scores = scores.masked_fill(~visible[:, :, :, None, :], -math.inf)
    lse_rows = torch.logsumexp(scores, dim=-1)  # [B, W, H_p, per_kv]
    probs = torch.exp(scores - _finite(lse_rows)[..., None])  # 0 where masked
    out_rows = torch.einsum("bwipl,bwlid->bwipd", probs, values)  # [B, W, H_p, per_kv, D]

    # Merge by KV head: (row, member) states whose member is head k, log-sum-exp over them.
    owner = heads[..., None] == kv_heads  # [W, H_p, H_kv]
    lse_owned = lse_rows[:, :, :, None, :].masked_fill(
        ~owner[None, :, :, :, None], -math.inf
    )  # [B, W, H_p, H_kv, per_kv]
    lse = torch.logsumexp(lse_owned, dim=(1, 2))  # [B, H_kv, per_kv]
    weight = torch.exp(lse_owned - _finite(lse)[:, None, None])  # 0 off the owner
    out = torch.einsum("bwikp,bwipd->bkpd", weight, out_rows)  # [B, H_kv, per_kv, D]
    return out.reshape(batch, 1, h_q, head_dim), lse.reshape(batch, 1, h_q)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (nothing seen) as 0, so that exp(-inf - 0) = 0 stays 0."""
    return torch.where(lse == -math.inf, torch.zeros_like(lse), lse)


def ragged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    members: torch.Tensor,
    work: torch.Tensor,
    *,
    scale: float | None = None,
    check: bool = True,
) -> AttentionOutput:
    """Implements ``kvstack.reference.ragged.ragged_decode_attention``."""
    if check:
        check_ragged_args(query, key_cache, value_cache, slots, lengths, members, work)
    head_dim, h_p = query.shape[-1], key_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group, part, parts = work[:, 0], work[:, 1], work[:, 2]
    used = lengths.amax(dim=2)[:, group]  # [B, W]
    span = (part + 1) * used // parts - part * used // parts
    tile = int(span.max()) if span.numel() else 0  # the longest row's range
    if tile == 0:  # no member of any sequence holds an entry: the spec's empty result
        batch, _, h_q, _ = query.shape
        out = torch.zeros_like(query)
        lse = torch.full((batch, 1, h_q), -math.inf, device=query.device)
        return AttentionOutput(out, lse, None)
    # Everything that would make a new graph per value is settled here, in eager: the scale
    # (a float dynamo would specialise on) is applied to the query, the index dtypes are made
    # one, and the KV head count travels as a shape (arange), not as an int.
    index = [t.long() for t in (slots, lengths, members, work)]
    kv_heads = torch.arange(int((members >= 0).sum()), device=query.device)
    out, lse = _ragged(
        query.float() * scale,
        key_cache.reshape(-1, h_p, head_dim),  # [S, H_p, D]
        value_cache.reshape(-1, h_p, head_dim),
        *index,
        kv_heads,
        tile,
    )
    return AttentionOutput(out.to(query.dtype), lse, None)
