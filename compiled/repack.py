"""torch.compile implementation of ``kvstack.reference.repack.copy_slots``.

The reference copies one row per move in a Python loop; here every move is one indexed load and
one indexed store in a single fused kernel. That is safe because a repack plan's moves do not
overlap (vToken I4: no destination is a source), so the order of the copies does not matter.
"""

from __future__ import annotations

import torch


def _copy_rows(key_cache, value_cache, src_slots, dst_slots):
    num_blocks, block_size, num_heads, head_dim = key_cache.shape
    key_rows = key_cache.view(num_blocks * block_size, num_heads, head_dim)  # [S, H, D]
    value_rows = value_cache.view(num_blocks * block_size, num_heads, head_dim)
    key_rows.index_copy_(0, dst_slots, key_rows[src_slots])
    value_rows.index_copy_(0, dst_slots, value_rows[src_slots])


_copy_rows_compiled = torch.compile(_copy_rows, dynamic=True)


def copy_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Implements ``kvstack.reference.repack.copy_slots`` (in place)."""
    if not src_slots.numel():
        return
    if key_cache.untyped_storage().data_ptr() == value_cache.untyped_storage().data_ptr():
        # K and V are views of one arena buffer (``ArenaBlockPool``). torch.compile cannot trace
        # an in-place write to two aliasing inputs of changing shapes, so the same two indexed
        # copies run eagerly: two kernels either way, no Python loop over rows.
        _copy_rows(key_cache, value_cache, src_slots.long(), dst_slots.long())
        return
    _copy_rows_compiled(key_cache, value_cache, src_slots.long(), dst_slots.long())
