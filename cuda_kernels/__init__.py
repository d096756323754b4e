"""kvstack.cuda_kernels — CUDA C++ kernels for the hot paths, registered as PyTorch custom ops.

``load()`` returns the implementations this machine can run, keyed by operation name, or raises
``BackendUnavailable`` with the reason (no CUDA device, no compiler, no kernels yet). The op
registry (``kvstack.ops``) records that reason; it never substitutes another backend silently.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvstack.errors import BackendUnavailable

# Operation name -> CUDA source file in this folder. Empty until the first kernel lands; the
# compiled (torch.compile) backend covers CUDA devices meanwhile.
KERNEL_SOURCES: dict[str, str] = {}


def load() -> dict[str, Callable]:
    if not torch.cuda.is_available():
        raise BackendUnavailable(
            "cuda backend: no CUDA device (torch.cuda.is_available() is False)"
        )
    if not KERNEL_SOURCES:
        raise BackendUnavailable("cuda backend: no CUDA kernels are implemented yet")
    raise BackendUnavailable("cuda backend: kernel build is not wired yet")
