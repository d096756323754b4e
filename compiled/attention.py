"""torch.compile implementation of ``kvstack.reference.attention.paged_attention``.

Same inputs, outputs and rule as the reference (see its docstring); differences are only in how
the work is laid out:

* No Python loop over sequences, heads or tokens. The K/V rows are read through ``slots`` inside
  the compiled kernels (inductor fuses the indexed load into the reduction), so a decode step
  never materialises the gathered keys.
* Decode (T_q == 1) is memory-bound: scores are a fused multiply-reduce over head_dim laid out
  [B, T, H_kv, G], and the value sum is split into chunks of ``CHUNK`` tokens (flash-decoding's
  split-K) so that the G query heads sharing a KV head re-read a chunk from cache, not from DRAM.
* Prefill chunks (T_q > 1) are compute-bound and use batched matmuls on the gathered rows. A
  prefill runs ``QUERY_CHUNK`` queries per call, each over only the key columns up to the
  last one any of its queries can see: with keys in causal order that skips the masked upper
  triangle (about half the work of one square call), and the result is the same.

Recompiles are bounded: the key length is padded with -1 slots to a multiple of ``CHUNK``, and
the batch, query and key lengths and the pool size are marked dynamic, so one graph serves every
length and batch. Head counts and head_dim stay static — they are fixed for a model, and static
inner loops let inductor emit unmasked vector code (2x faster decode than all-dynamic shapes).
New graphs come only from a new dtype, device or head configuration (and dynamo's 0/1 size
specialisation); dynamo's automatic-dynamic turns a dim that keeps changing symbolic.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvstack.reference.attention import AttentionOutput, check_attention_args, check_decode_args

CHUNK = 64  # tokens per split-K chunk of the decode value sum; also the padding granularity
# Queries per kernel call of a prefill. Each call computes a [QUERY_CHUNK, width] block, so the
# masked corner it computes in vain shrinks with the chunk: 128 is ~10% over the causal triangle
# of a 1.3k-token prompt where 256 is ~50%, and measured faster on SmolLM2 prefill (fp32, CPU).
QUERY_CHUNK = 128


def _decode(
    q, key_rows, value_rows, slots, key_positions, query_positions, first_visible, scale: float
):
    batch, _, h_q, head_dim = q.shape
    h_kv = key_rows.shape[1]  # key_rows, value_rows: [S, H_kv, D]
    group = h_q // h_kv
    t_k = slots.shape[1]
    visible = (
        (slots >= 0) & (key_positions <= query_positions) & (key_positions >= first_visible)
    )  # [B, T]
    safe_slots = slots.clamp(min=0)

    q_grouped = q.float().view(batch, 1, h_kv, group, head_dim) * scale  # [B, 1, H_kv, G, D]
    keys = key_rows[safe_slots].float()  # [B, T, H_kv, D], fused into the reduction below
    scores = (keys[:, :, :, None, :] * q_grouped).sum(-1)  # [B, T, H_kv, G]
    scores = scores.masked_fill(~visible[:, :, None, None], -math.inf)
    lse = torch.logsumexp(scores, dim=1)  # [B, H_kv, G]
    lse_safe = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_safe[:, None])  # [B, T, H_kv, G]; 0 where masked

    values = value_rows[safe_slots].float().view(batch, t_k // CHUNK, CHUNK, h_kv, 1, head_dim)
    probs_chunked = probs.view(batch, t_k // CHUNK, CHUNK, h_kv, group, 1)
    partial = (probs_chunked * values).sum(2)  # [B, T/CHUNK, H_kv, G, D]
    out = partial.sum(1).reshape(batch, 1, h_q, head_dim)  # [B, 1, H_q, D]
    weights = probs.reshape(batch, t_k, h_q).permute(0, 2, 1)[:, :, None, :]  # [B, H_q, 1, T]
    return out.to(q.dtype), lse.reshape(batch, 1, h_q), weights


def _prefill(
    q, key_rows, value_rows, slots, key_positions, query_positions, first_visible, scale: float
):
    batch, t_q, h_q, head_dim = q.shape
    h_kv = key_rows.shape[1]  # key_rows, value_rows: [S, H_kv, D]
    group = h_q // h_kv
    t_k = slots.shape[1]
    key_pos = key_positions[:, None, :]  # [B, 1, T]
    visible = (
        (slots[:, None, :] >= 0)
        & (key_pos <= query_positions[:, :, None])
        & (key_pos >= first_visible[:, :, None])
    )
    safe_slots = slots.clamp(min=0)

    q_grouped = (
        q.float().view(batch, t_q, h_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    )  # [B, H_kv, G, T_q, D]
    keys = key_rows[safe_slots].float().permute(0, 2, 1, 3)  # [B, H_kv, T, D]
    values = value_rows[safe_slots].float().permute(0, 2, 1, 3)
    scores = scale * torch.matmul(
        q_grouped.reshape(batch, h_kv, group * t_q, head_dim), keys.transpose(-1, -2)
    )
    scores = scores.view(batch, h_kv, group, t_q, t_k).masked_fill(
        ~visible[:, None, None], -math.inf
    )
    lse = torch.logsumexp(scores, dim=-1)  # [B, H_kv, G, T_q]
    lse_safe = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    probs = torch.exp(scores - lse_safe[..., None])  # [B, H_kv, G, T_q, T]
    out = torch.matmul(probs.view(batch, h_kv, group * t_q, t_k), values)  # [B, H_kv, G*T_q, D]
    out = (
        out.view(batch, h_kv, group, t_q, head_dim)
        .permute(0, 3, 1, 2, 4)
        .reshape(batch, t_q, h_q, head_dim)
    )
    lse = lse.permute(0, 3, 1, 2).reshape(batch, t_q, h_q)
    weights = probs.reshape(batch, h_q, t_q, t_k)
    return out.to(q.dtype), lse, weights


_decode_compiled = torch.compile(_decode)
_prefill_compiled = torch.compile(_prefill)


_NO_WINDOW: dict[torch.device, torch.Tensor] = {}


def _no_window(device: torch.device) -> torch.Tensor:
    """[1, 1] first visible position that hides nothing (one tensor per device, made once)."""
    if device not in _NO_WINDOW:
        _NO_WINDOW[device] = torch.full((1, 1), torch.iinfo(torch.int64).min, device=device)
    return _NO_WINDOW[device]


def _mark_lengths_dynamic(*tensors_and_dims) -> None:
    # maybe_mark_dynamic, not mark_dynamic: a length that happens to be 1 may still specialise.
    for tensor, dims in tensors_and_dims:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)


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
    """Implements ``kvstack.reference.attention.paged_attention``."""
    if check:
        check_attention_args(
            query, key_cache, value_cache, slots, key_positions, query_positions, window
        )
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    t_q, t_k = query.shape[1], slots.shape[1]
    if t_q == 1:
        return _attend(
            query,
            key_cache,
            value_cache,
            slots,
            key_positions,
            query_positions,
            scale,
            window,
            return_weights,
        )
    # Prefill: queries in chunks, each over only the key columns up to the last one any of its
    # queries can see. With keys in causal order that is the triangle, not the square (about
    # half the work of one square call for a long prompt); the columns cut are all masked.
    outs, lses, weights = [], [], []
    visible_slot = slots >= 0  # [B, T_k]
    for start in range(0, t_q, QUERY_CHUNK):
        end = min(start + QUERY_CHUNK, t_q)
        chunk_positions = query_positions[:, start:end]
        last = chunk_positions.max(dim=1, keepdim=True).values  # [B, 1]
        seen = (visible_slot & (key_positions <= last)).any(dim=0).nonzero()
        width = int(seen.max()) + 1 if seen.numel() else min(1, t_k)  # cut: all masked
        part = _attend(
            query[:, start:end],
            key_cache,
            value_cache,
            slots[:, :width],
            key_positions[:, :width],
            chunk_positions,
            scale,
            window,
            return_weights,
        )
        outs.append(part.out)
        lses.append(part.lse)
        if return_weights:  # [B, H_q, T_c, T_k]
            weights.append(F.pad(part.weights, (0, t_k - width)) if width < t_k else part.weights)
    if len(outs) == 1:
        return AttentionOutput(outs[0], lses[0], weights[0] if return_weights else None)
    return AttentionOutput(
        torch.cat(outs, dim=1),
        torch.cat(lses, dim=1),
        torch.cat(weights, dim=2) if return_weights else None,
    )


def _attend(
    query,
    key_cache,
    value_cache,
    slots,
    key_positions,
    query_positions,
    scale,
    window,
    return_weights,
) -> AttentionOutput:
    """One compiled kernel call (decode, or a prefill chunk) over all of ``slots``."""
    t_k = slots.shape[1]
    pad = (-t_k) % CHUNK
    # Pad with slot -1 (masked) to a multiple of CHUNK: bounded shapes, and the chunked sum needs it.
    slots, key_positions = slots.long(), key_positions.long()
    if pad:
        slots = F.pad(slots, (0, pad), value=-1)
        key_positions = F.pad(key_positions, (0, pad), value=0)
    kernel = _decode_compiled if query.shape[1] == 1 else _prefill_compiled
    query_positions = query_positions.long()
    # The window enters as a tensor (first visible position per query), not an int, so a new
    # window size does not recompile; no window is one [1, 1] tensor that broadcasts.
    if window is None:
        first_visible = _no_window(query.device)
    else:
        first_visible = query_positions - window + 1
    # The kernels read rows [S, H_kv, D]: the block size is not theirs to specialise on (pools of
    # 1-token blocks would make a graph of their own), and S is dynamic.
    key_rows = key_cache.view(-1, *key_cache.shape[2:])
    value_rows = value_cache.view(-1, *value_cache.shape[2:])
    # Canonical strides: a size-1 dim (one decode query) can carry any stride, and dynamo guards
    # on it, so queries transposed in another order would compile a graph each. A view of the
    # flattened query (a copy only when it is not contiguous) has the same strides every time.
    query = query.reshape(-1).view(query.shape)
    _mark_lengths_dynamic(
        (query, (0, 1)),
        (key_rows, (0,)),
        (value_rows, (0,)),
        (slots, (0, 1)),
        (key_positions, (0, 1)),
        (query_positions, (0, 1)),
        (first_visible, (0, 1)),
    )
    out, lse, weights = kernel(
        query,
        key_rows,
        value_rows,
        slots,
        key_positions,
        query_positions,
        first_visible,
        scale,
    )
    if return_weights and pad:
        weights = weights[..., :t_k]
    return AttentionOutput(out, lse, weights if return_weights else None)


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
    """Implements ``kvstack.reference.attention.decode_attention``.

    Tables of one KV head (per-head eviction, e.g. H2O on SmolLM2): not a compiled graph. With
    every slot visible there is no mask for inductor to fuse, and a decode step is small enough
    that dynamo's per-call guard evaluation costs more than fusion saves; two row gathers and
    two batched matmuls (MKL/cuBLAS) do the work. Measured for SmolLM2's per-head tables (3
    tables x 650 tokens, 3 query heads, fp32, one CPU thread): 138 us warm / 277 us with cold
    caches, against 178 / 400 us for the compiled kernel. Tables of several KV heads measured
    the other way round (1 x 1300 tokens x 3 KV heads: 294 / 663 us compiled, 337 / 765 us
    here), so they run the compiled decode kernel of ``paged_attention``.
    """
    if check:
        check_decode_args(query, key_cache, value_cache, slots)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    batch, _, h_q, head_dim = query.shape
    t_k = slots.shape[1]
    if key_cache.shape[2] > 1:
        # Every key at position 0, visible to a query at position 0 (fresh [B, 1] tensor: a
        # slice of the [B, T] one would have a stride that changes with T, and recompile).
        key_positions = torch.zeros_like(slots)
        query_positions = torch.zeros((batch, 1), dtype=slots.dtype, device=slots.device)
        return _attend(
            query,
            key_cache,
            value_cache,
            slots,
            key_positions,
            query_positions,
            scale,
            None,
            return_weights,
        )
    rows = slots.reshape(-1)  # [B * T]
    keys = key_cache.reshape(-1, head_dim).index_select(0, rows).view(batch, t_k, head_dim)
    values = value_cache.reshape(-1, head_dim).index_select(0, rows).view(batch, t_k, head_dim)
    q = query.reshape(batch, h_q, head_dim).float() * scale  # [B, G, D]: one KV head
    scores = torch.bmm(q, keys.float().transpose(1, 2))  # [B, G, T]
    probs = torch.softmax(scores, dim=-1)
    # lse from the softmax itself: the largest probability is exp(m - lse) for the largest
    # score m, so lse = m - log(p_max), and p_max >= 1/T keeps the log well conditioned. Two
    # maxima and a log, where logsumexp and a second exp would be seven ops.
    lse = scores.amax(dim=-1) - probs.amax(dim=-1).log()  # [B, G]
    out = torch.bmm(probs, values.float()).view(batch, 1, h_q, head_dim)
    weights = probs.view(batch, h_q, 1, t_k) if return_weights else None
    return AttentionOutput(out.to(query.dtype), lse.view(batch, 1, h_q), weights)
