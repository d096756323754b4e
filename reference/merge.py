"""Multi-segment attention: attention over non-contiguous KV segments, merged exactly (AsymCache).

If segment s gives out_s and lse_s = log sum_{j in s} exp(score_j) for a query, then attention
over the union of the segments is

    lse = log sum_s exp(lse_s),   out = sum_s exp(lse_s - lse) * out_s.

One convention everywhere: natural log. An empty segment has lse = -inf and out = 0, and merges
as the identity; if every segment is empty the result is out = 0, lse = -inf. This is the same
rule FlashAttention uses between tiles and FlashInfer exposes as ``merge_state``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.attention import AttentionOutput, paged_attention
from kvstack.reference.checks import FLOAT_DTYPES, check_tensor


def check_merge_args(outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> None:
    if len(outputs) == 0 or len(outputs) != len(lses):
        raise InvalidArgumentError(
            f"outputs and lses must be non-empty and of equal length, got {len(outputs)} and {len(lses)}"
        )
    first = check_tensor("outputs[0]", outputs[0], dtypes=FLOAT_DTYPES)
    if first.dim() < 2:
        raise InvalidArgumentError(
            f"outputs[0] must be [..., H, D], got shape {tuple(first.shape)}"
        )
    for i, (out, lse) in enumerate(zip(outputs, lses, strict=True)):
        check_tensor(
            f"outputs[{i}]",
            out,
            shape=tuple(first.shape),
            dtypes=(first.dtype,),
            device=first.device,
        )
        check_tensor(
            f"lses[{i}]",
            lse,
            shape=tuple(first.shape[:-1]),
            dtypes=FLOAT_DTYPES,
            device=first.device,
        )


def merge_two(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two attention states (float32). Where both are empty the result stays empty."""
    lse = torch.logaddexp(lse_a, lse_b)  # [..., H]; -inf only if both are -inf
    both_empty = lse == -math.inf
    safe = torch.where(both_empty, torch.zeros_like(lse), lse)
    weight_a = torch.exp(lse_a - safe)[..., None]  # exp(-inf) = 0 for an empty segment
    weight_b = torch.exp(lse_b - safe)[..., None]
    return weight_a * out_a + weight_b * out_b, lse


def merge_attention_states(
    outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-segment states: ``outputs[s]`` [..., H, D], ``lses[s]`` [..., H] (natural log).

    Returns (out [..., H, D] in the outputs' dtype, lse [..., H] float32)."""
    check_merge_args(outputs, lses)
    out = outputs[0].float()
    lse = lses[0].float()
    for next_out, next_lse in zip(outputs[1:], lses[1:], strict=True):
        out, lse = merge_two(out, lse, next_out.float(), next_lse.float())
    return out.to(outputs[0].dtype), lse


def multi_segment_attention(
    query: torch.Tensor,
    segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    query_positions: torch.Tensor,
    *,
    scale: float | None = None,
    attention=paged_attention,
    merge=merge_attention_states,
) -> AttentionOutput:
    """Attention over several segments, each ``(key_cache, value_cache, slots, key_positions)``
    (their own pools and tables), computed segment by segment and merged by log-sum-exp."""
    if not segments:
        raise InvalidArgumentError("segments must name at least one segment, got none")
    states = [
        attention(query, key_cache, value_cache, slots, key_positions, query_positions, scale=scale)
        for key_cache, value_cache, slots, key_positions in segments
    ]
    out, lse = merge([s.out for s in states], [s.lse for s in states])
    return AttentionOutput(out, lse, None)
