"""Vectorised ``kvstack.reference.arena.move_pages``: the page moves of a compaction as one
gather and one scatter.

The reference copies each run in a Python loop (every source cloned first); here the element
indices of all runs are built once, every source element is gathered (the gather is the copy
that makes reading-before-writing hold), and ``index_copy_`` writes them to their destinations.

Why not torch.compile: the run lengths change with every compaction, so a compiled graph would
re-specialise or fall back; the work is two memory-bound indexing kernels either way.
"""

from __future__ import annotations

import torch


def move_pages(
    buffer: torch.Tensor, src_offsets: torch.Tensor, dst_offsets: torch.Tensor, sizes: torch.Tensor
) -> None:
    """Implements ``kvstack.reference.arena.move_pages`` (in place)."""
    if sizes.numel() == 0:
        return
    device = buffer.device
    sizes = sizes.to(device, torch.int64)
    # Element i of the concatenated runs belongs to run r = run_of[i], at position i - start[r].
    starts = torch.cumsum(sizes, 0) - sizes  # [R] first element of each run in the concatenation
    run_of = torch.repeat_interleave(torch.arange(sizes.numel(), device=device), sizes)  # [N]
    within = torch.arange(run_of.numel(), device=device) - starts[run_of]  # [N]
    src = src_offsets.to(device, torch.int64)[run_of] + within
    dst = dst_offsets.to(device, torch.int64)[run_of] + within
    buffer.index_copy_(0, dst, buffer[src])
