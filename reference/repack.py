"""Repacking: move a sequence's live tokens into fewer blocks and return the rest (vToken).

After token-level eviction a sequence's blocks are full of holes. Because attention reads
through the token table, a live token may sit in any slot of any owned block; so the plan keeps
the K = ceil(live / block_size) owned blocks that hold the most live tokens, moves every live
token of the other blocks into a free slot of a kept block, and frees the other blocks.

Invariants (vToken):
  I1 repacking never changes the set of live tokens, their logical order, positions or K/V bytes;
  I3 attention never reads a slot whose copy has not completed: ``execute_repack`` copies every
     row first and switches the table to the new slots only afterwards (copy-then-switch);
  I4 a plan is built from one snapshot of the table (its ``version``; a stale plan is refused),
     its moves do not overlap (every destination is a slot that holds no live token, every
     source lies in a block being freed, so no slot is both read and written), and it strictly
     reduces the block count: live tokens end in exactly ceil(live / block_size) blocks.
Waste F = 1 - mean live fraction per block (``TokenTable.waste``); repack when F > theta.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.token_table import TokenTable

DEFAULT_WASTE_THRESHOLD = 0.25


@dataclass(frozen=True)
class RepackPlan:
    table_id: int  # id() of the table the plan was built for
    table_version: int  # the snapshot the plan was built from
    moved_tokens: torch.Tensor  # logical indices of the moved tokens [M]
    src_slots: torch.Tensor  # where they are now [M]
    dst_slots: torch.Tensor  # where they go [M]
    kept_blocks: tuple[int, ...]
    freed_blocks: tuple[int, ...]


def copy_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Copy the K/V rows of ``src_slots`` onto ``dst_slots`` in place.

    ``key_cache``/``value_cache`` are pool tensors [num_blocks, block_size, H_kv, D]. The slots
    must not overlap (I4), so the order of the copies does not matter.
    """
    num_blocks, block_size, num_heads, head_dim = key_cache.shape
    key_rows = key_cache.view(num_blocks * block_size, num_heads, head_dim)  # [S, H, D]
    value_rows = value_cache.view(num_blocks * block_size, num_heads, head_dim)
    for src, dst in zip(src_slots.tolist(), dst_slots.tolist(), strict=True):
        key_rows[dst] = key_rows[src]
        value_rows[dst] = value_rows[src]


def plan_repack(
    table: TokenTable, *, threshold: float = DEFAULT_WASTE_THRESHOLD, force: bool = False
) -> RepackPlan | None:
    """Plan a repack of ``table``, or return None when F <= threshold (unless ``force``) or
    when no whole block can be freed (I4: a plan must strictly reduce the block count)."""
    if not 0.0 <= threshold < 1.0:
        raise InvalidArgumentError(f"threshold must be in [0, 1), got {threshold!r}")
    needed = math.ceil(table.num_live / table.block_size)
    if needed >= len(table.blocks) or (not force and table.waste() <= threshold):
        return None

    bs = table.block_size
    live_index = table.live_indices()
    live_slot = table.slots[live_index]
    live_per_block = {block: 0 for block in table.blocks}
    for slot in live_slot.tolist():
        live_per_block[slot // bs] += 1
    # Keep the fullest blocks (fewest moves); ties go to the block taken earliest.
    order = sorted(table.blocks, key=lambda b: -live_per_block[b])
    kept = order[:needed]
    freed = set(order[needed:])

    # Every slot of a kept block that holds no live token is a destination.
    live_slot_set = set(live_slot.tolist())
    destinations = [
        b * bs + o for b in sorted(kept) for o in range(bs) if b * bs + o not in live_slot_set
    ]
    moving = [
        (i, s)
        for i, s in zip(live_index.tolist(), live_slot.tolist(), strict=True)
        if s // bs in freed
    ]
    dst = destinations[: len(moving)]
    return RepackPlan(
        table_id=id(table),
        table_version=table.version,
        moved_tokens=torch.tensor([i for i, _ in moving], dtype=torch.int64),
        src_slots=torch.tensor([s for _, s in moving], dtype=torch.int64),
        dst_slots=torch.tensor(dst, dtype=torch.int64),
        kept_blocks=tuple(kept),
        freed_blocks=tuple(b for b in table.blocks if b in freed),
    )


def execute_repack(
    table: TokenTable,
    pool: BlockPool,
    plan: RepackPlan,
    copy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] = copy_slots,
) -> None:
    """Carry out ``plan``: copy the rows (``copy`` is a ``copy_slots`` implementation), then
    switch the table to the new slots, then return the freed blocks to the pool."""
    if plan.table_id != id(table):
        raise InvalidArgumentError("plan was built for another table; build a plan for this one")
    if plan.table_version != table.version:
        raise InvalidArgumentError(
            f"plan was built from table version {plan.table_version}, the table is now at "
            f"version {table.version}; build a new plan"
        )
    # Check the pool before touching anything, so a wrong pool changes nothing.
    table._check_pool(pool)
    pool.check_allocated("plan.freed_blocks", list(plan.freed_blocks))
    device = pool.key.device
    copy(pool.key, pool.value, plan.src_slots.to(device), plan.dst_slots.to(device))  # I3: copy ...
    # ... then switch. A repack reclaims: dead tokens that still held a slot (Naive-Evict) lose it.
    table.slots[plan.moved_tokens.to(table.device)] = plan.dst_slots.to(table.device)
    table.slots[~table.alive] = -1
    freed = set(plan.freed_blocks)
    table.blocks = [b for b in table.blocks if b not in freed]
    occupied = set(table.slots[table.slots >= 0].tolist())
    bs = table.block_size
    table.free_slots = [
        b * bs + o for b in sorted(table.blocks) for o in range(bs) if b * bs + o not in occupied
    ]
    table.version += 1
    pool.free(plan.freed_blocks)
