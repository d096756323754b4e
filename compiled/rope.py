"""torch.compile implementations of ``kvstack.reference.rope.rotate_keys`` / ``rerotate_keys``.

cos/sin come from the model's rotary module exactly as in the reference (a small eager call);
the rotation of the keys, the part that touches every key byte, is one fused compiled kernel.
"""

from __future__ import annotations

import torch

from kvstack.reference import rope as _reference


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
    """Implements ``kvstack.reference.rope.rotate_keys`` with the compiled rotation."""
    return _reference.rotate_keys(pre_rope_keys, positions, rotary_emb, apply=apply_rotary)


def rerotate_keys(
    keys: torch.Tensor, delta: torch.Tensor, rotary_emb: torch.nn.Module
) -> torch.Tensor:
    """Implements ``kvstack.reference.rope.rerotate_keys`` with the compiled rotation."""
    return _reference.rerotate_keys(keys, delta, rotary_emb, apply=apply_rotary)
