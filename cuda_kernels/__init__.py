"""kvstack.cuda_kernels — C++ kernels for the hot paths, registered as PyTorch custom ops.

``load()`` returns the CUDA implementations this machine can run (the ``cuda`` backend),
``load_cpu()`` the C++ ones for CPU tensors (the ``cpp`` backend), each keyed by operation name,
or raises ``BackendUnavailable`` with the reason (no CUDA device, no compiler, no kernels yet, a
failed build). The op registry (``kvstack.ops``) records that reason; it never substitutes
another backend silently.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from kvstack.errors import BackendUnavailable

HERE = Path(__file__).resolve().parent

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


# Operation name -> C++ source in this folder for CPU tensors, built with the host compiler
# (the ``cpp`` backend): what torch's indexed copies cannot do in one pass.
CPU_SOURCES: dict[str, str] = {"copy_slots": "copy_slots_cpu.cpp"}
_CPU_LIBRARY = "kvstack_cpu"


def load_cpu() -> dict[str, Callable]:
    """The C++ CPU kernels, keyed by operation name: built once per machine with
    ``torch.utils.cpp_extension`` (cached under its build directory; about 15 s on first use)
    and registered as ``torch.ops.kvstack_cpu``, or ``BackendUnavailable`` with the reason."""
    import shutil

    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BackendUnavailable(f"cpp backend: no C++ compiler ({compiler!r} is not on PATH)")
    sources = [str(HERE / source) for source in sorted(set(CPU_SOURCES.values()))]
    try:
        cpp_extension.load(
            name=_CPU_LIBRARY,
            sources=sources,
            extra_cflags=["-O3"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # a failed build is reported, never replaced silently
        raise BackendUnavailable(f"cpp backend: building {sources} failed: {error}") from error
    library = getattr(torch.ops, _CPU_LIBRARY)

    @torch.library.register_fake(f"{_CPU_LIBRARY}::copy_slots")
    def _(key_cache, value_cache, src_slots, dst_slots) -> None:  # in place: no outputs
        return None

    def copy_slots(key_cache, value_cache, src_slots, dst_slots) -> None:
        """Implements ``kvstack.reference.repack.copy_slots`` (in place, CPU tensors)."""
        library.copy_slots(key_cache, value_cache, src_slots, dst_slots)

    return {"copy_slots": copy_slots}
