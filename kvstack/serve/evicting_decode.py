"""Decode tokens of evicting requests, every request of a step in one pass per layer.

``serve_attention``'s general path hands each request's decode token to its own cache
(``update``), attends all of them in one call, then lets each request's layer observe the
weights and evict one token per table. Per request and layer that is the append, the view, the
observation, the victim's choice and its eviction, each a few small tensor ops and Python calls.
For SmolLM2 on a CPU that costs as much as the model itself, and it is
why an evicting engine's time per output token was far above a lossless one's at the same
batch (whose requests share one ``StepContext``).

Here the requests whose layer is in its steady decode state (``TokenTableLayer
.batched_decode_budget``: prefill done, every table at its budget, a policy with a batched
decode: H2O, SnapKV) share the work per layer:

1. **Append.** Each table's slot for the new token comes from its own free list, in the
   reference's order (``TokenTableBatch.take_slots``); the K/V rows of every request go into
   the arena in one copy, since all the engine's pools view one arena with one geometry.
2. **Attend.** One ``paged_attention`` call with weights over the requests' live views, padded
   to the widest (as ``attend_decodes``).
3. **Score.** The policy observes the step's weights, summed over each table's query heads,
   into every request's state and scores every view column at once
   (``EvictionPolicy.batched_decode_scores``: H2O's sums, SnapKV's window votes and pooling,
   gathered at the columns and stacked). One masked argmin picks every table's victim: its
   lowest score past the sinks and before the recent window, the older token on a tie
   (``EvictionPolicy.choose_one_victim_each``'s rule).
4. **Evict.** The victims' slots come back to the host in one read; each table
   marks its victim dead, frees the slot and repacks where worth it
   (``TokenTableLayer.finish_batched_decode``).

Every score is the same float the general path computes (the same additions and pooling, at
the columns instead of by logical index), and argmin is the same rule, so each request keeps
exactly the tokens its cache would keep alone:
``spec_tests/test_serve_evicting_decode.py`` pins the tokens and the tables to the general
path's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch

from kvstack import ops
from kvstack.hf import attention as kv_attention
from kvstack.hf.token_table_cache import TokenTableCache, TokenTableLayer
from kvstack.policies import stack_columns

_ENABLED = True


@contextlib.contextmanager
def general_path_only() -> Iterator[None]:
    """Within it, every evicting decode, and every head-wise one
    (``kvstack.serve.headwise_decode``), takes ``serve_attention``'s general path: what the
    batched ones are measured against (``kvstack bench serve``) and tested against."""
    global _ENABLED
    enabled, _ENABLED = _ENABLED, False
    try:
        yield
    finally:
        _ENABLED = enabled


def batching_enabled() -> bool:
    """False within ``general_path_only``."""
    return _ENABLED


def steady_layer(cache: Any, layer_idx: int) -> TokenTableLayer | None:
    """``cache``'s layer ``layer_idx`` when its next step may be a batched decode, else None.
    Only ``TokenTableLayer`` itself: a subclass (``HeadwiseLayer``'s ragged groups) keeps its
    own attention."""
    if not _ENABLED or not isinstance(cache, TokenTableCache):
        return None
    layer = cache.layers[layer_idx]
    if type(layer) is not TokenTableLayer or not layer.is_initialized:
        return None
    return layer if layer.batched_decode_budget() is not None else None


def geometry(layer: TokenTableLayer) -> tuple:
    """What layers must share to be attended together: the same arena seen as the same blocks
    (storage, shape, strides), the same split of KV heads into tables, the same policy."""
    key = layer.pool.key
    shape = (key.data_ptr(), tuple(key.shape), key.stride(), layer.groups, layer.heads_per_table)
    return (*shape, id(layer.policy))  # one policy scores them all


def take_slots(layer: TokenTableLayer) -> None:
    """Step 1's first half, called in the step's request order (so that every request's tables
    take the arena's blocks in the order the general path's appends would): room for one token
    per table (``ArenaExhausted`` changes nothing in this layer), then each table's slot for it,
    recorded in the table at once. A later request's room may compact the arena, which renames
    recorded slots with the rest of the table; the rows are written where the table says then."""
    layer._reserve(1)
    taken = layer.batch.take_slots(layer.pool, 1)
    slots = torch.tensor(taken, dtype=torch.int64, device=layer.batch.device)
    layer.batch.record_appended(slots[:, None])  # [N, 1]


def store_decode_tokens(
    layers: list[TokenTableLayer],
    rows: list[int],
    tokens: list[int],
    key: torch.Tensor,
    value: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write one decode token of each of R requests' layers (one arena, one geometry) to each
    of its tables' newest slot (``take_slots`` recorded them), in one copy for K and one for V:
    request i's token is ``key``/``value`` [B, H_kv, T, D] at row ``rows[i]`` and step position
    ``tokens[i]``. Returns (rows, tokens) as index tensors on ``key``'s device, to pick the
    requests' queries with."""
    first = layers[0]
    pool = first.pool
    per_table, head_dim = first.heads_per_table, pool.head_dim
    # Read after every request took its slots: a later request's room may have compacted the
    # arena and renamed an earlier one's.
    new_slots = torch.cat([layer.batch.slots[:, -1] for layer in layers]).to(pool.key.device)
    pick_rows = torch.tensor(rows, device=key.device)
    pick_tokens = torch.tensor(tokens, device=key.device)
    # [R, H_kv, D] -> [R * groups, per_table, D]: table-major, a table's heads together.
    table_rows = (-1, per_table, head_dim)
    arena_rows = (pool.num_slots, per_table, head_dim)  # the arena as [S, per_table, D]
    for store, step in ((pool.key, key), (pool.value, value)):
        new_rows = step[pick_rows, :, pick_tokens].reshape(table_rows).to(store.dtype)
        store.view(arena_rows).index_copy_(0, new_slots, new_rows)
    return pick_rows, pick_tokens


def attend_steady_decodes(
    layers: list[TokenTableLayer],
    rows: list[int],
    tokens: list[int],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> list[torch.Tensor]:
    """One decode token of each of R requests through their steady layers (one ``geometry``),
    whose tables hold a slot for it (``take_slots``): request i's token is
    ``query``/``key``/``value`` [B, H, T, D] at row ``rows[i]`` and step position
    ``tokens[i]``. Stores every token, attends, evicts one token per table. Returns
    [1, 1, H_q, D] per request, in order."""
    first = layers[0]
    pool = first.pool
    device = pool.key.device
    groups = first.groups

    # 1. Append: the K/V rows of every request in one copy, to each table's newest slot.
    pick_rows, pick_tokens = store_decode_tokens(layers, rows, tokens, key, value)

    # 2. Attend: every table's live tokens (budget + 1 each), padded to the widest.
    views = [layer.attention_view() for layer in layers]  # (K, V, slots [N, L], indices)
    slots = stack_columns([view[2] for view in views], fill=-1)  # [R * groups, width]
    positions = stack_columns([view[3] for view in views])  # their logical indices
    width = slots.shape[1]
    newest = torch.tensor(
        [layer.batch.num_tokens - 1 for layer in layers for _ in range(groups)], device=device
    )[:, None]  # [R * groups, 1]: each row sees all its live tokens
    # [R, H_q, D] -> [R, 1, H_q, D] -> [R * groups, 1, H_q / groups, D]
    queries = first.split_query(query[pick_rows, :, pick_tokens][:, None])
    result = ops.get("paged_attention", kv_attention._BACKEND, device=device)(
        queries,
        pool.key,
        pool.value,
        slots,
        positions,
        newest,
        scale=scaling,
        return_weights=True,
        check=False,  # built from the layers' own tables and the shared arena
    )

    # 3. Score: the policy observes the step's weights (summed over each table's query heads)
    # into every state and scores each view column.
    # [R * groups, H', 1, width] -> [R * groups, width]
    received = result.weights.sum(dim=(1, 2)).float()
    scores = first.policy.batched_decode_scores(
        [layer.state for layer in layers],
        [view[3] for view in views],
        [layer.batch.num_tokens for layer in layers],
        received,
    )  # [R * groups, width]
    # Candidates: past the sinks, before the recent window (each table holds budget + 1).
    low, high = [], []
    for layer, view in zip(layers, views, strict=True):
        budget = layer.budgets[0]
        low += [layer.policy.sink_tokens] * groups
        high += [view[3].shape[1] - layer.policy.recent_window(budget)] * groups
    column = torch.arange(width, device=device)[None, :]  # [1, width]
    candidate = (column >= torch.tensor(low, device=device)[:, None]) & (
        column < torch.tensor(high, device=device)[:, None]
    )
    # argmin returns the first minimum: the older token on a tie, as choose_one_victim_each.
    victim_column = scores.masked_fill(~candidate, math.inf).argmin(dim=1, keepdim=True)
    victims = positions.gather(1, victim_column)[:, 0]  # [R * groups] logical indices
    # The one read back to the host (the other host values go to the device).
    victim_slots = slots.gather(1, victim_column)[:, 0].tolist()

    # 4. Evict.
    out = first.merge_output(result.out)  # [R * groups, 1, H', D] -> [R, 1, H_q, D]
    for index, layer in enumerate(layers):
        own = slice(index * groups, (index + 1) * groups)  # its tables' rows
        layer.finish_batched_decode(victims[own], victim_slots[own])
    return list(out.split(1))  # [1, 1, H_q, D] each
