"""Benchmark workloads, built deterministically from a seed.

Decode workload (``build_decode``): B sequences, each holding ``context`` tokens in a real
``BlockPool`` through a real ``TokenTable``. The pool's free list is shuffled before the tables
take their blocks, so every sequence's blocks are a random permutation of the pool ("shuffled
table"), as in a pool that has served many sequences; attention must gather through the slots.
The same live tokens are also laid out contiguously, [B, H_kv, T, D], for the baseline:
``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` on a [B, H_q, 1, D]
query. K, V and the query are standard normal.

Repack workload (``build_repack``): the same kind of tables, then a seeded random 50% of each
sequence's tokens are evicted (vToken token-level eviction) and ``plan_repack(force=True)``
plans each table; the plans' moves are concatenated into one ``copy_slots`` call (they name
disjoint slots of one pool, so one call is as valid as eight). The baseline is a plain
contiguous ``dst.copy_(src)`` of exactly as many bytes: moved rows x H_kv x D x itemsize x 2.

Ragged workload (``build_ragged``): one decode step of ``HeadwiseCache``'s layout, B sequences
whose KV heads each keep ``ceil(budget * context)`` tokens in a table of their own (head groups of
one, sorted by budget), the tables' slots a random permutation of one pool, and Tangram's
ahead-of-time work list for ``workers`` workers: the arguments of ``ragged_decode_attention``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch

from kvstack.errors import InvalidArgumentError
from kvstack.head_groups import group_heads, plan_ahead_of_time, work_list
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.checks import check_positive_int
from kvstack.reference.repack import RepackPlan, plan_repack
from kvstack.reference.token_table import TokenTable


@dataclass(frozen=True)
class Shape:
    """The sizes a workload is built from (defaults: the core workload)."""

    batch: int = 8
    num_query_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.float32

    def describe(self) -> str:
        return (
            f"batch {self.batch}, {self.num_query_heads} query heads / {self.num_kv_heads} KV "
            f"heads, head_dim {self.head_dim}, {str(self.dtype).removeprefix('torch.')}, "
            f"block size {self.block_size}"
        )


CORE_SHAPE = Shape()


@dataclass
class DecodeWorkload:
    """One decode step over B shuffled token tables, and the same tokens laid out contiguously."""

    shape: Shape
    context: int
    pool: BlockPool
    tables: list[TokenTable]
    query: torch.Tensor  # [B, 1, H_q, D]
    slots: torch.Tensor  # [B, T] live slots in logical order, -1 = padding
    key_positions: torch.Tensor  # [B, T]
    query_positions: torch.Tensor  # [B, 1]
    contiguous_query: torch.Tensor  # [B, H_q, 1, D]
    contiguous_key: torch.Tensor  # [B, H_kv, T, D]
    contiguous_value: torch.Tensor  # [B, H_kv, T, D]

    def paged_args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of ``paged_attention``."""
        return (
            self.query,
            self.pool.key,
            self.pool.value,
            self.slots,
            self.key_positions,
            self.query_positions,
        )


@dataclass
class RepackWorkload:
    """The copy of a forced repack after 50% random eviction, and a plain copy of equal bytes."""

    shape: Shape
    context: int
    evict_fraction: float
    pool: BlockPool
    tables: list[TokenTable]
    plans: list[RepackPlan]
    src_slots: torch.Tensor  # [M] every plan's sources, concatenated
    dst_slots: torch.Tensor  # [M]
    plain_src: torch.Tensor  # [2 * M, H_kv, D]: as many bytes as the M K rows and M V rows
    plain_dst: torch.Tensor  # [2 * M, H_kv, D]

    @property
    def moved_rows(self) -> int:
        return self.src_slots.numel()

    @property
    def bytes_moved(self) -> int:
        """Bytes copied by one repack: moved rows x H_kv x D x itemsize x 2 (K and V)."""
        s = self.shape
        itemsize = torch.empty(0, dtype=s.dtype).element_size()
        return self.moved_rows * s.num_kv_heads * s.head_dim * itemsize * 2


