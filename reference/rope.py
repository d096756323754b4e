"""Chunked RoPE: rotate pre-RoPE keys at chosen positions, and re-rotate stored keys (InferScale).

A key computed once (for a retrieved fact, a reused prefix) can be injected at any position if it
is stored before rotation, or re-rotated by a position delta if it was stored rotated. RoPE is a
rotation by angle p * theta_i on each pair of dimensions, so R(p + delta) = R(delta) R(p).

We take cos/sin from the model's own rotary embedding module (``model.model.rotary_emb``), so the
frequencies are exactly the model's, whatever its rope type (default, linear, llama3, yarn, ...).
Hugging Face multiplies cos and sin by ``attention_scaling`` (yarn's mscale; 1 otherwise):

    rotate_keys:    k(p)      = k_pre * cos(p)s + rotate_half(k_pre) * sin(p)s    (what the model does)
    rerotate_keys:  k(p + d)  = k(p) * cos(d) + rotate_half(k(p)) * sin(d)        (pure rotation)

so re-rotation divides the module's cos/sin by ``attention_scaling`` before applying them, and
rerotate(rotate(k, p), d) == rotate(k, p + d). Exact for every rope type whose frequencies do not
depend on the sequence length (not "dynamic" NTK, whose frequencies change with length).
The layout is Hugging Face's ``rotate_half`` (the two halves of head_dim are the pairs).
"""

from __future__ import annotations

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.checks import FLOAT_DTYPES, check_tensor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by per-token ``cos``/``sin`` [T, D]; computed in float32."""
    cos = cos.float()[:, None, :]  # [T, 1, D]: the same angle for every head
    sin = sin.float()[:, None, :]
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def rotary_cos_sin(
    rotary_emb: torch.nn.Module, positions: torch.Tensor, *, unscaled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] float32 from the model's rotary module at ``positions`` [T].

    ``unscaled=True`` divides out ``attention_scaling``, leaving a pure rotation."""
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32))
    inv_freq = getattr(rotary_emb, "inv_freq", None)
    if inv_freq is None:
        raise InvalidArgumentError(
            f"rotary_emb must be a Hugging Face rotary embedding with an inv_freq buffer, got "
            f"{type(rotary_emb).__name__}"
        )
    probe = torch.zeros(1, dtype=torch.float32, device=inv_freq.device)
    cos, sin = rotary_emb(probe, positions.to(inv_freq.device)[None, :])  # [1, T, D]
    cos, sin = cos[0].float(), sin[0].float()
    if unscaled:
        scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
        cos, sin = cos / scaling, sin / scaling
    return cos, sin


def _check_keys(keys: torch.Tensor, n_positions: int, name: str) -> None:
    check_tensor("keys", keys, ndim=3, dtypes=FLOAT_DTYPES)
    if keys.shape[0] != n_positions:
        raise InvalidArgumentError(
            f"{name} has {n_positions} entries but keys has {keys.shape[0]} tokens"
        )


def rotate_keys(
    pre_rope_keys: torch.Tensor,
    positions: torch.Tensor,
    rotary_emb: torch.nn.Module,
    *,
    apply=apply_rotary,
) -> torch.Tensor:
    """Keys [T, H, D] stored before rotation, rotated exactly as the model would at ``positions``.

    ``apply`` is the rotation kernel (an ``apply_rotary`` implementation)."""
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int64, torch.int32))
    _check_keys(pre_rope_keys, positions.numel(), "positions")
    cos, sin = rotary_cos_sin(rotary_emb, positions)
    return apply(pre_rope_keys, cos.to(pre_rope_keys.device), sin.to(pre_rope_keys.device))


def rerotate_keys(
    keys: torch.Tensor,
    delta: torch.Tensor,
    rotary_emb: torch.nn.Module,
    *,
    apply=apply_rotary,
) -> torch.Tensor:
    """Keys [T, H, D] rotated at some positions p, moved to p + ``delta`` [T] (delta may be < 0).

    ``apply`` is the rotation kernel (an ``apply_rotary`` implementation)."""
    check_tensor("delta", delta, ndim=1, dtypes=(torch.int64, torch.int32))
    _check_keys(keys, delta.numel(), "delta")
    cos, sin = rotary_cos_sin(rotary_emb, delta, unscaled=True)
    return apply(keys, cos.to(keys.device), sin.to(keys.device))
