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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ATTENTION_NAME = "kvstack_tiers"
OBSERVATION_WINDOW = 32  # the prompt's last queries score its pages (SnapKV's default window)


@dataclass
class PendingScores:
    """What the last ``TieredLayer.update`` tells the attention call that follows it."""

    layer: Any = None  # the kvstack.tiers.cache.TieredLayer that stored this step's K/V
    key: torch.Tensor | None = None  # the keys update returned, to recognise the matching call


PENDING = PendingScores()


def key_attention_mass(
    query: torch.Tensor, key: torch.Tensor, scale: float | None, window: int = OBSERVATION_WINDOW
) -> torch.Tensor:
    """The attention each key receives from the last ``window`` queries, summed over query
    heads and those queries and divided by their count: [B, T_k] float32, each row summing to 1.

    ``query`` [B, H_q, T_q, D] are the step's queries, the newest tokens: query i sits at
    position T_k - T_q + i and sees keys 0 .. that position (causal). ``key`` [B, H_kv, T_k, D]
    holds every token so far; query head h reads KV head h // (H_q / H_kv)."""
    batch, q_heads, t_q, head_dim = query.shape
    kv_heads, t_k = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    w = min(window, t_q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    # [B, H_q, w, D] -> [B, H_kv, group * w, D]: the query heads of one KV head are adjacent.
    observed = query[:, :, t_q - w :].float().reshape(batch, kv_heads, group * w, head_dim)
    scores = observed @ key.float().transpose(-1, -2) * scale  # [B, H_kv, group * w, T_k]
    query_positions = torch.arange(t_k - w, t_k, device=key.device).repeat(group)  # [group * w]
    hidden = torch.arange(t_k, device=key.device)[None, :] > query_positions[:, None]
    scores.masked_fill_(hidden, -math.inf)
    return scores.softmax(dim=-1).sum(dim=(1, 2)) / (q_heads * w)  # [B, T_k]


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
    """Attention function with transformers' signature: sdpa's output, and the scores of the
    keys handed to the ``TieredLayer`` that returned ``key``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    layer = PENDING.layer
    if layer is not None and PENDING.key is key:
        PENDING.layer, PENDING.key = None, None  # one update, one attention call
        layer.observe_attention(key_attention_mass(query, key, scaling), query.shape[2])
    return out, None


def register() -> None:
    """Register ``"kvstack_tiers"`` with transformers' attention interface, and sdpa's mask
    function under the same name (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, tiers_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


__all__ = ["ATTENTION_NAME", "OBSERVATION_WINDOW", "key_attention_mass", "register"]
