"""Block pool: fixed-capacity paged K/V storage with a free list and reference counts.

The pool is the one place K/V bytes live. It holds

    key, value : [num_blocks, block_size, num_kv_heads, head_dim]

and hands out whole blocks. A *slot* is one token row of one block, numbered
``block * block_size + offset``; token tables (``token_table.py``) map logical tokens to slots.

Invariants (checked by ``spec_tests/test_pool_state_machine.py`` after every step):
  P1 every block is either free (reference count 0, on the free list exactly once) or
     allocated (reference count >= 1, not on the free list);
  P2 ``allocate(n)`` is atomic: it returns n distinct free blocks or raises ``PoolExhausted``
     and changes nothing;
  P3 freeing a block that is not allocated raises ``DoubleFreeError`` and changes nothing.

The shape of the pool follows vLLM's paged attention [Kwon et al., SOSP'23]; the size of the
manager follows nano-vllm's ``BlockManager``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import torch

from kvstack.errors import (
    DoubleFreeError,
    InvalidArgumentError,
    InvalidDTypeError,
    PoolExhausted,
    SlotOutOfRangeError,
)
from kvstack.reference.checks import (
    FLOAT_DTYPES,
    check_index_tensor,
    check_positive_int,
    check_tensor,
)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = check_positive_int("num_blocks", num_blocks)
        self.block_size = check_positive_int("block_size", block_size)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        if dtype not in FLOAT_DTYPES:
            raise InvalidDTypeError(
                f"dtype must be one of {[str(d) for d in FLOAT_DTYPES]}, got {dtype!r}"
            )
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"dtype={self.key.dtype}, device={str(self.key.device)!r})"
        )

    # ----------------------------------------------------------------- allocation
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_blocks)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (P2: all of them or none)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"n must be a non-negative integer, got {n!r}")
        if not self.can_allocate(n):
            raise PoolExhausted(
                f"asked for {n} blocks but only {len(self.free_blocks)} of "
                f"{self.num_blocks} are free"
            )
        blocks = [self.free_blocks.popleft() for _ in range(n)]
        for block in blocks:
            self.ref_counts[block] = 1
        return blocks

    def grow(self, num_new_blocks: int) -> None:
        """Add ``num_new_blocks`` free blocks. Existing block ids, bytes and owners are unchanged
        (the tensors are reallocated, so views taken before ``grow`` go stale)."""
        check_positive_int("num_new_blocks", num_new_blocks)
        extra = torch.zeros(
            (num_new_blocks, *self.key.shape[1:]), dtype=self.key.dtype, device=self.key.device
        )
        self.key = torch.cat([self.key, extra])
        self.value = torch.cat([self.value, extra])
        self.ref_counts.extend([0] * num_new_blocks)
        self.free_blocks.extend(range(self.num_blocks, self.num_blocks + num_new_blocks))
        self.num_blocks += num_new_blocks

    def share(self, block: int) -> None:
        """Add an owner to an allocated block (prefix sharing, copy-on-write later)."""
        self._check_allocated("block", [block])
        self.ref_counts[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one owner of each block; a block whose last owner left returns to the free list."""
        if not isinstance(blocks, Iterable) or isinstance(blocks, (str, bytes)):
            raise InvalidDTypeError(f"blocks must be an iterable of block ids, got {blocks!r}")
        blocks = list(blocks)
        self._check_allocated("blocks", blocks)
        for block in blocks:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)

    def check_allocated(self, name: str, blocks: list[int]) -> None:
        """Raise unless each block is allocated (as often as it is named); changes nothing."""
        self._check_allocated(name, list(blocks))

    def _check_allocated(self, name: str, blocks: list[int]) -> None:
        # Validate every block before touching any, so a bad list changes nothing (P3).
        drops: dict[int, int] = {}
        for block in blocks:
            if isinstance(block, bool) or not isinstance(block, int):
                raise InvalidDTypeError(f"{name} must hold int block ids, got {block!r}")
            if not 0 <= block < self.num_blocks:
                raise SlotOutOfRangeError(
                    f"{name} holds block {block}, expected 0 <= block < {self.num_blocks}"
                )
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > self.ref_counts[block]:
                raise DoubleFreeError(
                    f"{name} names block {block}, which has {self.ref_counts[block]} owner(s) "
                    f"and is named {drops[block]} time(s)"
                )

    # ----------------------------------------------------------------- K/V bytes
    def check_slots(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        check_index_tensor(name, slots, device=self.key.device)
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= self.num_slots):
            raise SlotOutOfRangeError(
                f"{name} holds slots in [{int(slots.min())}, {int(slots.max())}], "
                f"expected 0 <= slot < {self.num_slots}"
            )
        return slots

    def write(self, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one K and V row per slot: ``key``/``value`` are [N, num_kv_heads, head_dim]."""
        self.check_slots("slots", slots)
        row = (slots.numel(), self.num_kv_heads, self.head_dim)
        for name, tensor in (("key", key), ("value", value)):
            check_tensor(name, tensor, shape=row, dtypes=FLOAT_DTYPES, device=self.key.device)
        key_rows = self.key.view(self.num_slots, self.num_kv_heads, self.head_dim)  # [S, H, D]
        value_rows = self.value.view(self.num_slots, self.num_kv_heads, self.head_dim)
        key_rows[slots] = key.to(self.key.dtype)
        value_rows[slots] = value.to(self.value.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of the given slots, [N, num_kv_heads, head_dim] each (copies)."""
        self.check_slots("slots", slots)
        key_rows = self.key.view(self.num_slots, self.num_kv_heads, self.head_dim)
        value_rows = self.value.view(self.num_slots, self.num_kv_heads, self.head_dim)
        return key_rows[slots], value_rows[slots]
