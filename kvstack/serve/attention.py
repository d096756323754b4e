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

  Ragged rows padded to the widest would compute every row at the longest request's length
  (with ShareGPT's lengths, 2 to 3 times the keys there are). So when no layer wants weights,
  each row's keys are cut into pieces of ``DECODE_PIECE`` keys, the pieces are the rows of the
  one call, and each row's pieces are merged by their log-sum-exp: split-K across requests
  (FlashDecoding's split, with ``kvstack.reference.merge``'s rule). The call then computes at
  most a piece of padding per row. Only the order of the floating-point sums differs.
* **decode tokens of batched paths**: evicting requests at their budget
  (``kvstack.serve.evicting_decode``) and head-wise requests past their prompt
  (``kvstack.serve.headwise_decode``) are stored, attended (and evicted) per layer for all of
  them at once, instead of through each request's cache.
* **prefill work**, and any layer the batch cannot take (a sliding window, a prefill the cache
  holds back in chunks, pools of another geometry): ``kvstack_attention`` per request, as before.

Lossless requests of the engine whose K/V live in ``StackedKV`` stores come with a
``StepContext`` instead of segments: the step's slots, computed once per forward pass, give each
layer one scatter of every request's K/V, one call for all decode tokens (split the same way)
and one per prefill chunk.

This is ``kvstack.hf.attention._attend_tables`` for several layers at once; a request's output
does not depend on which others share its step (the batched kernel attends each row alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from kvstack import ops
from kvstack.hf import attention as kv_attention
from kvstack.hf import kvstack_attention
from kvstack.reference.attention import AttentionOutput
from kvstack.serve import evicting_decode, headwise_decode

SEGMENTS_KWARG = "kvstack_segments"  # the step's segments, passed through the model call
UNSUPPORTED = ("softcap", "s_aux", "sinks")  # kvstack_attention refuses these; it says why
# Keys per piece of a split decode row (``attend_decodes``): a multiple of the compiled kernel's
# 64-key chunk, so a piece adds no padding of its own there.
DECODE_PIECE = 128
# Split the rows only when that cuts the keys the call computes by at least this fraction: the
# merge costs a few small ops, which rows of alike lengths (evicting caches at their budget) would
# pay for nothing.
MIN_PIECE_SAVING = 0.25


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
    if isinstance(segments, StepContext):
        return segments.attend(module.layer_idx, query, key, value, scaling), None
    batchable = kwargs.get("sliding_window") is None and not any(
        kwargs.get(name) is not None for name in UNSUPPORTED
    )
    outs: list[torch.Tensor | None] = [None] * len(segments)
    decodes: list[tuple[int, Any]] = []  # (segment index, its cache layer)
    # (batched path, what its layers share) -> (segment index, steady layer)
    steady: dict[tuple, list[tuple[int, Any]]] = {}
    for index, segment in enumerate(segments):
        r, s, e = segment.row, segment.start, segment.end
        if batchable and e - s == 1:
            group = _steady_group(segment.cache, module.layer_idx)
            if group is not None:  # stored and attended (and evicted) with its peers below
                evicting_decode.take_slots(group[1])  # in the step's order, as update's
                steady.setdefault(group[0], []).append((index, group[1]))
                continue
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
    for (path, _), members in steady.items():
        attended = path.attend_steady_decodes(
            [layer for _, layer in members],
            [segments[i].row for i, _ in members],
            [segments[i].start for i, _ in members],
            query,
            key,
            value,
            scaling,
        )
        for (index, _), out in zip(members, attended, strict=True):
            outs[index] = out
    # A packed step: [1, T, H_q, D]; a batch of one decode row per request: [R, 1, H_q, D].
    return torch.cat(outs, dim=0 if query.shape[0] > 1 else 1), None


def _steady_group(cache: Any, layer_idx: int) -> tuple[tuple, Any] | None:
    """((batched path, what the layers it attends together share), the layer) when ``cache``'s
    layer ``layer_idx`` takes a batched decode path this step: an evicting layer at its budget
    (``evicting_decode``) or a head-wise one past its prompt (``headwise_decode``); else None."""
    layer = evicting_decode.steady_layer(cache, layer_idx)
    if layer is not None:
        return (evicting_decode, evicting_decode.geometry(layer)), layer
    layer = headwise_decode.steady_layer(cache, layer_idx)
    if layer is not None:
        return (headwise_decode, headwise_decode.group_key(layer)), layer
    return None


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
    layers: list[Any],
    queries: list[torch.Tensor],
    scaling: float | None,
    piece: int | None = None,
) -> list[torch.Tensor]:
    """Decode attention of several requests' layers (each just stored one token) in as few
    ``paged_attention`` calls as there are pool geometries: queries [1, H_q, 1, D] each;
    returns [1, 1, H_q, D] each, in order. ``piece``: keys per piece of a split row (default
    ``DECODE_PIECE``)."""
    piece = DECODE_PIECE if piece is None else piece
    groups: dict[tuple, list[int]] = {}
    views = []
    for index, layer in enumerate(layers):
        key_cache, value_cache, slots, positions = layer.attention_view()
        views.append((key_cache, value_cache, slots, positions))
        # Same storage, shape and strides: the same arena seen as the same blocks.
        geometry = (key_cache.data_ptr(), tuple(key_cache.shape), key_cache.stride())
        groups.setdefault(geometry, []).append(index)
    results: list[torch.Tensor | None] = [None] * len(layers)
    device = views[0][0].device
    attention = ops.get("paged_attention", kv_attention._BACKEND, device=device)
    for members in groups.values():
        key_cache, value_cache = views[members[0]][0], views[members[0]][1]
        plan = _shared_ragged_plan([layers[i] for i in members])
        if plan is not None:  # head-wise requests of one profile: one ragged call for all
            outs = _attend_ragged_rows(
                [queries[i] for i in members], [views[i] for i in members], plan, scaling
            )
            for index, out in zip(members, outs, strict=True):
                layers[index].after_attention()
                results[index] = out
            continue
        rows, slot_rows, position_rows, query_rows = [], [], [], []
        for index in members:
            layer, (_, _, slots, positions) = layers[index], views[index]
            # [1, H_q, 1, D] -> [1, 1, H_q, D] -> [tables, 1, H_q / tables, D]
            query_rows.append(layer.split_query(queries[index].transpose(1, 2)))
            slot_rows.append(slots)
            position_rows.append(positions)
            rows.append(slots.shape[0])
        # Each row's newest token: it sees every live token of its table (causal by index).
        newest = torch.cat([layers[i].query_positions(1) for i in members])  # [N, 1]
        want_weights = any(layers[i].wants_attention_weights() for i in members)
        query = torch.cat(query_rows)  # [N, 1, H', D]
        if not want_weights and _pieces_save(slot_rows, piece, attention):
            out = attend_in_pieces(
                attention,
                query,
                key_cache,
                value_cache,
                slot_rows,
                position_rows,
                newest,
                scaling,
                piece,
            )
            result = AttentionOutput(out, None, None)
        else:
            width = max(s.shape[1] for s in slot_rows)
            slots = torch.cat([_pad(s, width, -1) for s in slot_rows])  # [N, width]
            positions = torch.cat([_pad(p, width, 0) for p in position_rows])  # [N, width]
            result = attention(
                query,
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


def _shared_ragged_plan(layers: list[Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ragged plan (``PagedLayer.ragged_plan``) every one of ``layers`` runs, if they all
    run the same one (the caches of one profile object share their plans' tensors, so ``is``
    settles it) and none of them wants this step's attention weights (a prompt's last one-token
    chunk: its policy scores it), else None."""
    if any(layer.wants_attention_weights() for layer in layers):
        return None
    plans = [layer.ragged_plan() for layer in layers]
    first = plans[0]
    if first is None or any(plan is not first for plan in plans[1:]):
        return None
    return first


def _attend_ragged_rows(
    queries: list[torch.Tensor],
    views: list[tuple[torch.Tensor, ...]],
    plan: tuple[torch.Tensor, torch.Tensor],
    scaling: float | None,
) -> list[torch.Tensor]:
    """One decode token of each of R requests' layers whose tables hold one KV head each
    (``HeadwiseLayer``), through one ragged decode attention call from their shared work
    list: ``queries`` [1, H_q, 1, D] each, ``views`` their ``attention_view``s (one row per
    KV head). Returns [1, 1, H_q, D] each. ``kvstack.hf.attention._attend_ragged``, batched."""
    members, work = plan
    width = max(view[2].shape[1] for view in views)
    tables = torch.stack([_pad(view[2], width, -1) for view in views])  # [R, H_kv, width]
    tables = tables[:, members[:, 0]]  # [R, G, width]: groups of one head, in plan order
    lengths = (tables >= 0).sum(dim=2, keepdim=True)  # [R, G, 1]: live tokens come first
    query = torch.cat([q.transpose(1, 2) for q in queries])  # [R, 1, H_q, D]
    result = ops.get("ragged_decode_attention", kv_attention._BACKEND)(
        query,
        views[0][0],
        views[0][1],
        tables,
        lengths,
        members,
        work,
        scale=scaling,
        check=False,  # built from the layers' own tables and the shared pool
    )
    return list(result.out.split(1))  # [1, 1, H_q, D] each


def _pad(rows: torch.Tensor, width: int, value: int) -> torch.Tensor:
    """[N, w] -> [N, width], filled with ``value`` on the right."""
    if rows.shape[1] == width:
        return rows
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=value)


def _pieces_save(slot_rows: list[torch.Tensor], piece: int, attention: Any) -> bool:
    """Whether cutting the rows ([n_i, w_i] per layer) into pieces of ``piece`` keys computes at
    least ``MIN_PIECE_SAVING`` fewer keys than padding every row to the widest. Never for an
    ``attention`` whose cost follows each row's visible keys, not the padded width
    (``skips_padding``: the cpp backend's decode kernel): pieces would only add a merge."""
    if getattr(attention, "skips_padding", False):
        return False
    width = max(rows.shape[1] for rows in slot_rows)
    padded = sum(rows.shape[0] for rows in slot_rows) * width
    split = sum(rows.shape[0] * _piece_count(rows.shape[1], piece) * piece for rows in slot_rows)
    return split <= (1.0 - MIN_PIECE_SAVING) * padded


def _piece_count(width: int, piece: int) -> int:
    return max(1, -(-width // piece))


def attend_in_pieces(
    attention: Any,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_rows: list[torch.Tensor],
    position_rows: list[torch.Tensor],
    newest: torch.Tensor,
    scaling: float | None,
    piece: int,
) -> torch.Tensor:
    """Decode attention of N rows (``query`` [N, 1, H', D], ``newest`` [N, 1]; their slots and
    key positions as blocks of rows [n_i, w_i], one per layer, stacked in order) with each row
    cut into pieces of ``piece`` keys: one ``attention`` call over all pieces, then each row's
    pieces merged by log-sum-exp. Returns out [N, 1, H', D]: attention over each row's keys."""
    slots, positions, owner = cut_into_pieces(slot_rows, position_rows, piece)
    part = attention(
        query.index_select(0, owner),  # [P, 1, H', D]
        key_cache,
        value_cache,
        slots,
        positions,
        newest.index_select(0, owner),  # [P, 1]
        scale=scaling,
        check=False,  # built from the layers' own tables and the shared pool
    )
    return merge_pieces(part.out, part.lse, owner, query.shape[0])


def cut_into_pieces(
    slot_rows: list[torch.Tensor], position_rows: list[torch.Tensor], piece: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of keys (blocks of rows [n_i, w_i]: their slots and key positions, stacked in
    order) cut into pieces of ``piece`` keys: slots and positions [P, piece] (a piece's entries
    past its row's end are padding: slot -1, position 0) and ``owner`` [P], each piece's row.
    A row's pieces are consecutive; a row of width w has max(1, ceil(w / piece)) of them."""
    device = slot_rows[0].device
    plan = _piece_plan(tuple(tuple(rows.shape) for rows in slot_rows), piece, device)
    # Every row flattened behind one padding entry (slot -1, position 0), then read as pieces.
    pad_slot = torch.full((1,), -1, dtype=slot_rows[0].dtype, device=device)
    pad_position = torch.zeros((1,), dtype=position_rows[0].dtype, device=device)
    slots = torch.cat([pad_slot, *(rows.reshape(-1) for rows in slot_rows)])[plan.index]
    positions = torch.cat([pad_position, *(rows.reshape(-1) for rows in position_rows)])[plan.index]
    return slots, positions, plan.owner


@dataclass(frozen=True)
class _PiecePlan:
    """Where the pieces of rows of given widths come from: ``index`` [P, piece], each piece's
    entries in the rows flattened one after another behind one padding entry (index 0: a piece's
    entries past its row's end read it), and ``owner`` [P], each piece's row."""

    index: torch.Tensor
    owner: torch.Tensor


# Plans by (row shapes, piece, device). Every layer of a step has the same rows (a lossless
# cache's tables grow alike), so a step builds its plan once, not once per layer.
_PLANS: dict[tuple, _PiecePlan] = {}
_MAX_PLANS = 64


def _piece_plan(shapes: tuple[tuple[int, int], ...], piece: int, device: torch.device):
    key = (shapes, piece, device)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    indices, owners = [], []
    start, row = 1, 0  # flat index 0 is the padding entry
    for count, width in shapes:
        pieces = _piece_count(width, piece)
        column = torch.arange(pieces * piece, device=device)[None, :]  # [1, k * piece]
        first = start + width * torch.arange(count, device=device)[:, None]  # [n, 1]
        index = torch.where(column < width, first + column, 0)  # [n, k * piece]
        indices.append(index.reshape(count * pieces, piece))  # a row's pieces are consecutive
        owners.append(torch.arange(row, row + count, device=device).repeat_interleave(pieces))
        start += count * width
        row += count
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _PLANS[key] = _PiecePlan(torch.cat(indices), torch.cat(owners))
    return plan


def merge_pieces(
    out: torch.Tensor, lse: torch.Tensor, owner: torch.Tensor, rows: int
) -> torch.Tensor:
    """Merge pieces' attention states into their rows' (``kvstack.reference.merge``'s rule:
    lse = log sum_p exp(lse_p), out = sum_p exp(lse_p - lse) out_p): ``out`` [P, 1, H, D],
    ``lse`` [P, 1, H] (natural log, -inf for a piece with no visible key), ``owner`` [P] the
    row of each piece. Returns [rows, 1, H, D] in ``out``'s dtype; a row with no visible key
    gets 0."""
    lse = lse.float()
    index = owner[:, None, None].expand_as(lse)
    top = torch.full((rows, *lse.shape[1:]), -math.inf, device=lse.device).scatter_reduce(
        0, index, lse, reduce="amax"
    )  # [rows, 1, H]: each row's largest piece lse
    top = torch.where(top == -math.inf, torch.zeros_like(top), top)
    weight = torch.exp(lse - top.index_select(0, owner))  # [P, 1, H]; 0 for an empty piece
    total = torch.zeros_like(top).index_add_(0, owner, weight)  # [rows, 1, H]
    summed = torch.zeros((rows, *out.shape[1:]), device=out.device).index_add_(
        0, owner, weight[..., None] * out.float()
    )  # [rows, 1, H, D]
    merged = summed / torch.where(total == 0, torch.ones_like(total), total)[..., None]
    return merged.to(out.dtype)


@dataclass
class StepRequest:
    """One request's part of a ``StepContext``: its tokens [start, end) of the packed step,
    which are its tokens [first, first + end - start)."""

    store: Any  # its StackedKV, holding every token before this step's and room for these
    start: int
    end: int
    first: int


class StepContext:
    """A packed step of lossless requests whose K/V live in ``StackedKV`` stores, built once
    per forward pass and read by every attention layer (nano-vllm's ``Context``): the step's
    slots and each request's table are layer 0's; layer l adds l * block_size.

    Per layer that is one scatter of the step's K/V for every request, one ``paged_attention``
    call for all decode tokens (rows cut into pieces, as ``attend_decodes``), and one call per
    prefill chunk, whatever the number of requests."""

    def __init__(
        self, requests: list[StepRequest], layer_index: dict[int, int], piece: int | None = None
    ) -> None:
        piece = DECODE_PIECE if piece is None else piece
        first = requests[0].store
        self.key_cache, self.value_cache = first.key_value()
        self.block_size = first.block_size
        self.layer_index = layer_index  # model layer index -> its place among attention layers
        device = self.key_cache.device
        # [T]: where every token of the step goes, in packed order.
        self.new_slots = torch.cat(
            [r.store.base_slots(r.first, r.first + r.end - r.start) for r in requests]
        )
        decodes = [r for r in requests if r.end - r.start == 1]
        self.prefills = []  # (start, end, slots [1, W], key positions [1, W], queries [1, T])
        for r in requests:
            if r.end - r.start == 1:
                continue
            last = r.first + r.end - r.start
            self.prefills.append(
                (
                    r.start,
                    r.end,
                    r.store.base_slots(0, last)[None],
                    torch.arange(last, device=device)[None],
                    torch.arange(r.first, last, device=device)[None],
                )
            )
        self.decode_tokens = torch.tensor([r.start for r in decodes], device=device)  # [R_d]
        self.decode_rows = None
        if decodes:
            # Each decode row reads its tokens [0, its newest]: cut into pieces when that
            # computes fewer keys than padding every row to the widest.
            widths = [r.first + 1 for r in decodes]
            slot_rows = [
                r.store.base_slots(0, w)[None] for r, w in zip(decodes, widths, strict=True)
            ]
            position_rows = [torch.arange(w, device=device)[None] for w in widths]
            newest = torch.tensor([w - 1 for w in widths], device=device)[:, None]  # [R_d, 1]
            attention = ops.get("paged_attention", kv_attention._BACKEND, device=device)
            if not _pieces_save(slot_rows, piece, attention):
                piece = max(widths)  # one piece per row: the rows padded to the widest
            slots, positions, owner = cut_into_pieces(slot_rows, position_rows, piece)
            # One piece per row: the pieces' outputs are the rows', with nothing to merge.
            self.decode_uncut = len(owner) == len(decodes)
            # [P, piece] each; slot -1 stays -1 in every layer.
            self.decode_rows = (slots, slots < 0, positions, newest.index_select(0, owner))
            self.decode_owner = owner
            # [P]: each piece's query, by its token in the packed step (composed once here, so
            # a layer selects its pieces' queries with one index_select).
            self.decode_queries = self.decode_tokens.index_select(0, owner)
            self.decode_count = len(decodes)

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """Store the layer's packed K/V ([1, H_kv, T, D]) and attend its queries ([1, H_q, T,
        D]); returns [1, T, H_q, D]."""
        offset = self.layer_index[layer_idx] * self.block_size
        heads, head_dim = key.shape[1], key.shape[3]
        rows = (-1, heads, head_dim)  # the arena as [S, H_kv, D]
        slots = self.new_slots + offset
        # [1, H_kv, T, D] -> [T, H_kv, D]: one row per token, in packed order.
        self.key_cache.view(rows).index_copy_(0, slots, key[0].transpose(0, 1))
        self.value_cache.view(rows).index_copy_(0, slots, value[0].transpose(0, 1))
        query_rows = query[0].transpose(0, 1)  # [T, H_q, D]
        out = torch.empty_like(query_rows)
        attention = ops.get("paged_attention", kv_attention._BACKEND, device=self.key_cache.device)
        if self.decode_rows is not None:
            piece_slots, padding, positions, newest = self.decode_rows
            part = attention(
                query_rows.index_select(0, self.decode_queries)[:, None],  # [P, 1, H_q, D]
                self.key_cache,
                self.value_cache,
                (piece_slots + offset).masked_fill(padding, -1),
                positions,
                newest,
                scale=scaling,
                check=False,  # built from the requests' own pages in the engine's arena
            )
            if self.decode_uncut:  # a row with nothing visible is 0 either way
                merged = part.out
            else:
                merged = merge_pieces(part.out, part.lse, self.decode_owner, self.decode_count)
            out.index_copy_(0, self.decode_tokens, merged[:, 0])
        for start, end, table, positions, queries in self.prefills:
            part = attention(
                query_rows[None, start:end],  # [1, T_r, H_q, D]
                self.key_cache,
                self.value_cache,
                table + offset,
                positions,
                queries,
                scale=scaling,
                check=False,
            )
            out[start:end] = part.out[0]
        return out[None]  # [1, T, H_q, D]
