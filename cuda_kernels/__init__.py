"""kvstack.cuda_kernels — C++ kernels for the hot paths, registered as PyTorch custom ops.

``load()`` returns the CUDA implementations this machine can run (the ``cuda`` backend),
``load_cpu()`` the C++ ones for CPU tensors (the ``cpp`` backend), each keyed by operation name,
or raises ``BackendUnavailable`` with the reason (no CUDA device, no compiler, no kernels yet, a
failed build). The op registry (``kvstack.ops``) records that reason; it never substitutes
another backend silently.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
CPU_SOURCES: dict[str, str] = {
    "copy_slots": "copy_slots_cpu.cpp",
    "paged_attention": "paged_decode_cpu.cpp",  # decode steps; prefill through compiled
    "decode_attention": "paged_decode_cpu.cpp",
    "multi_segment_attention": "paged_decode_cpu.cpp",  # a decode kernel call per segment
    "ragged_decode_attention": "ragged_decode_cpu.cpp",
}
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
        build = cpp_extension._get_build_directory(_CPU_LIBRARY, verbose=False)
        with _build_lock(build):
            _load_cpu_library(cpp_extension, sources)
    except Exception as error:  # a failed build is reported, never replaced silently
        raise BackendUnavailable(f"cpp backend: building {sources} failed: {error}") from error
    return _cpu_operations()


@contextlib.contextmanager
def _build_lock(directory: str):
    """Hold an advisory lock on ``directory`` while torch checks or builds the extension there.

    torch guards a build with a lock file that it creates and deletes itself, and it waits,
    without a timeout, for a lock file it finds to go. A process killed while it holds one (a
    Ctrl-C during the first import) leaves the file behind, and every later load then hangs.
    This lock is the kernel's (``fcntl.flock``): it goes when its holder dies. Every kvstack
    load takes it before torch's, so a torch lock file found while holding it belongs to no
    load in progress, and is removed."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "kvstack.flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):
                warnings.warn(
                    f"removing {stale}: a build lock that a killed process left behind",
                    stacklevel=4,
                )
                with contextlib.suppress(FileNotFoundError):
                    os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _load_cpu_library(cpp_extension, sources: list[str]) -> None:
    """Build (once per machine) and load the C++ kernels as ``torch.ops.kvstack_cpu``."""
    cpp_extension.load(
        name=_CPU_LIBRARY,
        sources=sources,
        # The build is per machine (cached where torch keeps extensions), so it may use
        # the machine's vector units; reassociation lets the dot products and sums
        # vectorize (the results stay within the float tolerance of the reference), while
        # infinities and NaN keep their meaning (no finite-math assumption).
        extra_include_paths=[str(HERE)],  # cpu_attention.h, shared by the kernels
        extra_cflags=[
            "-O3",
            "-march=native",
            "-ffast-math",
            "-fno-finite-math-only",
        ],
        is_python_module=False,
        verbose=False,
    )


def _cpu_operations() -> dict[str, Callable]:
    """The loaded C++ kernels' operations, keyed by operation name (their fake kernels
    registered for torch.compile)."""
    library = getattr(torch.ops, _CPU_LIBRARY)

    @torch.library.register_fake(f"{_CPU_LIBRARY}::copy_slots")
    def _(key_cache, value_cache, src_slots, dst_slots) -> None:  # in place: no outputs
        return None

    @torch.library.register_fake(f"{_CPU_LIBRARY}::paged_decode")
    def _(query, key_cache, value_cache, slots, key_positions, query_positions, first, scale, ask):
        batch, _, heads, head_dim = query.shape
        out = query.new_empty((batch, 1, heads, head_dim))  # [B, 1, H_q, D], the query's dtype
        lse = query.new_empty((batch, 1, heads), dtype=torch.float32)
        weights = query.new_empty(
            (batch if ask else 0, heads, 1, slots.shape[1]), dtype=torch.float32
        )
        return out, lse, weights

    @torch.library.register_fake(f"{_CPU_LIBRARY}::ragged_decode")
    def _(query, key_cache, value_cache, slots, lengths, members, work, scale):
        batch, _, heads, head_dim = query.shape
        out = query.new_empty((batch, 1, heads, head_dim))  # [B, 1, H_q, D], the query's dtype
        return out, query.new_empty((batch, 1, heads), dtype=torch.float32)

    def copy_slots(key_cache, value_cache, src_slots, dst_slots) -> None:
        """Implements ``kvstack.reference.repack.copy_slots`` (in place, CPU tensors)."""
        library.copy_slots(key_cache, value_cache, src_slots, dst_slots)

    paged_attention, decode_attention = _cpu_decode_attention(library)
    return {
        "copy_slots": copy_slots,
        "paged_attention": paged_attention,
        "decode_attention": decode_attention,
        "multi_segment_attention": _cpu_multi_segment_attention(paged_attention),
        "ragged_decode_attention": _cpu_ragged_decode_attention(library),
    }


def _cpu_multi_segment_attention(paged_attention: Callable) -> Callable:
    from kvstack.reference.merge import merge_attention_states
    from kvstack.reference.merge import multi_segment_attention as reference_multi_segment

    def multi_segment_attention(query, segments, query_positions, *, scale=None):
        """Implements ``kvstack.reference.merge.multi_segment_attention``: each segment through
        this backend's ``paged_attention`` (a decode step in the C++ kernel), the few states
        merged by the reference's log-sum-exp fold (a handful of small tensor ops, cheaper
        than a compiled call for two or three segments)."""
        return reference_multi_segment(
            query,
            segments,
            query_positions,
            scale=scale,
            attention=paged_attention,
            merge=merge_attention_states,
        )

    return multi_segment_attention


