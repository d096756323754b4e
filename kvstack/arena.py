"""One memory budget for every kvstack cache: ``KVArena`` (specified in
``kvstack.reference.arena``).

    arena = KVArena("2GiB", device="cuda", dtype=torch.bfloat16)
    caches = [TokenTableCache(model.config, policy=H2O(), budget=256, arena=arena) for _ in ids]

All layers, rows and caches built with ``arena=`` draw KV blocks and hybrid state pages from it;
the arena's tensor is allocated once, so the process holds exactly the budget. A cache built
without ``arena=`` gets ``KVArena.private(...)``, which grows and shrinks in segments of
``DEFAULT_SEGMENT_BYTES``. Compaction copies pages with the registered ``move_pages`` op.
"""

from __future__ import annotations

import torch

from kvstack import ops
from kvstack.errors import ArenaExhausted
from kvstack.reference.arena import (
    DEFAULT_SEGMENT_BYTES,
    PAGE_KINDS,
    ArenaBlockPool,
    Page,
    format_bytes,
    parse_bytes,
)
from kvstack.reference.arena import KVArena as _ReferenceArena


class KVArena(_ReferenceArena):
    """``kvstack.reference.arena.KVArena`` whose compactions use the fastest registered
    ``move_pages`` (the reference arena uses the reference copy)."""

    def __init__(self, capacity, *, device="cpu", dtype=None, move=None) -> None:
        super().__init__(
            capacity,
            device=device,
            dtype=torch.float32 if dtype is None else dtype,
            move=move or ops.get("move_pages"),
        )

    @classmethod
    def private(cls, *, device="cpu", dtype=None, segment_bytes=DEFAULT_SEGMENT_BYTES, move=None):
        return super().private(
            device=device,
            dtype=torch.float32 if dtype is None else dtype,
            segment_bytes=segment_bytes,
            move=move or ops.get("move_pages"),
        )


__all__ = [
    "DEFAULT_SEGMENT_BYTES",
    "PAGE_KINDS",
    "ArenaBlockPool",
    "ArenaExhausted",
    "KVArena",
    "Page",
    "format_bytes",
    "parse_bytes",
]
