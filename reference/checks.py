"""Argument checks shared by every layer.

Each check raises an error that names the argument, the value it got and what was expected,
and runs before any state is touched, so a rejected call changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstack.errors import InvalidArgumentError, InvalidDTypeError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_tensor(
    name: str,
    value: object,
    *,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check a tensor's rank, shape (None = any size), dtype and device."""
    if not isinstance(value, torch.Tensor):
        raise InvalidDTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.dim() != ndim:
        raise InvalidArgumentError(
            f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}"
        )
    if shape is not None:
        ok = value.dim() == len(shape) and all(
            want is None or got == want for got, want in zip(value.shape, shape, strict=True)
        )
        if not ok:
            expected = tuple("*" if s is None else s for s in shape)
            raise InvalidArgumentError(
                f"{name} must have shape {expected}, got {tuple(value.shape)}"
            )
    if dtypes is not None and value.dtype not in dtypes:
        raise InvalidDTypeError(
            f"{name} must have dtype in {[str(d) for d in dtypes]}, got {value.dtype}"
        )
    if device is not None and value.device != (
        device if isinstance(device, torch.device) else torch.device(device)
    ):
        raise InvalidArgumentError(f"{name} must be on device {device}, got {value.device}")
    return value


def check_index_tensor(
    name: str, value: object, *, device: torch.device | None = None
) -> torch.Tensor:
    return check_tensor(name, value, ndim=1, dtypes=(torch.int64, torch.int32), device=device)
