"""The engine's attention: a packed step's K/V split by request, and every request's decode token
attended in one call.

A step packs the tokens of several requests into one row ([1, H, T, D]). ``serve_attention``
hands each request's slice to that request's cache (``cache.update``, which stores it in the
request's token tables, exactly as under ``generate``). Then:

* **decode tokens** (one query of a request whose cache has every K/V in its tables): all of
  them go to one ``paged_attention`` call. This works because every request's pool is a view of
  the same arena with the same block geometry (``ArenaBlockPool``), so slot ids are arena-wide:
  the requests' token tables, padded with slot -1 to the widest, are rows of one ragged batch.
  Each row's query position is its newest token, so every live token of its table is visible,
  as in the single-request dense decode. Weights, for policies that observe them, are cut back
  to each request's own columns before its layer sees them.
* **prefill work**, and any layer the batch cannot take (a sliding window, a prefill the cache
  holds back in chunks, pools of another geometry): ``kvstack_attention`` per request, as before.

This is ``kvstack.hf.attention._attend_tables`` for several layers at once; a request's output
does not depend on which others share its step (the batched kernel attends each row alone).
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack import ops
from kvstack.hf import attention as kv_attention
from kvstack.hf import kvstack_attention

SEGMENTS_KWARG = "kvstack_segments"  # the step's segments, passed through the model call
UNSUPPORTED = ("softcap", "s_aux", "sinks")  # kvstack_attention refuses these; it says why


def serve_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Query [1, H_q, T, D] and key/value [1, H_kv, T, D] of a packed step (or [R, H, 1, D], one
    decode row per request, for hybrid models); returns [1, T, H_q, D] (or [R, 1, H_q, D]). The step's segments arrive as the forward's keyword argument
    ``kvstack_segments`` (transformers hands a model call's extra keyword arguments to every
    attention call); without them this is the kvstack attention."""
    segments = kwargs.pop(SEGMENTS_KWARG, None)
    if segments is None:
        return kvstack_attention(module, query, key, value, attention_mask, scaling, **kwargs)
    batchable = kwargs.get("sliding_window") is None and not any(
        kwargs.get(name) is not None for name in UNSUPPORTED
    )
    outs: list[torch.Tensor | None] = [None] * len(segments)
    decodes: list[tuple[int, Any]] = []  # (segment index, its cache layer)
    for index, segment in enumerate(segments):
        r, s, e = segment.row, segment.start, segment.end
        k, v = segment.cache.update(
            key[r : r + 1, :, s:e], value[r : r + 1, :, s:e], module.layer_idx
        )
        layer = kv_attention.STEP.layer
        if batchable and e - s == 1 and _decodes_alone(layer, k):
            kv_attention.STEP.layer, kv_attention.STEP.key = None, None  # attended below
            decodes.append((index, layer))
            continue
        outs[index], _ = kvstack_attention(
            module, query[r : r + 1, :, s:e], k, v, None, scaling, **kwargs
        )  # [1, e - s, H_q, D]
    if decodes:
        queries = [
            query[segments[i].row : segments[i].row + 1, :, segments[i].start : segments[i].end]
            for i, _ in decodes
        ]
        for (index, _), out in zip(
            decodes, attend_decodes([layer for _, layer in decodes], queries, scaling), strict=True
        ):
            outs[index] = out
    # A packed step: [1, T, H_q, D]; a batch of one decode row per request: [R, 1, H_q, D].
    return torch.cat(outs, dim=0 if query.shape[0] > 1 else 1), None


def _decodes_alone(layer: Any, key: torch.Tensor) -> bool:
    """Whether ``layer`` just stored one decode token whose attention reads only its tables:
    no window, no prefill held back (``pending_prefill``)."""
    return (
        layer is not None
        and kv_attention.STEP.key is key
        and layer.window is None
        and layer.pending_prefill(None) is None
    )


def attend_decodes(
    layers: list[Any], queries: list[torch.Tensor], scaling: float | None
) -> list[torch.Tensor]:
    """Decode attention of several requests' layers (each just stored one token) in as few
    ``paged_attention`` calls as there are pool geometries: queries [1, H_q, 1, D] each;
    returns [1, 1, H_q, D] each, in order."""
    groups: dict[tuple, list[int]] = {}
    views = []
    for index, layer in enumerate(layers):
        key_cache, value_cache, slots, positions = layer.attention_view()
        views.append((key_cache, value_cache, slots, positions))
        # Same storage, shape and strides: the same arena seen as the same blocks.
        geometry = (key_cache.data_ptr(), tuple(key_cache.shape), key_cache.stride())
        groups.setdefault(geometry, []).append(index)
    results: list[torch.Tensor | None] = [None] * len(layers)
    attention = ops.get("paged_attention", kv_attention._BACKEND)
    for members in groups.values():
        key_cache, value_cache = views[members[0]][0], views[members[0]][1]
        rows, slot_rows, position_rows, query_rows = [], [], [], []
        for index in members:
            layer, (_, _, slots, positions) = layers[index], views[index]
            # [1, H_q, 1, D] -> [1, 1, H_q, D] -> [tables, 1, H_q / tables, D]
            query_rows.append(layer.split_query(queries[index].transpose(1, 2)))
            slot_rows.append(slots)
            position_rows.append(positions)
            rows.append(slots.shape[0])
        width = max(s.shape[1] for s in slot_rows)
        slots = torch.cat([_pad(s, width, -1) for s in slot_rows])  # [N, width]
        positions = torch.cat([_pad(p, width, 0) for p in position_rows])  # [N, width]
        # Each row's newest token: it sees every live token of its table (causal by index).
        newest = torch.cat([layers[i].query_positions(1) for i in members])  # [N, 1]
        want_weights = any(layers[i].wants_attention_weights() for i in members)
        result = attention(
            torch.cat(query_rows),  # [N, 1, H', D]
            key_cache,
            value_cache,
            slots,
            positions,
            newest,
            scale=scaling,
            return_weights=want_weights,
            check=False,  # built above from the layers' own tables and the shared pool
        )
        start = 0
        for index, count, own in zip(members, rows, slot_rows, strict=True):
            layer = layers[index]
            if layer.wants_attention_weights():
                # [rows, H', 1, width] -> this layer's own view columns
                layer.observe_attention(result.weights[start : start + count, ..., : own.shape[1]])
            layer.after_attention()
            results[index] = layer.merge_output(result.out[start : start + count])
            start += count
    return results


def _pad(rows: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """[N, w] -> [N, width], filled with ``value`` on the right."""
    if rows.shape[1] == width:
        return rows
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=value)
