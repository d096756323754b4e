"""The N token tables of one cache layer, vectorised: implements N ×
``kvstack.reference.token_table.TokenTable``.

A cache layer keeps one token table per batch row (or per row and KV head), and every table of a
layer sees the same appends: after each step they all hold the same number of logical tokens T.
So the per-token tensors of all N tables fit in one [N, T] layout,

    slots [N, T] int64   physical slot of each logical token, -1 once released
    alive [N, T] bool    whether attention may read it

and a decode step's table work (append one token to every table, evict the policy's victims,
build the attention view) is a handful of tensor ops per layer instead of a handful per table.
The per-table bookkeeping that is sequential by nature (owned blocks, the sorted free-slot list)
stays in Python lists, where an append or release costs microseconds.

Equivalence with the reference is exact, not approximate: appends fill released slots first,
lowest first, then take new blocks from the pool table by table in table order, just as N
reference tables appended in order would; eviction and release are the reference's; a token's
position is its logical index (what ``TokenTable.append`` gives without explicit positions).
``repack(i)`` is the reference's repack plan and execution for table i in tensor ops (an
evicting prefill repacks, after each chunk, every table that can free a block, and the
reference's Python loops over tokens made that a large share of a chunk's step).
``table(i)`` materialises table i as a reference ``TokenTable`` and ``set_table`` writes one
back, so the rare operations (beam forks) run the reference code itself.
``spec_tests/test_token_table_batch.py`` drives both with random operation sequences.

Why not torch.compile: these are tiny index ops on a few thousand entries; a compiled graph's
guard evaluation would cost more than the work.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch

from kvstack.errors import DeadTokenError, InvalidArgumentError, PoolExhausted
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.checks import FLOAT_DTYPES, check_positive_int, check_tensor
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD, copy_slots
from kvstack.reference.token_table import TokenTable


def grown_capacity(needed: int, capacity: int) -> int:
    """The capacity a per-logical-token buffer grows to when it must hold ``needed`` columns:
    a quarter more than now (amortised O(1) copies per column, as doubling, but at most a
    quarter of the buffer unused: these buffers count in the cache's real bytes), at least 64."""
    return max(needed, capacity + capacity // 4, 64)


class TokenTableBatch:
    def __init__(
        self, num_tables: int, block_size: int, *, device: torch.device | str = "cpu"
    ) -> None:
        self.num_tables = check_positive_int("num_tables", num_tables)
        self.block_size = check_positive_int("block_size", block_size)
        self.device = torch.device(device)
        self.num_tokens = 0  # logical tokens per table (all tables alike)
        self.blocks: list[list[int]] = [[] for _ in range(num_tables)]
        self.free_slots: list[list[int]] = [[] for _ in range(num_tables)]  # each sorted
        self.num_live: list[int] = [0] * num_tables
        # Capacity buffers, grown by doubling so that an append is a slice write, not a cat.
        self._slots = torch.full((num_tables, 0), -1, dtype=torch.int64, device=self.device)
        self._alive = torch.zeros((num_tables, 0), dtype=torch.bool, device=self.device)

    def __repr__(self) -> str:
        return (
            f"TokenTableBatch(num_tables={self.num_tables}, block_size={self.block_size}, "
            f"tokens={self.num_tokens}, live={self.num_live})"
        )

    # ----------------------------------------------------------------- queries
    @property
    def slots(self) -> torch.Tensor:
        """[N, T] slot per logical token, -1 once released (a view: do not write)."""
        return self._slots[:, : self.num_tokens]

    @property
    def alive(self) -> torch.Tensor:
        """[N, T] liveness per logical token (a view: do not write)."""
        return self._alive[:, : self.num_tokens]

    def blocks_needed(self, new_tokens: int) -> int:
        """Pool blocks that appending ``new_tokens`` tokens to every table would take."""
        return sum(
            math.ceil(max(0, new_tokens - len(free)) / self.block_size) for free in self.free_slots
        )

    def live_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What attention reads: (indices [N, L], slots [N, L]) with L = the most live tokens of
        any table; row i lists table i's live tokens in logical order, then -1 slots (padding,
        whose indices are distinct dead tokens, so a scatter by ``indices`` is a permutation)."""
        width = max(self.num_live)
        if width == self.num_tokens and min(self.num_live) == width:  # nothing evicted
            indices = torch.arange(width, device=self.device).expand(self.num_tables, width)
            return indices, self.slots
        if min(self.num_live) == width:  # equal live counts (one prompt, budgets alike)
            # nonzero lists (table, index) pairs row-major: each table's live tokens in order.
            indices = self.alive.nonzero()[:, 1].view(self.num_tables, width)  # [N, L]
            return indices, self.slots.gather(1, indices)
        # A stable sort of "dead" puts each row's live tokens first, in logical order.
        indices = torch.sort(~self.alive, dim=1, stable=True).indices[:, :width]  # [N, L]
        slots = self.slots.gather(1, indices)
        live = torch.tensor(self.num_live, device=self.device)[:, None]  # [N, 1]
        padding = torch.arange(width, device=self.device)[None, :] >= live  # [N, L]
        return indices, slots.masked_fill(padding, -1)

    def waste(self, index: int) -> float:
        """Table ``index``'s waste F (``TokenTable.waste``)."""
        blocks = len(self.blocks[index])
        return 1.0 - self.num_live[index] / (blocks * self.block_size) if blocks else 0.0

    # ----------------------------------------------------------------- mutations
    def append(
        self, pool: BlockPool, key: torch.Tensor, value: torch.Tensor, *, check: bool = True
    ) -> torch.Tensor:
        """Append n tokens to every table: ``key``/``value`` [N, n, num_kv_heads, head_dim].
        Returns their slots [N, n]. All tables or none: ``PoolExhausted`` changes nothing.

        ``check=False`` skips the pool and tensor checks, for a caller that holds this pool and
        shaped ``key``/``value`` itself (the HF cache layer, on every decode step); the pool
        capacity is checked either way, so a full pool still changes nothing."""
        if check:
            self._check_pool(pool)
            shape = (self.num_tables, None, pool.num_kv_heads, pool.head_dim)
            check_tensor("key", key, shape=shape, dtypes=FLOAT_DTYPES, device=pool.key.device)
            value_shape = (self.num_tables, key.shape[1], pool.num_kv_heads, pool.head_dim)
            check_tensor(
                "value", value, shape=value_shape, dtypes=FLOAT_DTYPES, device=pool.key.device
            )
        n = key.shape[1]
        needed = self.blocks_needed(n)
        if needed and not pool.can_allocate(needed):  # most decode steps need no new block
            raise PoolExhausted(
                f"appending {n} tokens to {self.num_tables} tables needs "
                f"{needed} blocks, but only {pool.num_free_blocks} are free"
            )
        new_slots = self.take_slots(pool, n)
        slots = torch.tensor(new_slots, dtype=torch.int64, device=self.device)  # [N * n]
        # The slots come from blocks these tables own, so the pool's own slot check (two
        # device syncs per append) is skipped: write the rows directly.
        rows = (pool.num_slots, pool.num_kv_heads, pool.head_dim)  # pool as [S, H, D]
        new_rows = (-1, pool.num_kv_heads, pool.head_dim)  # [N, n, H, D] -> [N * n, H, D]
        device_slots = slots.to(pool.key.device)
        pool.key.view(rows).index_copy_(0, device_slots, key.reshape(new_rows).to(pool.key.dtype))
        pool.value.view(rows).index_copy_(
            0, device_slots, value.reshape(new_rows).to(pool.value.dtype)
        )
        self.record_appended(slots.view(self.num_tables, n))
        return slots.view(self.num_tables, n)

    def record_appended(self, slots: torch.Tensor) -> None:
        """The table half of ``append``: n new logical tokens per table, live, at ``slots``
        [N, n] (from ``take_slots``, whose rows the caller wrote into the pool). A serving
        engine writes the rows of many requests' tables in one copy and records each here."""
        n = slots.shape[1]
        self._reserve_columns(self.num_tokens + n)
        start, self.num_tokens = self.num_tokens, self.num_tokens + n
        self._slots[:, start : self.num_tokens] = slots
        self._alive[:, start : self.num_tokens] = True

    def take_slots(self, pool: BlockPool, n: int) -> list[int]:
        """The slot half of ``append`` (which calls it; the caller must then write the rows
        and ``record_appended``): the reference's append, table by table: released slots
        first, lowest first, then new blocks from the pool. Returns the slots, table-major;
        updates the Python lists. The pool must have the blocks (``blocks_needed``)."""
        bs = self.block_size
        new_slots: list[int] = []
        if n == 1:  # a decode step: one slot per table, no list rebuilding
            for index, free in enumerate(self.free_slots):
                if not free:
                    block = pool.allocate(1)[0]
                    self.blocks[index].append(block)
                    free.extend(range(block * bs, (block + 1) * bs))
                new_slots.append(free.pop(0))
                self.num_live[index] += 1
            return new_slots
        for index, free in enumerate(self.free_slots):
            reused = free[:n]
            new_blocks = pool.allocate(math.ceil((n - len(reused)) / bs))
            fresh = [b * bs + o for b in new_blocks for o in range(bs)]
            new_slots += reused + fresh[: n - len(reused)]
            self.free_slots[index] = sorted(free[len(reused) :] + fresh[n - len(reused) :])
            self.blocks[index].extend(new_blocks)
            self.num_live[index] += n
        return new_slots

    def evict_one_each(self, indices: torch.Tensor, *, release: bool = True) -> None:
        """``evict`` of exactly one token per table, table i's at logical index ``indices[i]``
        ([N] int64): a decode step's eviction in a few ops. The tokens must be live (raises
        ``DeadTokenError`` otherwise, changing nothing)."""
        check_tensor(
            "indices", indices, shape=(self.num_tables,), dtypes=(torch.int64,), device=self.device
        )
        wanted = indices.tolist()  # one sync; [N] ints
        if min(wanted) < 0 or max(wanted) >= self.num_tokens:
            raise InvalidArgumentError(
                f"indices must be logical indices in [0, {self.num_tokens}), got {wanted}"
            )
        columns = indices[:, None]  # [N, 1]
        slots = self.slots.gather(1, columns)  # [N, 1]
        # Liveness decides, not the slot: Naive-Evict (release=False) keeps the slots of dead
        # tokens, so a token evicted that way still has one and must not be evicted again.
        slots = slots.masked_fill(~self.alive.gather(1, columns), -1)
        released = slots[:, 0].tolist()
        if -1 in released:
            dead = [i for i, slot in enumerate(released) if slot == -1]
            raise DeadTokenError(
                f"indices names tokens that are not live: tables {dead}, indices "
                f"{wanted} of {self.num_tokens} tokens"
            )
        self.evict_known(indices, released, release=release)

    def evict_known(self, indices: torch.Tensor, slots: list[int], *, release: bool) -> None:
        """``evict_one_each`` without its checks, for a caller that picked each table's victim
        among its live tokens itself: ``indices`` [N] their logical indices, ``slots`` their
        slots (from the live view). A serving engine's decode step, for every request at once,
        reads both from one device sync instead of two per request."""
        columns = indices[:, None]  # [N, 1]
        # Columns < num_tokens, so the capacity buffers can be written without slicing them.
        self._alive.scatter_(1, columns, False)
        for index, slot in enumerate(slots):
            self.num_live[index] -= 1
            if release:
                bisect.insort(self.free_slots[index], slot)
        if release:
            self._slots.scatter_(1, columns, -1)

    def evict(self, victims: torch.Tensor, *, release: bool = True) -> list[int]:
        """Mark the tokens of ``victims`` ([N, T] bool) dead. ``release=True`` returns their
        slots to each table's free list; ``release=False`` is Naive-Evict (slots stay taken).
        Returns how many tokens each table lost."""
        shape = (self.num_tables, self.num_tokens)
        check_tensor("victims", victims, shape=shape, dtypes=(torch.bool,), device=self.device)
        not_live = victims & ~self.alive
        if bool(not_live.any()):
            rows, cols = not_live.nonzero(as_tuple=True)
            raise DeadTokenError(
                f"victims names tokens that are not live: (table, index) "
                f"{list(zip(rows.tolist(), cols.tolist(), strict=True))[:8]}"
            )
        counts = victims.sum(dim=1).tolist()
        if not any(counts):
            return counts
        self._alive[:, : self.num_tokens].masked_fill_(victims, False)
        for index, count in enumerate(counts):
            self.num_live[index] -= count
        if release:
            released = self.slots[victims].tolist()  # row-major: table 0's first
            start = 0
            for index, count in enumerate(counts):
                if count:
                    mine = released[start : start + count]
                    self.free_slots[index] = sorted(self.free_slots[index] + mine)
                    start += count
            self._slots[:, : self.num_tokens].masked_fill_(victims, -1)
        return counts

    def repack(
        self,
        index: int,
        pool: BlockPool,
        *,
        threshold: float = DEFAULT_WASTE_THRESHOLD,
        force: bool = False,
        copy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None] = copy_slots,
    ) -> bool:
        """Implements ``kvstack.reference.repack.plan_repack`` then ``execute_repack`` on table
        ``index``, in tensor ops where the reference loops over tokens: the same kept blocks (the
        fullest; ties to the block taken earliest), the same moves (the live tokens of the freed
        blocks in logical order, onto the kept blocks' slots that hold no live token, ascending),
        copied before the table switches to them (I3), and the same sorted free list. Returns
        whether it repacked: not when F <= ``threshold`` (unless ``force``) or when no whole block
        can be freed. ``copy`` is a ``copy_slots`` implementation."""
        self._check_pool(pool)
        if (
            isinstance(index, bool)
            or not isinstance(index, int)
            or not 0 <= index < self.num_tables
        ):
            raise InvalidArgumentError(
                f"index must be a table index in [0, {self.num_tables}), got {index!r}"
            )
        if not 0.0 <= threshold < 1.0:
            raise InvalidArgumentError(f"threshold must be in [0, 1), got {threshold!r}")
        bs = self.block_size
        blocks = self.blocks[index]
        needed = math.ceil(self.num_live[index] / bs)
        if needed >= len(blocks) or (not force and self.waste(index) <= threshold):
            return False
        pool.check_allocated("the table's blocks", blocks)  # a foreign pool changes nothing
        row = self._slots[index, : self.num_tokens]  # [T] a view: the switch writes through it
        alive = self.alive[index]  # [T]
        live_index = alive.nonzero()[:, 0]  # [L] logical order
        live_slot = row[live_index]  # [L]
        live_block = live_slot // bs  # [L]
        owned = torch.tensor(blocks, device=self.device)  # [B] in the order taken
        live_per_block = (live_block[:, None] == owned[None, :]).sum(dim=0)  # [B]
        # A stable sort keeps ties in the order taken, as the reference's sorted() does.
        by_fullness = torch.sort(-live_per_block, stable=True).indices  # [B]
        kept, freed = owned[by_fullness[:needed]], owned[by_fullness[needed:]]
        offsets = torch.arange(bs, device=self.device)
        kept_slots = (torch.sort(kept).values[:, None] * bs + offsets).flatten()  # [K * bs]
        destinations = kept_slots[~torch.isin(kept_slots, live_slot)]
        moving = torch.isin(live_block, freed)  # [L]
        moved_tokens, src = live_index[moving], live_slot[moving]
        dst = destinations[: src.numel()]
        device = pool.key.device
        copy(pool.key, pool.value, src.to(device), dst.to(device))  # I3: copy ...
        # ... then switch; a repack reclaims: dead tokens that still held a slot lose it.
        row[moved_tokens] = dst
        row.masked_fill_(~alive, -1)
        freed_set = set(freed.tolist())
        self.blocks[index] = [block for block in blocks if block not in freed_set]
        self.free_slots[index] = kept_slots[~torch.isin(kept_slots, row[live_index])].tolist()
        pool.free([block for block in blocks if block in freed_set])
        return True

    def rename_blocks(self, renamed: dict[int, int]) -> None:
        """Blocks moved in memory (an arena compaction): block ``b`` is now ``renamed[b]``. Every
        slot in a renamed block follows it, at the same offset; liveness and order are kept."""
        if not renamed:
            return
        bs = self.block_size
        self.blocks = [[renamed.get(block, block) for block in blocks] for blocks in self.blocks]
        self.free_slots = [
            sorted(renamed.get(slot // bs, slot // bs) * bs + slot % bs for slot in free)
            for free in self.free_slots
        ]
        slots = self.slots  # [N, T]
        used = slots[slots >= 0]
        if used.numel() == 0:
            return
        # lookup[b] = b's new id, for every block id up to the largest in use or renamed.
        size = max(int(used.max()) // bs, max(renamed)) + 1
        lookup = torch.arange(size, device=self.device)
        lookup[torch.tensor(list(renamed), device=self.device)] = torch.tensor(
            list(renamed.values()), device=self.device
        )
        moved = lookup[slots.clamp(min=0) // bs] * bs + slots.clamp(min=0) % bs
        self._slots[:, : self.num_tokens] = torch.where(slots >= 0, moved, slots)

    def release_all(self, pool: BlockPool) -> None:
        """Return every table's blocks to the pool and forget all tokens."""
        self._check_pool(pool)
        pool.free([block for blocks in self.blocks for block in blocks])
        self.__init__(self.num_tables, self.block_size, device=self.device)

    # ----------------------------------------------------------------- reference tables
    def table(self, index: int) -> TokenTable:
        """Table ``index`` as a reference ``TokenTable`` (a copy; ``set_table`` writes back)."""
        table = TokenTable(self.block_size, device=self.device)
        table.blocks = list(self.blocks[index])
        table.free_slots = list(self.free_slots[index])
        table.slots = self.slots[index].clone()
        table.alive = self.alive[index].clone()
        table.positions = torch.arange(self.num_tokens, device=self.device)
        return table

    def tables(self) -> list[TokenTable]:
        return [self.table(index) for index in range(self.num_tables)]

    def set_table(self, index: int, table: TokenTable) -> None:
        """Replace table ``index`` by ``table`` (same logical length, positions = indices)."""
        if table.num_tokens != self.num_tokens:
            raise InvalidArgumentError(
                f"table holds {table.num_tokens} logical tokens, expected {self.num_tokens}"
            )
        self.blocks[index] = list(table.blocks)
        self.free_slots[index] = list(table.free_slots)
        self._slots[index, : self.num_tokens] = table.slots
        self._alive[index, : self.num_tokens] = table.alive
        self.num_live[index] = table.num_live

    @classmethod
    def from_tables(cls, tables: list[TokenTable], block_size: int, *, device) -> TokenTableBatch:
        """A batch holding ``tables`` (all of one logical length, positions = indices)."""
        batch = cls(len(tables), block_size, device=device)
        lengths = {table.num_tokens for table in tables}
        if len(lengths) != 1:
            raise InvalidArgumentError(f"tables must all hold one logical length, got {lengths}")
        batch.num_tokens = lengths.pop()
        batch._reserve_columns(batch.num_tokens)
        for index, table in enumerate(tables):
            if not torch.equal(table.positions.cpu(), torch.arange(batch.num_tokens)):
                raise InvalidArgumentError(
                    f"tables[{index}] has positions other than its logical indices"
                )
            batch.set_table(index, table)
        return batch

    # ----------------------------------------------------------------- internals
    def _reserve_columns(self, columns: int) -> None:
        capacity = self._slots.shape[1]
        if columns <= capacity:
            return
        old, capacity = capacity, grown_capacity(columns, capacity)
        slots = torch.full((self.num_tables, capacity), -1, dtype=torch.int64, device=self.device)
        alive = torch.zeros((self.num_tables, capacity), dtype=torch.bool, device=self.device)
        slots[:, :old] = self._slots
        alive[:, :old] = self._alive
        self._slots, self._alive = slots, alive

    def _check_pool(self, pool: BlockPool) -> None:
        if not isinstance(pool, BlockPool):
            raise InvalidArgumentError(f"pool must be a BlockPool, got {type(pool).__name__}")
        if pool.block_size != self.block_size:
            raise InvalidArgumentError(
                f"pool has block_size {pool.block_size}, these tables expect {self.block_size}"
            )
