"""The ``"kvstack"`` attention implementation for Hugging Face models.

Registered with both ``AttentionInterface`` (the attention function) and
``AttentionMaskInterface`` (the mask function) under one name, so that

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvstack")
    model.set_attn_implementation("kvstack")   # or switch a loaded model

work after ``import kvstack.hf``.

Why our own attention: a paged cache keeps K/V in pool blocks reached through token tables;
handing transformers contiguous K/V would copy the whole cache every step. Instead the cache layer's
``update`` writes the new rows into its pool and announces itself as the current ``StepState``;
the attention function then reads K/V through that layer's token tables with the op registry's
``paged_attention`` (compiled backend by default) and owns the masking: causal by logical index,
left padding (padding tokens are evicted from the table at prefill), evicted tokens (never in the
table). The mask function therefore returns transformers' 2D padding mask unchanged.

Called without a kvstack cache (``use_cache=False``, or another cache class), the function
computes ordinary causal attention over the K/V it is given, through the same operation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvstack import ops
from kvstack.errors import KVStackError

ATTENTION_NAME = "kvstack"
OBSERVE_CHUNK = 128  # queries per attention call when an eviction policy observes the weights


@dataclass
class StepState:
    """What the current layer's ``update`` tells the attention function that follows it."""

    layer: Any = (
        None  # the cache layer that just stored this step's K/V (kvstack.hf.paged.PagedLayer)
    )
    key: torch.Tensor | None = None  # the K/V handed to update, to recognise the matching call


STEP = StepState()
_BACKEND: str | None = None  # None: the fastest available; "reference" to run the specification


def set_backend(backend: str | None) -> None:
    """Choose the registry backend the attention function uses (None = fastest available)."""
    global _BACKEND
    ops.get("paged_attention", backend)  # raises with the reason if the backend cannot run here
    _BACKEND = backend


# (mask, query length, tokens seen) of the last step whose new tokens were all real: every layer
# of a forward gets the same 2D mask, so one check (and one device sync) serves them all.
_ALL_REAL: tuple[torch.Tensor, int, int] | None = None


def _new_tokens_all_real(attention_mask: torch.Tensor, t_q: int, seen: int) -> bool:
    """Whether the mask's last ``t_q`` columns are all real tokens (no padding to evict)."""
    global _ALL_REAL
    memo = _ALL_REAL
    if memo is not None and memo[0] is attention_mask and memo[1:] == (t_q, seen):
        return True
    if not bool(attention_mask[:, -t_q:].all()):
        return False
    _ALL_REAL = (attention_mask, t_q, seen)
    return True


def kvstack_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """Mask function: pass the 2D padding mask ([B, seen + q], True = real token) through.

    The attention function builds the causal and eviction masks from the token tables itself."""
    return attention_mask


def _contiguous_as_table(key: torch.Tensor, value: torch.Tensor):
    """View contiguous K/V [B, H_kv, T, D] as a pool of T-token blocks, one per row."""
    batch, h_kv, t_k, head_dim = key.shape
    key_cache = key.transpose(1, 2).contiguous()  # [B, T, H_kv, D]: block b holds row b
    value_cache = value.transpose(1, 2).contiguous()
    slots = torch.arange(batch * t_k, device=key.device).view(batch, t_k)  # [B, T]
    return key_cache, value_cache, slots