def _cpu_decode_attention(library: Any) -> tuple[Callable, Callable]:
    """``paged_attention`` and ``decode_attention`` for CPU tensors: decode steps, with or
    without weights, in the C++ kernel (``paged_decode_cpu.cpp``), everything else (prefill
    chunks, tensors elsewhere, mixed dtypes, pools whose slots are not one row) through the
    compiled kernels."""
    import math

    from kvstack.compiled.attention import decode_attention as compiled_decode_attention
    from kvstack.compiled.attention import paged_attention as compiled_paged_attention
    from kvstack.reference.attention import (
        AttentionOutput,
        check_attention_args,
        check_decode_args,
    )

    empty = torch.empty(0, dtype=torch.long)  # no window; for decode_attention, no positions

    def runs_here(query, key_cache, value_cache) -> bool:
        return (
            query.shape[1] == 1
            and query.device.type == "cpu"
            and query.dtype == key_cache.dtype == value_cache.dtype  # the spec allows mixed
            and _plain_pool(key_cache, value_cache)
        )

    def paged_attention(
        query,
        key_cache,
        value_cache,
        slots,
        key_positions,
        query_positions,
        *,
        scale=None,
        window=None,
        return_weights=False,
        check=True,
    ):
        """Implements ``kvstack.reference.attention.paged_attention``: a decode step in the C++
        kernel (its weights too, for eviction policies), anything else through the compiled
        kernels."""
        if not runs_here(query, key_cache, value_cache):
            return compiled_paged_attention(
                query,
                key_cache,
                value_cache,
                slots,
                key_positions,
                query_positions,
                scale=scale,
                window=window,
                return_weights=return_weights,
                check=check,
            )
        if check:
            check_attention_args(
                query, key_cache, value_cache, slots, key_positions, query_positions, window
            )
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        first = empty if window is None else query_positions - window + 1  # [B, 1]
        out, lse, weights = library.paged_decode(
            query,
            key_cache,
            value_cache,
            slots,
            key_positions,
            query_positions,
            first,
            scale,
            return_weights,
        )
        return AttentionOutput(out, lse, weights if return_weights else None)

    def decode_attention(
        query, key_cache, value_cache, slots, *, scale=None, return_weights=False, check=True
    ):
        """Implements ``kvstack.reference.attention.decode_attention``: in the C++ kernel
        without positions (every slot of a live view is visible)."""
        if not runs_here(query, key_cache, value_cache):
            return compiled_decode_attention(
                query,
                key_cache,
                value_cache,
                slots,
                scale=scale,
                return_weights=return_weights,
                check=check,
            )
        if check:
            check_decode_args(query, key_cache, value_cache, slots)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        out, lse, weights = library.paged_decode(
            query, key_cache, value_cache, slots, empty, empty, empty, scale, return_weights
        )
        return AttentionOutput(out, lse, weights if return_weights else None)

    # On CPU tensors the kernel's cost follows each row's visible keys, not its padded width:
    # a caller that would cut rows into pieces to spare padded work (the engine's decode)
    # needs not. (The registry gives another backend for tensors elsewhere: ops.get(device=).)
    paged_attention.skips_padding = True
    decode_attention.skips_padding = True
    return paged_attention, decode_attention


def _cpu_ragged_decode_attention(library: Any) -> Callable:
    """``ragged_decode_attention`` for CPU tensors in the C++ kernel (``ragged_decode_cpu.cpp``);
    queries and pools of different dtypes, tensors elsewhere and pools whose slots are not one
    row go to the compiled kernel."""
    import math

    from kvstack.compiled.ragged import ragged_decode_attention as compiled_ragged
    from kvstack.reference.attention import AttentionOutput
    from kvstack.reference.ragged import check_ragged_args

    def ragged_decode_attention(
        query, key_cache, value_cache, slots, lengths, members, work, *, scale=None, check=True
    ):
        """Implements ``kvstack.reference.ragged.ragged_decode_attention``: the work list's
        rows as the kernel's tasks, each (sequence, row) a partial state per member, merged per
        KV head by log-sum-exp."""
        args = (query, key_cache, value_cache, slots, lengths, members, work)
        runs_here = (
            query.device.type == "cpu"
            and query.dtype == key_cache.dtype == value_cache.dtype
            and _plain_pool(key_cache, value_cache)
        )
        if not runs_here:
            return compiled_ragged(*args, scale=scale, check=check)
        if check:
            check_ragged_args(*args)
        scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
        out, lse = library.ragged_decode(*args, scale)
        return AttentionOutput(out, lse, None)

    return ragged_decode_attention


def _plain_pool(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the C++ decode kernel reads these pools: each slot's [H_kv, D] values one
    contiguous row (blocks and rows may be strided: an arena's interleaved K/V views qualify)."""
    return all(
        cache.dim() == 4 and cache.stride(3) == 1 and cache.stride(2) == cache.shape[3]
        for cache in (key_cache, value_cache)
    )