def pad_slots(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-sequence slot lists into [B, T_max], padding short ones with -1."""
    width = max((row.numel() for row in rows), default=0)
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for b, row in enumerate(rows):
        out[b, : row.numel()] = row
    return out


def _filled_tables(
    shape: Shape, context: int, generator: torch.Generator
) -> tuple[BlockPool, list[TokenTable]]:
    """A pool exactly big enough for B tables of ``context`` random tokens, blocks shuffled."""
    check_positive_int("context", context)
    if context % shape.block_size:
        raise InvalidArgumentError(
            f"context must be a multiple of block_size {shape.block_size}, got {context}"
        )
    num_blocks = shape.batch * context // shape.block_size
    pool = BlockPool(
        num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype
    )
    # Shuffle the free list so each table's blocks are scattered over the pool, as after churn.
    pool.free_blocks = deque(torch.randperm(num_blocks, generator=generator).tolist())
    row = (context, shape.num_kv_heads, shape.head_dim)
    tables = []
    for _ in range(shape.batch):
        table = TokenTable(shape.block_size)
        # One append per sequence (not per token): same slots, far faster to build.
        key = torch.randn(row, generator=generator, dtype=shape.dtype)
        value = torch.randn(row, generator=generator, dtype=shape.dtype)
        table.append(pool, key, value)
        tables.append(table)
    return pool, tables


def build_decode(context: int, shape: Shape = CORE_SHAPE, *, seed: int = 0) -> DecodeWorkload:
    """The decode workload at ``context`` tokens per sequence (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    pool, tables = _filled_tables(shape, context, generator)
    b, h_q, h_kv, d = shape.batch, shape.num_query_heads, shape.num_kv_heads, shape.head_dim
    slots = pad_slots([table.live_slots() for table in tables])  # [B, T]
    key_positions = pad_slots([table.live_positions() for table in tables]).clamp(min=0)
    query_positions = torch.full((b, 1), context, dtype=torch.int64)  # the next token
    query = torch.randn(b, 1, h_q, d, generator=generator, dtype=shape.dtype)  # [B, 1, H_q, D]

    key_rows = pool.key.view(-1, h_kv, d)  # [S, H_kv, D]
    value_rows = pool.value.view(-1, h_kv, d)
    # Every sequence has the same length, so no slot is -1 and the contiguous copy is exact.
    contiguous_key = key_rows[slots].transpose(1, 2).contiguous()  # [B, H_kv, T, D]
    contiguous_value = value_rows[slots].transpose(1, 2).contiguous()
    return DecodeWorkload(
        shape=shape,
        context=context,
        pool=pool,
        tables=tables,
        query=query,
        slots=slots,
        key_positions=key_positions,
        query_positions=query_positions,
        contiguous_query=query.transpose(1, 2).contiguous(),  # [B, H_q, 1, D]
        contiguous_key=contiguous_key,
        contiguous_value=contiguous_value,
    )


def build_repack(
    context: int, shape: Shape = CORE_SHAPE, *, evict_fraction: float = 0.5, seed: int = 0
) -> RepackWorkload:
    """The repack workload at ``context`` tokens per sequence (see the module docstring)."""
    if not 0.0 < evict_fraction < 1.0:
        raise InvalidArgumentError(f"evict_fraction must be in (0, 1), got {evict_fraction!r}")
    generator = torch.Generator().manual_seed(seed)
    pool, tables = _filled_tables(shape, context, generator)
    plans = []
    for table in tables:
        victims = torch.randperm(context, generator=generator)[: int(context * evict_fraction)]
        table.evict(victims)
        plan = plan_repack(table, force=True)
        if plan is None:  # cannot happen for evict_fraction >= 1 / context; say so if it does
            raise InvalidArgumentError(
                f"evict_fraction {evict_fraction} at context {context} frees no whole block"
            )
        plans.append(plan)
    src_slots = torch.cat([plan.src_slots for plan in plans])
    dst_slots = torch.cat([plan.dst_slots for plan in plans])
    rows = (2 * src_slots.numel(), shape.num_kv_heads, shape.head_dim)
    plain_src = torch.randn(rows, generator=generator, dtype=shape.dtype)
    return RepackWorkload(
        shape=shape,
        context=context,
        evict_fraction=evict_fraction,
        pool=pool,
        tables=tables,
        plans=plans,
        src_slots=src_slots,
        dst_slots=dst_slots,
        plain_src=plain_src,
        plain_dst=torch.empty_like(plain_src),
    )


# A SmolLM2 layer's three KV heads at budgets like its calibrated profile's spread (ratio 0.25:
# mean 0.31, heads from about 0.15 to 0.6 of the prompt).
RAGGED_BUDGETS = (0.6, 0.3, 0.15)


@dataclass
class RaggedWorkload:
    """One decode step over per-head tables (``HeadwiseCache``'s layout): ``args()`` are
    ``ragged_decode_attention``'s positional arguments."""

    shape: Shape
    context: int
    budgets: tuple[float, ...]
    workers: int
    query: torch.Tensor  # [B, 1, H_q, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, 1, D]
    value_cache: torch.Tensor
    slots: torch.Tensor  # [B, G, T], -1 past each head's length
    lengths: torch.Tensor  # [B, G, 1]
    members: torch.Tensor  # [G, 1]: the KV head of each group, highest budget first
    work: torch.Tensor  # [W, 3]

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.slots,
            self.lengths,
            self.members,
            self.work,
        )


def build_ragged(
    context: int,
    shape: Shape,
    budgets: tuple[float, ...] = RAGGED_BUDGETS,
    *,
    workers: int = 1,
    seed: int = 0,
) -> RaggedWorkload:
    """The ragged workload (see the module docstring): KV head h keeps ``ceil(budgets[h] *
    context)`` tokens."""
    if len(budgets) != shape.num_kv_heads:
        raise InvalidArgumentError(
            f"budgets must give each of the shape's {shape.num_kv_heads} KV heads one budget, "
            f"got {len(budgets)}"
        )
    generator = torch.Generator().manual_seed(seed)
    groups = group_heads([list(budgets)], 1, "sorted")[0]
    members = torch.tensor([group.heads for group in groups])  # [G, 1]
    work = torch.tensor(work_list(plan_ahead_of_time([groups], workers)[0]))
    kept = [math.ceil(budgets[head] * context) for head in members[:, 0].tolist()]
    batch, width, block = shape.batch, max(kept), shape.block_size
    num_blocks = -(-batch * len(groups) * width // block) + 1
    pool_shape = (num_blocks, block, 1, shape.head_dim)
    key_cache = torch.randn(pool_shape, generator=generator, dtype=shape.dtype)
    value_cache = torch.randn(pool_shape, generator=generator, dtype=shape.dtype)
    order = torch.randperm(num_blocks * block, generator=generator)  # scattered tables
    slots = order[: batch * len(groups) * width].view(batch, len(groups), width).clone()
    lengths = torch.tensor(kept).view(1, -1, 1).expand(batch, -1, 1).contiguous()  # [B, G, 1]
    slots[torch.arange(width) >= lengths] = -1  # past each head's kept tokens
    query = torch.randn(
        batch, 1, shape.num_query_heads, shape.head_dim, generator=generator, dtype=shape.dtype
    )
    return RaggedWorkload(
        shape,
        context,
        budgets,
        workers,
        query,
        key_cache,
        value_cache,
        slots,
        lengths,
        members,
        work,
    )