def kvstack_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention function with transformers' signature: query [B, H_q, T_q, D], key/value as
    returned by the cache's ``update``; returns ([B, T_q, H_q, D], weights or None)."""
    unsupported = {k: kwargs[k] for k in ("softcap", "s_aux", "sinks") if kwargs.get(k) is not None}
    if unsupported:
        raise KVStackError(
            f"the kvstack attention does not implement {sorted(unsupported)} (used by "
            f"{type(module).__name__}); load this model with attn_implementation='sdpa' or 'eager'"
        )
    window = kwargs.get("sliding_window")
    query_bthd = query.transpose(1, 2)  # [B, T_q, H_q, D]
    t_q = query.shape[2]
    layer = STEP.layer
    if layer is None:
        # No kvstack cache behind this call: plain causal attention over the given K/V.
        key_cache, value_cache, slots = _contiguous_as_table(key, value)
        t_k = key.shape[2]
        key_positions = torch.arange(t_k, device=key.device).expand(key.shape[0], t_k)
        if attention_mask is not None and attention_mask.dim() == 2:
            slots = slots.masked_fill(~attention_mask[:, -t_k:].bool(), -1)
        query_positions = torch.arange(t_k - t_q, t_k, device=key.device).expand(key.shape[0], t_q)
        result = ops.get("paged_attention", _BACKEND)(
            query_bthd,
            key_cache,
            value_cache,
            slots,
            key_positions,
            query_positions,
            scale=scaling,
            window=window,
        )
        return result.out, None
    if STEP.key is not key:
        raise KVStackError(
            f"layer {layer.layer_idx} of the kvstack cache stored K/V, but the attention call "
            f"of {type(module).__name__} received other key states; this model transforms K/V "
            "between the cache and attention, which the kvstack attention does not support"
        )
    STEP.layer, STEP.key = None, None  # one update, one attention call
    mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    window = layer.window if layer.window is not None else window
    pending = layer.pending_prefill(mask)
    if pending is None:
        return _attend_tables(layer, query_bthd, mask, scaling, window, key, value), None
    # Chunked prefill: append N prompt tokens, attend their queries, evict down to the budget,
    # and only then append the next N, so no table ever holds more than budget + N tokens.
    outs = []
    for start, end in pending:
        layer.append_prefill_chunk(start, end)
        chunk_mask = None if mask is None else mask[:, : mask.shape[1] - t_q + end]
        outs.append(
            _attend_tables(
                layer,
                query_bthd[:, start:end],
                chunk_mask,
                scaling,
                window,
                key[:, :, start:end],
                value[:, :, start:end],
            )
        )
    layer.finish_prefill()
    return torch.cat(outs, dim=1), None


