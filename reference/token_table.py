"""Token table: one sequence's map from logical tokens to physical slots (vToken).

A sequence's K/V rows live in pool blocks that the table owns. For every logical token
(the i-th token the sequence ever appended) the table records

    slots[i]     physical slot ``block * block_size + offset`` holding its K/V, or -1 once the
                 token is dead and its slot was released;
    alive[i]     whether attention may read it (False once evicted);
    positions[i] the position the token had in the sequence (what RoPE and causal masks use).

Attention reads only through the table (``live_slots()``, in logical order), so physical order
inside and across blocks carries no meaning: that is what lets token-level eviction return
memory (vToken). A released slot goes on the table's ``free_slots`` and the next append fills it
before asking the pool for a new block; ``repack.py`` returns whole blocks to the pool.

Invariants (vToken I2, checked by ``check_invariants`` and the state-machine test):
  one live token per slot and one slot per live token; every live slot and every free slot lies
  in a block the table owns; a slot is never both live and free.
Every mutation validates its arguments first, so a rejected call changes nothing.
"""

from __future__ import annotations

import math

import torch

from kvstack.errors import (
    DeadTokenError,
    InvalidArgumentError,
    InvalidDTypeError,
    SlotOutOfRangeError,
)
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.checks import FLOAT_DTYPES, check_positive_int, check_tensor


