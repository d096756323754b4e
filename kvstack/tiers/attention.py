"""The ``"kvstack_tiers"`` attention: transformers' sdpa attention, plus the attention scores
that ``TieredCache`` ranks and places its pages by.

    model.set_attn_implementation("kvstack_tiers")   # after ``import kvstack.tiers``

The outputs are exactly sdpa's over the K/V the cache returned (the same call ``"sdpa"`` makes),
so the tokens do not change. What this adds: after a ``TieredLayer`` stored a step's K/V, the
attention call that follows it also scores every key the cache holds by the attention it gets
from an **observation window** of the step's last queries (SnapKV's window; at a decode step,
the one query), and hands the layer those masses (``key_attention_mass``). The cache uses them

* at prefill, to place its pages: the most attended on device, the next on host, the rest on
  disk (``TieredCache(placement="attention")``);
* at every step, as KVDrive's recent attention of each page, which ``policy="attention"``
  demotes the lowest of first;
* for ``stats()["device_attention_share"]``: how much of the attention fell on keys that were
  on the device.

The scores cost one small matmul per layer ([window x heads] queries against the keys), in
float32, beside the attention itself.

**Multi-segment attention** (AsymCache; ``TieredCache(merge_segments=True)``, on this
attention): the cache does not concatenate a layer's pages into one K/V. It hands over its
keys as **segments** by where they came from this step: the device-resident pages with the
newest tokens, the pages fetched from host and disk, and the pages recomputed from their tokens.
Each segment is attended on its own (the registered ``multi_segment_attention`` op: one
``paged_attention`` call per segment, positions giving each key its causal place) and the
results are merged by log-sum-exp, which equals attention over their union. A step whose
attention mask is not plain causal (padded rows) gathers the segments back into one K/V and
runs sdpa, so every step is exact.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstack import ops

ATTENTION_NAME = "kvstack_tiers"
OBSERVATION_WINDOW = 32  # the prompt's last queries score its pages (SnapKV's default window)


@dataclass
class Segment:
    """Keys of one layer that came from one place this step (``source``: ``"device"``,
    ``"fetched"`` or ``"recomputed"``), as a pool the paged attention reads: ``keys`` and
    ``values`` [B, T_s, H_kv, D] (row b's keys are its T_s slots), ``positions`` [T_s] (int64)
    the tokens' places in the sequence, the same for every row."""

    source: str
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor


@dataclass
class PendingScores:
    """What the last ``TieredLayer.update`` tells the attention call that follows it."""

    layer: Any = None  # the kvstack.tiers.cache.TieredLayer that stored this step's K/V
    key: torch.Tensor | None = None  # the keys update returned, to recognise the matching call
    # Multi-segment attention: the layer's keys by source (update returned only the step's
    # K/V), and how to gather them into one [B, H_kv, T_k, D] K/V for a step sdpa must run.
    segments: list[Segment] | None = None
    gather: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    def clear(self) -> None:
        self.layer = self.key = self.segments = self.gather = None


class _PendingOfThisThread(threading.local):
    """One ``PendingScores`` per thread: an update and the attention call after it run on the
    same thread, and two models generating on two threads must not see each other's."""

    def __init__(self) -> None:
        self.scores = PendingScores()


_PENDING = _PendingOfThisThread()


def pending() -> PendingScores:
    """This thread's ``PendingScores``: what the last ``TieredLayer.update`` on it handed over."""
    return _PENDING.scores


def key_attention_mass(
    query: torch.Tensor, key: torch.Tensor, scale: float | None, window: int = OBSERVATION_WINDOW
) -> torch.Tensor:
    """The attention each key receives from the last ``window`` queries, summed over query
    heads and those queries and divided by their count: [B, T_k] float32, each row summing to 1.

    ``query`` [B, H_q, T_q, D] are the step's queries, the newest tokens: query i sits at
    position T_k - T_q + i and sees keys 0 .. that position (causal). ``key`` [B, H_kv, T_k, D]
    holds every token so far; query head h reads KV head h // (H_q / H_kv)."""
    positions = torch.arange(key.shape[2], device=key.device)
    return segments_attention_mass(query, [(key, positions)], key.shape[2], scale, window)


def segments_attention_mass(
    query: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
    seen: int,
    scale: float | None,
    window: int = OBSERVATION_WINDOW,
) -> torch.Tensor:
    """``key_attention_mass`` of keys given in parts, in any order: each part is (keys
    [B, H_kv, T_p, D], their positions [T_p]), and the parts together hold positions
    0 .. ``seen`` - 1 once each. One softmax over all parts' scores (a permutation of the keys
    does not change it); returns [B, seen] in position order."""
    batch, q_heads, t_q, head_dim = query.shape
    kv_heads = parts[0][0].shape[1]
    group = q_heads // kv_heads
    w = min(window, t_q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    # [B, H_q, w, D] -> [B, H_kv, group * w, D]: the query heads of one KV head are adjacent.
    observed = query[:, :, t_q - w :].float().reshape(batch, kv_heads, group * w, head_dim)
    device = query.device
    query_positions = torch.arange(seen - w, seen, device=device).repeat(group)  # [group * w]
    scores, positions = [], []
    for keys, key_positions in parts:
        part = observed @ keys.float().transpose(-1, -2) * scale  # [B, H_kv, group * w, T_p]
        hidden = key_positions[None, :] > query_positions[:, None]  # causal
        scores.append(part.masked_fill_(hidden, -math.inf))
        positions.append(key_positions)
    mass = torch.cat(scores, dim=-1).softmax(dim=-1).sum(dim=(1, 2)) / (q_heads * w)
    if len(parts) == 1 and torch.equal(positions[0], torch.arange(seen, device=device)):
        return mass  # [B, seen]: already in position order
    ordered = torch.empty_like(mass)  # [B, seen]
    ordered[:, torch.cat(positions)] = mass
    return ordered


def segment_attention(
    query: torch.Tensor, segments: Sequence[Segment], seen: int, scale: float | None
) -> torch.Tensor:
    """Attention of the step's queries ([B, H_q, T_q, D], the newest T_q of ``seen`` tokens)
    over the segments, each attended on its own and merged by log-sum-exp
    (``multi_segment_attention``, on the kvstack attention's backend). Returns
    [B, T_q, H_q, D], transformers' layout of an attention output."""
    from kvstack.hf import attention as kv_attention

    batch, _, t_q, _ = query.shape
    device = query.device
    query_positions = torch.arange(seen - t_q, seen, device=device).expand(batch, t_q)
    rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
    op_segments = []
    for segment in segments:
        width = segment.keys.shape[1]
        # The segment's pool holds B blocks of T_s slots: row b's keys are block b.
        slots = rows * width + torch.arange(width, device=device)  # [B, T_s]
        op_segments.append(
            (segment.keys, segment.values, slots, segment.positions.expand(batch, width))
        )
    multi_segment = ops.get("multi_segment_attention", kv_attention._BACKEND, device=device)
    result = multi_segment(query.transpose(1, 2), op_segments, query_positions, scale=scale)
    return result.out  # [B, T_q, H_q, D]


def tiers_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' signature: for a ``TieredLayer`` that handed over
    segments, attention over them merged by log-sum-exp; otherwise sdpa's output. And the scores
    of the layer's keys, when its cache uses them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    handed = pending()
    layer = handed.layer if handed.key is key else None
    segments, gather = handed.segments, handed.gather
    if layer is not None:
        handed.clear()  # one update, one attention call
    # What the segments cannot express goes to sdpa over the gathered keys: a mask (padded
    # rows), dropout, or what transformers' other attentions take (softcap, sinks, a bias).
    plain = (
        attention_mask is None
        and not dropout
        and not any(
            kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks", "position_bias")
        )
    )
    if layer is not None and segments is not None and plain:
        # A plain causal step: each segment on its own, merged. (transformers passes no mask
        # when the rows have no padding and the step is causal over everything before it.)
        seen = layer.get_seq_length()
        out = segment_attention(query, segments, seen, scaling)
        if layer.cache.needs_attention:
            parts = [(s.keys.transpose(1, 2), s.positions) for s in segments]
            mass = segments_attention_mass(query, parts, seen, scaling)
            layer.observe_attention(mass, query.shape[2])
        return out, None
    if layer is not None and segments is not None:
        key, value = gather()  # sdpa, under the mask, over the gathered K/V
    out, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    if layer is not None and layer.cache.needs_attention:
        layer.observe_attention(key_attention_mass(query, key, scaling), query.shape[2])
    return out, None


def register() -> None:
    """Register ``"kvstack_tiers"`` with transformers' attention interface, and sdpa's mask
    function under the same name (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, tiers_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


__all__ = [
    "ATTENTION_NAME",
    "OBSERVATION_WINDOW",
    "Segment",
    "key_attention_mass",
    "register",
    "segment_attention",
    "segments_attention_mass",
]
