"""torch.compile implementations of ``kvstack.reference.rope.rotate_keys`` / ``rerotate_keys``.

cos/sin come from the model's rotary module exactly as in the reference (a small eager call);
the rotation of the keys, the part that touches every key byte, is one fused compiled kernel.
"""

from __future__ import annotations

import torch

from kvstack.reference.checks import check_tensor
from kvstack.reference.rope import _check_keys, rotary_cos_sin


@torch.compile(dynamic=True)
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Implements ``kvstack.reference.rope.apply_rotary``: x [T, H, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)


def rotate_keys(
    pre_rope_keys: torch.Tensor, positions: torch.Tensor, rotary_emb: torch.nn.Module
) -> torch.Tensor:
    """Implements ``kvstack.reference.rope.rotate_keys``."""
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32))
    _check_keys(pre_rope_keys, positions.numel(), "positions")
    cos, sin = rotary_cos_sin(rotary_emb, positions)
    return apply_rotary(pre_rope_keys, cos.to(pre_rope_keys.device), sin.to(pre_rope_keys.device))


def rerotate_keys(
    keys: torch.Tensor, delta: torch.Tensor, rotary_emb: torch.nn.Module
) -> torch.Tensor:
    """Implements ``kvstack.reference.rope.rerotate_keys``."""
    check_tensor("delta", delta, ndim=1, dtypes=(torch.int64, torch.int32))
    _check_keys(keys, delta.numel(), "delta")
    cos, sin = rotary_cos_sin(rotary_emb, delta, unscaled=True)
    return apply_rotary(keys, cos.to(keys.device), sin.to(keys.device))