class TokenTable:
    def __init__(self, block_size: int, *, device: torch.device | str = "cpu") -> None:
        self.block_size = check_positive_int("block_size", block_size)
        self.device = torch.device(device)
        self.blocks: list[int] = []  # owned pool blocks, in the order they were taken
        self.free_slots: list[int] = []  # slots in owned blocks holding no live token, sorted
        self.slots = torch.empty(0, dtype=torch.int64, device=self.device)
        self.alive = torch.empty(0, dtype=torch.bool, device=self.device)
        self.positions = torch.empty(0, dtype=torch.int64, device=self.device)
        # Bumped by every mutation; a repack plan is valid only for the version it saw (I4).
        self.version = 0

    def __repr__(self) -> str:
        return (
            f"TokenTable(block_size={self.block_size}, tokens={self.num_tokens}, "
            f"live={self.num_live}, blocks={self.blocks})"
        )

    # ----------------------------------------------------------------- queries
    @property
    def num_tokens(self) -> int:
        """Logical tokens ever appended (live or dead)."""
        return self.slots.numel()

    @property
    def num_live(self) -> int:
        return int(self.alive.sum())

    def live_indices(self) -> torch.Tensor:
        """Logical indices of the live tokens, ascending. [L]"""
        return torch.nonzero(self.alive).flatten()

    def live_slots(self) -> torch.Tensor:
        """Slots of the live tokens in logical order: what attention reads. [L]"""
        return self.slots[self.alive]

    def live_positions(self) -> torch.Tensor:
        return self.positions[self.alive]

    def next_position(self) -> int:
        return int(self.positions[-1]) + 1 if self.num_tokens else 0

    def waste(self) -> float:
        """F = 1 - mean live fraction per owned block = 1 - live / (blocks * block_size).

        Free slots of a partly filled last block count as waste too; a repack plan exists only
        when a whole block can be freed (I4), so F > theta alone does not force a repack.
        """
        if not self.blocks:
            return 0.0
        return 1.0 - self.num_live / (len(self.blocks) * self.block_size)

    # ----------------------------------------------------------------- mutations
    def append(
        self,
        pool: BlockPool,
        key: torch.Tensor,
        value: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append N tokens: ``key``/``value`` [N, num_kv_heads, head_dim]. Returns their slots.

        Free slots of owned blocks are filled first (lowest slot first), then new blocks are
        taken from the pool — all of them or none (``PoolExhausted`` leaves the table as it was).
        ``positions`` defaults to the positions that follow the last appended token.
        """
        self._check_pool(pool)
        row = (None, pool.num_kv_heads, pool.head_dim)
        check_tensor("key", key, shape=row, dtypes=FLOAT_DTYPES, device=pool.key.device)
        n = key.shape[0]
        check_tensor(
            "value", value, shape=(n, *row[1:]), dtypes=FLOAT_DTYPES, device=pool.key.device
        )
        if positions is None:
            start = self.next_position()
            positions = torch.arange(start, start + n, device=self.device)
        check_tensor(
            "positions",
            positions,
            shape=(n,),
            dtypes=(torch.int64, torch.int32),
            device=self.device,
        )
        if n and int(positions.min()) < 0:
            raise InvalidArgumentError(f"positions must be >= 0, got min {int(positions.min())}")

        reused = self.free_slots[:n]
        new_blocks = pool.allocate(math.ceil((n - len(reused)) / self.block_size))
        fresh = [b * self.block_size + o for b in new_blocks for o in range(self.block_size)]
        new_slots = reused + fresh[: n - len(reused)]
        self.free_slots = sorted(self.free_slots[len(reused) :] + fresh[n - len(reused) :])
        self.blocks.extend(new_blocks)

        slots = torch.tensor(new_slots, dtype=torch.int64, device=self.device)
        pool.write(slots.to(pool.key.device), key, value)
        self.slots = torch.cat([self.slots, slots])
        self.alive = torch.cat([self.alive, torch.ones(n, dtype=torch.bool, device=self.device)])
        self.positions = torch.cat([self.positions, positions.to(self.device, torch.int64)])
        self.version += 1
        return slots

    def evict(self, indices: torch.Tensor | list[int], *, release: bool = True) -> None:
        """Mark live tokens dead by logical index.

        ``release=True`` returns their slots to ``free_slots`` (memory is reclaimable);
        ``release=False`` is Naive-Evict: the tokens stop being read but keep their slots.
        """
        indices = torch.as_tensor(indices).flatten()
        if indices.numel() == 0:
            return
        # as_tensor(..., dtype=int64) would truncate 0.7 to token 0 and evict the wrong token.
        is_integer = not (indices.dtype.is_floating_point or indices.dtype.is_complex)
        if not is_integer or indices.dtype == torch.bool:
            raise InvalidDTypeError(f"indices must hold integers, got dtype {indices.dtype}")
        if indices.device != self.device:
            raise InvalidArgumentError(
                f"indices must be on device {self.device}, got {indices.device}"
            )
        indices = indices.to(torch.int64)
        if int(indices.min()) < 0 or int(indices.max()) >= self.num_tokens:
            raise SlotOutOfRangeError(
                f"indices holds tokens in [{int(indices.min())}, {int(indices.max())}], "
                f"expected 0 <= index < {self.num_tokens} (tokens appended so far)"
            )
        if torch.unique(indices).numel() != indices.numel():
            raise InvalidArgumentError(f"indices names a token twice: {indices.tolist()}")
        dead = indices[~self.alive[indices]]
        if dead.numel():
            raise DeadTokenError(f"indices names tokens that are already evicted: {dead.tolist()}")

        self.alive[indices] = False
        if release:
            self.free_slots = sorted(self.free_slots + self.slots[indices].tolist())
            self.slots[indices] = -1
        self.version += 1

    def fork(self, pool: BlockPool) -> TokenTable:
        """A new table with the same logical tokens (liveness, positions) whose live K/V rows are
        copied into newly allocated slots of ``pool`` (no block is shared; beam search forks)."""
        self._check_pool(pool)
        key, value = pool.read(self.live_slots().to(pool.key.device))
        fork = TokenTable(self.block_size, device=self.device)
        fork.append(pool, key, value, self.live_positions())
        # Restore the logical layout: dead tokens stay dead at the same logical indices.
        slots = torch.full_like(self.slots, -1)
        slots[self.alive] = fork.slots
        fork.slots, fork.alive, fork.positions = slots, self.alive.clone(), self.positions.clone()
        fork.version += 1
        return fork

    def release_all(self, pool: BlockPool) -> None:
        """Return every owned block to the pool and forget all tokens."""
        self._check_pool(pool)
        pool.free(self.blocks)
        version = self.version
        self.__init__(self.block_size, device=self.device)
        # Versions only grow: a plan built before the release must stay stale (I4) even after
        # as many later mutations as it had seen.
        self.version = version + 1

    # ----------------------------------------------------------------- checks
    def _check_pool(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if pool.block_size != self.block_size:
            raise InvalidArgumentError(
                f"pool has block_size {pool.block_size}, this table expects {self.block_size}"
            )

    def check_invariants(self) -> None:
        """Raise AssertionError if vToken I2 or slot ownership is violated."""
        live = self.live_slots().tolist()
        occupied = self.slots[self.slots >= 0].tolist()  # live, plus dead-but-kept (Naive-Evict)
        assert len(set(occupied)) == len(occupied), "a slot holds two tokens"
        assert not set(occupied) & set(self.free_slots), "a slot is both occupied and free"
        assert len(set(self.free_slots)) == len(self.free_slots), "a free slot is listed twice"
        owned = set(self.blocks)
        assert len(owned) == len(self.blocks), "a block is owned twice"
        for slot in occupied + self.free_slots:
            assert slot // self.block_size in owned, f"slot {slot} lies outside owned blocks"
        capacity = len(self.blocks) * self.block_size
        assert len(occupied) + len(self.free_slots) == capacity, "a slot of an owned block is lost"
        assert len(live) == self.num_live
