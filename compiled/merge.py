"""torch.compile implementation of ``kvstack.reference.merge.merge_attention_states``.

All segments are merged at once (stack, one log-sum-exp) instead of the reference's pairwise fold;
the result is the same up to float rounding. Shapes are marked dynamic: one graph per segment
count, dtype and device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvstack.reference.attention import AttentionOutput
from kvstack.reference.merge import check_merge_args
from kvstack.reference.merge import multi_segment_attention as _reference_multi_segment


@torch.compile(dynamic=True)
def _merge_stacked(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # outputs [S, ..., H, D], lses [S, ..., H]
    lse = torch.logsumexp(lses, dim=0)  # [..., H]; -inf when every segment is empty
    lse_safe = torch.where(lse == -math.inf, torch.zeros_like(lse), lse)
    weights = torch.exp(lses - lse_safe)[..., None]  # [S, ..., H, 1]
    return (weights * outputs).sum(0), lse


def merge_attention_states(
    outputs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Implements ``kvstack.reference.merge.merge_attention_states``."""
    check_merge_args(outputs, lses)
    out, lse = _merge_stacked(
        torch.stack([o.float() for o in outputs]), torch.stack([x.float() for x in lses])
    )
    return out.to(outputs[0].dtype), lse


def multi_segment_attention(
    query: torch.Tensor, segments, query_positions: torch.Tensor, *, scale: float | None = None
) -> AttentionOutput:
    """Implements ``kvstack.reference.merge.multi_segment_attention`` with the compiled kernels."""
    from kvstack.compiled.attention import paged_attention

    return _reference_multi_segment(
        query,
        segments,
        query_positions,
        scale=scale,
        attention=paged_attention,
        merge=merge_attention_states,
    )