def _attend_tables(
    layer: Any,
    query_bthd: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    window: int | None,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query_bthd`` ([B, T_q, H_q, D], the layer's newest T_q tokens) over the
    layer's token tables; hands the weights to the layer's policy and lets it evict afterwards.
    ``attention_mask`` is the 2D padding mask whose last T_q columns are these tokens; ``key``
    and ``value`` ([B, H_kv, T_q, D]) are the step's K/V, as the layer stored them.

    A prefill computes weights only for the queries whose weights the policy reads
    (``observed_queries``: none for StreamingLLM, the newest for TOVA, SnapKV's observation
    window, every query for H2O). Every query's output then comes from the fastest attention
    that reads the same keys: SDPA over ``key``/``value`` when the tables hold exactly this
    step's tokens (a first prefill without padding) and no backend was chosen (``set_backend``:
    the reference backend reads every output through the tables), else one paged call without
    weights."""
    t_q = query_bthd.shape[1]
    if attention_mask is not None:
        if not _new_tokens_all_real(attention_mask, t_q, layer.get_seq_length()):
            layer.evict_padding(attention_mask[:, -t_q:])
    view = layer.attention_view()  # key_cache, value_cache, slots [N, T_k], positions [N, T_k]
    want_weights = layer.wants_attention_weights()
    observed = layer.observed_queries(t_q) if want_weights else 0
    if t_q > 1 and observed < t_q:
        fresh = key is not None and window is None and layer.holds_only_new_tokens(t_q)
        if fresh and _BACKEND is None:
            out = F.scaled_dot_product_attention(
                query_bthd.transpose(1, 2),  # [B, H_q, T_q, D]
                key,
                value,
                is_causal=True,
                scale=scaling,
                enable_gqa=True,
            ).transpose(1, 2)  # [B, T_q, H_q, D]
        else:
            out = _attend_rows(layer, query_bthd, view, 0, scaling, window, weights=False)
        if observed:
            layer.skip_queries(t_q - observed)
            _attend_rows(layer, query_bthd, view, t_q - observed, scaling, window, weights=True)
        layer.after_attention()
        return out
    plan = layer.ragged_plan() if t_q == 1 and window is None and not want_weights else None
    if plan is not None:
        out = _attend_ragged(query_bthd, view, plan, scaling)
    else:
        out = _attend_rows(layer, query_bthd, view, 0, scaling, window, weights=want_weights)
    layer.after_attention()
    return out


def _attend_ragged(
    query_bthd: torch.Tensor,
    view: tuple[torch.Tensor, ...],
    plan: tuple[torch.Tensor, torch.Tensor],
    scaling: float | None,
) -> torch.Tensor:
    """A decode step of a layer with one table per (row, KV head) through the ragged decode
    attention, run from the layer's static work list (``plan``: its head groups, each of one
    head, and the splits of each). Returns [B, 1, H_q, D]."""
    key_cache, value_cache, slots, _ = view  # slots [B * H_kv, T]: table row * H_kv + head
    members, work = plan
    batch = query_bthd.shape[0]
    tables = slots.view(batch, -1, slots.shape[1])[:, members[:, 0]]  # [B, G, T]: group order
    lengths = (tables >= 0).sum(dim=2, keepdim=True)  # [B, G, 1]: live tokens come first
    result = ops.get("ragged_decode_attention", _BACKEND)(
        query_bthd,
        key_cache,
        value_cache,
        tables,
        lengths,
        members,
        work,
        scale=scaling,
        check=False,  # built from the layer's own tables and pool
    )
    return result.out


def _attend_rows(
    layer: Any,
    query_bthd: torch.Tensor,
    view: tuple[torch.Tensor, ...],
    first: int,
    scaling: float | None,
    window: int | None,
    *,
    weights: bool,
) -> torch.Tensor:
    """Attention of the step's queries ``first`` to T_q over the layer's ``attention_view``;
    with ``weights``, each chunk's weights go to the policy (``observe_attention``). Returns
    [B, T_q - first, H_q, D]."""
    attention = ops.get("paged_attention", _BACKEND)
    key_cache, value_cache, slots, key_positions = view
    t_q = query_bthd.shape[1]
    query_split = layer.split_query(query_bthd)  # one row per token table
    # A decode step over views without padding: the newest token sees every live token,
    # which decode_attention computes without positions or a mask.
    dense_decode = t_q == 1 and window is None and layer.view_is_dense
    query_positions = None if dense_decode else layer.query_positions(t_q)
    # A policy that observes attention weights gets them OBSERVE_CHUNK queries at a time, so a
    # long prefill never holds the whole [tables, heads, T_q, T_k] weights at once; it evicts
    # only after the last chunk, so observing in parts decides exactly as observing at once.
    # Each chunk reads only the view's columns its queries can see (the view lists each table's
    # live tokens in logical order first), so its weights are no wider than the causal triangle.
    outs = []
    chunk = OBSERVE_CHUNK if weights else t_q - first
    for start in range(first, t_q, chunk):
        end = min(start + chunk, t_q)
        width = slots.shape[1]
        if end < t_q:
            last = query_positions[:, end - 1 : end]  # [N, 1]: the chunk's last query
            width = int(((key_positions <= last) & (slots >= 0)).sum(dim=1).max())
        if dense_decode:  # one chunk of one query
            result = ops.get("decode_attention", _BACKEND)(
                query_split,
                key_cache,
                value_cache,
                slots,
                scale=scaling,
                return_weights=weights,
                check=False,  # built from the layer's own tables and pool
            )
        else:
            result = attention(
                query_split[:, start:end],
                key_cache,
                value_cache,
                slots[:, :width],
                key_positions[:, :width],
                query_positions[:, start:end],
                scale=scaling,
                window=window,
                return_weights=weights,
                check=False,  # built from the layer's own tables and pool
            )
        if weights:
            layer.observe_attention(result.weights)
        outs.append(result.out)
    return layer.merge_output(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))


def register() -> None:
    """Register ``"kvstack"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvstack_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvstack_mask)
