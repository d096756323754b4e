"""Decode tokens of head-wise requests (``HeadwiseCache``), every request of a step in one pass
per layer.

After its prompt, a head-wise layer only appends: each KV head's table keeps its compressed
prompt and every decode token (Tangram compresses once). ``serve_attention``'s general path
hands each request's decode token to its own cache (``update``: room, one slot per table, two
row copies, the table's record), builds each request's live view (a sort of its tables' liveness)
and pads the views into one ragged decode attention call. Per request and layer those are a
dozen small tensor ops and Python calls; for SmolLM2 on a CPU, six requests' appends and views
cost about as much per step as the ragged attention itself.

Here the requests whose layer is past its prompt (``steady_layer``) share that work per layer:

1. **Append.** Each table's slot comes from its own free list, in the step's request order
   (``evicting_decode.take_slots``, the general path's order); the K/V rows of every request go
   into the arena in one copy each (``evicting_decode.store_decode_tokens``).
2. **View.** The requests' tables are stacked and sorted once: each row's live tokens in
   logical order, then slot -1 (``TokenTableBatch.live_view``'s rule, for all rows at once).
3. **Attend.** One ragged decode attention call from the profile's ahead-of-time work list,
   with the same tables, lengths and queries the general path builds.

The tables after a step are the general path's, and so are the attention's inputs, so each
request gets the tokens it gets there: ``spec_tests/test_serve_headwise_decode.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack import ops
from kvstack.hf import attention as kv_attention
from kvstack.hf.headwise import HeadwiseCache, HeadwiseLayer
from kvstack.policies import stack_columns
from kvstack.serve import evicting_decode


def steady_layer(cache: Any, layer_idx: int) -> HeadwiseLayer | None:
    """``cache``'s layer ``layer_idx`` when its next one-token step may be a batched head-wise
    decode: its prompt is in and compressed (so it wants no attention weights and evicts
    nothing), no prefill is held back, no sliding window. Else None (and always None within
    ``evicting_decode.general_path_only``)."""
    if not evicting_decode.batching_enabled() or not isinstance(cache, HeadwiseCache):
        return None
    layer = cache.layers[layer_idx]
    if type(layer) is not HeadwiseLayer or not layer.is_initialized:
        return None
    if not layer.prefilled or layer.pending is not None or layer.window is not None:
        return None
    return layer


def group_key(layer: HeadwiseLayer) -> tuple:
    """What layers (of one model layer) must share to be attended in one call: the same arena
    seen as the same blocks (storage, shape, strides) and the same work list, which caches have
    when they share their profile object and their workers (``HeadwiseCache.ragged_plan``)."""
    key = layer.pool.key
    return (
        key.data_ptr(),
        tuple(key.shape),
        key.stride(),
        id(layer.cache.profile),
        layer.cache.workers,
    )


def attend_steady_decodes(
    layers: list[HeadwiseLayer],
    rows: list[int],
    tokens: list[int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> list[torch.Tensor]:
    """One decode token of each of R requests through their steady layers (one ``group_key``),
    whose tables hold a slot for it (``evicting_decode.take_slots``): request i's token is
    ``query``/``key``/``value`` [B, H, T, D] at row ``rows[i]`` and step position
    ``tokens[i]``. Stores every token and attends. Returns [1, 1, H_q, D] per request, in
    order."""
    first = layers[0]
    pool = first.pool
    device = pool.key.device

    # 1. Append.
    pick_rows, pick_tokens = evicting_decode.store_decode_tokens(layers, rows, tokens, key, value)

    # 2. View: every table's live tokens in logical order, then -1. A stable sort of "dead"
    # puts each row's live tokens first (rows shorter than the longest are padded dead).
    alive = stack_columns([layer.batch.alive for layer in layers], fill=False)  # [R * G, T]
    slots = stack_columns([layer.batch.slots for layer in layers], fill=-1)  # [R * G, T]
    live = [count for layer in layers for count in layer.batch.num_live]
    width = max(live)
    order = torch.sort(~alive, dim=1, stable=True).indices[:, :width]  # [R * G, width]
    lengths = torch.tensor(live, device=device)[:, None]  # [R * G, 1]
    padding = torch.arange(width, device=device)[None, :] >= lengths  # [R * G, width]
    tables = slots.gather(1, order).masked_fill(padding, -1)

    # 3. Attend: the tables of each request's KV heads, in the plan's group order.
    members, work = first.ragged_plan()
    heads = first.groups  # one KV head per table
    order_of_groups = members[:, 0]
    tables = tables.view(len(layers), heads, width)[:, order_of_groups]  # [R, G, width]
    lengths = lengths.view(len(layers), heads, 1)[:, order_of_groups]  # [R, G, 1]
    result = ops.get("ragged_decode_attention", kv_attention._BACKEND)(
        query[pick_rows, :, pick_tokens][:, None],  # [R, 1, H_q, D]
        pool.key,
        pool.value,
        tables,
        lengths,
        members,
        work,
        scale=scaling,
        check=False,  # built from the layers' own tables and the shared arena
    )
    for layer in layers:
        layer.after_attention()  # past the prompt: nothing to evict
    return list(result.out.split(1))  # [1, 1, H_q, D] each
