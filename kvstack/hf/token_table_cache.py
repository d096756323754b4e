"""``TokenTableCache``: token-level eviction whose freed memory is really reclaimed (vToken).

Each attention layer keeps at most ``budget`` live tokens per token table (per row, or per row
and KV head for per-head policies such as H2O). After every attention step — the prefill, then
each decode step — the layer hands the step's attention weights to the policy, evicts the
lowest-ranked unprotected tokens, and

* ``reclaim=True``: releases their slots (the next appends fill them) and repacks the table when
  its waste F exceeds ``repack_threshold``, returning whole blocks to the pool;
* ``reclaim=False``: Naive-Evict, the baseline of vToken's figures — the same victims, but their
  slots stay occupied, so the blocks a request holds never shrink.

Prefill attends over the whole prompt (the policy observes its weights in chunks of queries)
and then evicts down to the budget (as H2O, SnapKV and vToken do); a decode step attends over
budget + 1 tokens and evicts one. A layer's tables are one ``TokenTableBatch`` and the policy
scores all of them at once, so a step costs a few tensor ops per layer, not per table. The attention runs in
kvstack's own implementation, which is the only one that reads through the token tables and
hands the weights to policies: the model must use ``attn_implementation="kvstack"``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from kvstack import ops
from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.hf.paged import STATS_UNITS as PAGED_STATS_UNITS
from kvstack.hf.paged import PagedCache, PagedLayer, stats_doc
from kvstack.policies import EvictionPolicy
from kvstack.reference.checks import check_positive_int
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD

STATS_UNITS: dict[str, str] = {
    **PAGED_STATS_UNITS,
    "repacks": "repacks run, summed over layers and token tables",
    "repack_seconds": "wall seconds spent deciding, planning and copying repacks, summed over "
    "layers",
}
"""Every key of :meth:`TokenTableCache.stats` and its unit (``PagedCache``'s keys and one more)."""


class TokenTableLayer(PagedLayer):
    needs_kvstack_attention = True  # only the kvstack attention reads through evicted tables

    def __init__(
        self, cache: TokenTableCache, layer_idx: int, block_size: int, window: int | None
    ) -> None:
        super().__init__(cache, layer_idx, block_size, window)
        self.policy: EvictionPolicy = cache.policy
        self.state: Any = None  # the policy's state for this layer's tables
        self.budgets: list[int] = []  # per table, fixed at prefill
        self.prompt_tokens: list[int] | None = None  # per table, for a chunked prefill
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V of a chunked prefill
        self.prefilled = False
        self.repacks = 0
        self.repack_seconds = 0.0
        self._copy = None  # copy_slots for repacks, looked up on first use

    # ------------------------------------------------------------------ chunked prefill
    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append the step's K/V, or keep a long prefill's K/V back for ``append_prefill_chunk``
        (the attention function appends and evicts chunk by chunk)."""
        chunk = self.cache.prefill_chunk
        expected = self.cache.expected_prompt
        if expected is not None and not self.prefilled:
            # A prompt announced by ``expect_prompt``, arriving a chunk per call: checked before
            # anything changes, budgets from the whole prompt, evicted after each chunk.
            batch, new_tokens = key_states.shape[0], key_states.shape[2]
            if batch != 1 or new_tokens > chunk or self.batch.num_tokens + new_tokens > expected:
                raise InvalidArgumentError(
                    f"a prompt announced by expect_prompt({expected}) comes as one row in calls "
                    f"of at most prefill_chunk={chunk} tokens; layer {self.layer_idx} holds "
                    f"{self.batch.num_tokens} and got [batch {batch}, {new_tokens} tokens]"
                )
            self.prompt_tokens = [expected] * self.batch.num_tables
            self.reserve_first_step(new_tokens)
            self.append(key_states, value_states)
            return
        self.reserve_first_step(key_states.shape[2])
        if chunk is not None and not self.budgets and key_states.shape[2] > chunk:
            self.pending = (key_states, value_states)
            return
        self.append(key_states, value_states)

    def pending_prefill(self, attention_mask: torch.Tensor | None) -> list[tuple[int, int]] | None:
        if self.pending is None:
            return None
        t = self.pending[0].shape[2]
        # Budgets come from each row's real prompt tokens, not from its first chunk.
        if attention_mask is None:
            real = [t] * self.batch_size
        else:
            real = attention_mask[:, -t:].sum(dim=1).tolist()
        self.prompt_tokens = [int(n) for n in real for _ in range(self.groups)]
        chunk = self.cache.prefill_chunk
        return [(start, min(start + chunk, t)) for start in range(0, t, chunk)]

    def reserve_first_step(self, new_tokens: int) -> None:
        # An announced prompt reserves for all of it on its first chunk.
        super().reserve_first_step(self.cache.expected_prompt or new_tokens)

    def append_prefill_chunk(self, start: int, end: int) -> None:
        key_states, value_states = self.pending
        self.append(key_states[:, :, start:end], value_states[:, :, start:end])

    def finish_prefill(self) -> None:
        self.pending = None
        self._prefill_done()

    def _prefill_done(self) -> None:
        if not self.prefilled:
            self.prefilled = True
            self.cache.layer_prefilled()

    def wants_attention_weights(self) -> bool:
        return self.policy.needs_attention_weights

    def _start(self) -> None:
        # The first step's real tokens (the prompt's, padding evicted) fix each table's budget.
        self.state = self.policy.init_state(self.batch.num_tables)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else self.batch.num_live
        self.budgets = [self.cache.budget_for(tokens) for tokens in prompt]

    def observed_queries(self, query_length: int) -> int:
        """How many of this step's last queries the policy reads weights of."""
        if not self.budgets:
            self._start()
        return self.policy.observed_queries(self.state, query_length)

    def skip_queries(self, count: int) -> None:
        """The step's first ``count`` queries, whose weights the policy does not read."""
        if not self.budgets:
            self._start()
        self.policy.skip_queries(self.state, count)

    def observe_attention(self, weights: torch.Tensor) -> None:
        """Hand one chunk of this step's attention ([N, heads, T_c, W] over the view's first W
        columns) to the policy."""
        if not self.budgets:
            self._start()
        columns = self.view_indices[:, : weights.shape[-1]]  # [N, W]
        self.policy.observe_columns(self.state, self.batch.alive, weights, columns)

    def after_attention(self) -> None:
        """Evict down to the budget after this step's attention."""
        batch = self.batch
        if not self.budgets:
            self._start()
        expected = self.cache.expected_prompt
        if self.pending is None and (expected is None or batch.num_tokens >= expected):
            self._prefill_done()
        excess = [live - budget for live, budget in zip(batch.num_live, self.budgets, strict=True)]
        if max(excess) <= 0:
            return
        victims = None
        if min(excess) == max(excess) == 1 and min(self.budgets) == max(self.budgets):
            # A decode step: every table one over the same budget, so the attention view
            # holds each table's live tokens in order; pick and evict one token per table.
            victims = self.policy.choose_one_victim_each(
                self.state, batch.alive, self.view_indices, self.budgets[0]
            )
        if victims is not None:
            batch.evict_one_each(victims, release=self.cache.reclaim)
            evicted = [1] * batch.num_tables
        else:
            mask = self.policy.choose_victims(self.state, batch.alive, self.budgets)
            evicted = batch.evict(mask, release=self.cache.reclaim)
        self._after_eviction(evicted)

    def batched_decode_budget(self) -> int | None:
        """The budget every table holds when this layer's next step may be a serving engine's
        batched decode (``kvstack.serve.evicting_decode``), else None. That needs its prefill
        done, one budget for all tables, every table holding exactly that many live tokens (so
        the step appends one token to each and evicts one from each), and a policy with a
        ``batched_decode``."""
        budgets = self.budgets
        if not (budgets and self.prefilled and self.pending is None and self.window is None):
            return None
        budget, live = budgets[0], self.batch.num_live
        if min(budgets) != max(budgets) or min(live) != budget or max(live) != budget:
            return None
        return budget if self.policy.batched_decode() else None

    def finish_batched_decode(self, victims: torch.Tensor, slots: list[int]) -> None:
        """``after_attention`` of a batched decode step whose victims the engine chose: table
        i's live token at logical index ``victims[i]`` ([N]), in slot ``slots[i]``."""
        self.batch.evict_known(victims, slots, release=self.cache.reclaim)
        self._after_eviction([1] * self.batch.num_tables)

    def _after_eviction(self, evicted: list[int]) -> None:
        """Reclaim after each table lost ``evicted[i]`` tokens: repack where worth it."""
        batch = self.batch
        if self.cache.reclaim:  # a table that just lost tokens may now be worth repacking
            block = self.block_size
            for index, count in enumerate(evicted):
                # Only a table holding a block more than its live tokens fill can free one
                # (blocks > ceil(live / block), plan_repack's first condition): most decode
                # steps evict into a table that needs every block it holds, and skip the check.
                if count and len(batch.blocks[index]) * block >= batch.num_live[index] + block:
                    self._maybe_repack(index)
            self.pool.arena.trim()  # a private arena gives emptied segments back

    def _maybe_repack(self, index: int) -> None:
        # Everything repacking costs is timed: the check, the plan and the copy.
        start = time.perf_counter()
        try:
            self._repack_if_worth_it(index)
        finally:
            self.repack_seconds += time.perf_counter() - start

    def _repack_if_worth_it(self, index: int) -> None:
        # The arena reservation (``blocks_to_reserve``) counts, per table, the blocks of its
        # budget plus the one token a decode step appends before it evicts. Appends fill freed
        # slots before they take a block, so a decode (one token in, one out) never needs more;
        # only a multi-token eviction (a prefill chunk's) can leave a table holding more blocks
        # than that: such a table is repacked whatever its waste, so the reservation holds.
        blocks = len(self.batch.blocks[index])
        over_reservation = blocks > self.cache.steady_blocks_per_table(self.budgets[index])
        if self.batch.repack(
            index,
            self.pool,
            threshold=self.cache.repack_threshold,
            force=over_reservation,
            copy=self._copy_slots(),
        ):
            self.repacks += 1

    def _copy_slots(self):
        """The fastest ``copy_slots`` for the pool's device, looked up once (most calls of
        ``_repack_if_worth_it`` decline and copy nothing)."""
        if self._copy is None:
            self._copy = ops.get("copy_slots", device=self.pool.key.device)
        return self._copy

    def _select_rows(self, rows: list[int]) -> None:
        if self.budgets:  # per-table state follows its table (beam search, repeats)
            groups = self.groups
            picks = [row * groups + g for row in rows for g in range(groups)]
            self.state = self.policy.select(self.state, picks)
            self.budgets = [self.budgets[i] for i in picks]
        super()._select_rows(rows)


class TokenTableCache(PagedCache):
    """Token-level eviction with reclamation, as a drop-in Hugging Face cache.

    >>> cache = TokenTableCache(model.config, policy=H2O(), budget=256, block_size=16)
    >>> cache = TokenTableCache(model.config, policy=StreamingLLM(), ratio=0.5)

    ``budget``: live tokens kept per table; ``ratio``: a fraction of each row's prompt instead.
    """

    STATS_UNITS = STATS_UNITS  # stats() key -> its unit

    layer_class = TokenTableLayer

    def __init__(
        self,
        config: Any,
        policy: EvictionPolicy,
        budget: int | None = None,
        ratio: float | None = None,
        *,
        block_size: int = 16,
        repack_threshold: float = DEFAULT_WASTE_THRESHOLD,
        reclaim: bool = True,
        prefill_chunk: int | None = None,
        arena: KVArena | None = None,
    ) -> None:
        if not isinstance(policy, EvictionPolicy):
            raise InvalidArgumentError(
                f"policy must be an EvictionPolicy, got {type(policy).__name__}"
            )
        if (budget is None) == (ratio is None):
            raise InvalidArgumentError(
                f"give exactly one of budget and ratio, got budget={budget!r}, ratio={ratio!r}"
            )
        if budget is not None:
            if (
                isinstance(budget, bool)
                or not isinstance(budget, int)
                or budget < policy.min_budget()
            ):
                raise InvalidArgumentError(
                    f"budget={budget!r} is smaller than what {policy!r} must keep; expected an "
                    f"integer >= {policy.min_budget()}"
                )
        elif not 0.0 < ratio <= 1.0:
            raise InvalidArgumentError(f"ratio must be in (0, 1], got {ratio!r}")
        if not 0.0 <= repack_threshold < 1.0:
            raise InvalidArgumentError(
                f"repack_threshold must be in [0, 1), got {repack_threshold!r}"
            )
        if prefill_chunk is not None:
            check_positive_int("prefill_chunk", prefill_chunk)
        self.policy = policy
        self.prefill_chunk = prefill_chunk
        self.expected_prompt: int | None = None  # expect_prompt: a prompt fed a chunk per call
        self.layers_prefilled = 0
        self.budget = budget
        self.ratio = ratio
        self.repack_threshold = repack_threshold
        self.reclaim = reclaim
        super().__init__(config, block_size=block_size, arena=arena)

    def per_head_tables(self) -> bool:
        return self.policy.per_head

    def expect_prompt(self, prompt_tokens: int) -> None:
        """Announce a one-row prompt of ``prompt_tokens`` tokens that the next calls bring in
        pieces of at most ``prefill_chunk`` tokens (a serving engine's prefill chunks, one per
        step): budgets and the arena reservation come from the whole prompt, each piece is
        evicted down to the budget after its attention, and the prefill ends at the prompt's
        last token. The cache keeps exactly what one call of the whole prompt would keep.
        Call it before the first step; a piece that breaks the announcement is refused."""
        check_positive_int("prompt_tokens", prompt_tokens)
        if self.prefill_chunk is None:
            raise InvalidArgumentError(
                "expect_prompt needs a cache built with prefill_chunk=N (the most tokens a call "
                "may bring), got prefill_chunk=None"
            )
        if self.expected_prompt is not None or any(
            layer.is_initialized for layer in self.paged_layers
        ):
            raise InvalidArgumentError(
                f"expect_prompt({prompt_tokens}) must come once, before the cache's first step"
            )
        self.expected_prompt = prompt_tokens

    def budget_for(self, prompt_tokens: int) -> int:
        if self.budget is not None:
            return self.budget
        return max(self.policy.min_budget(), math.ceil(self.ratio * prompt_tokens))

    def blocks_to_reserve(self, tables: int, prompt_tokens: int) -> int:
        """Every layer's tables at their budget (and the one token a decode step appends before
        it evicts), plus one layer's prefill in flight: a chunk (or the whole prompt) before it evicts."""
        in_flight = min(prompt_tokens, self.prefill_chunk or prompt_tokens)
        return self._steady_blocks(tables, prompt_tokens) + tables * math.ceil(
            in_flight / self.block_size
        )

    def steady_blocks_per_table(self, budget: int) -> int:
        """Blocks a table of ``budget`` live tokens holds once its prefill is in: its budget and
        the token a decode step appends before it evicts one (a forced repack keeps it so)."""
        return math.ceil((budget + 1) / self.block_size)

    def _steady_blocks(self, tables: int, prompt_tokens: int) -> int:
        per_table = self.steady_blocks_per_table(self.budget_for(prompt_tokens))
        return len(self.paged_layers) * tables * per_table

    def reserve_for_prompt(self, tables: int, prompt_tokens: int, block_bytes: int) -> None:
        super().reserve_for_prompt(tables, prompt_tokens, block_bytes)
        self._steady_reservation = self._steady_blocks(tables, prompt_tokens) * block_bytes

    def layer_prefilled(self) -> None:
        """One layer finished its prefill; after the last, keep only the steady reservation."""
        self.layers_prefilled += 1
        if self.layers_prefilled == len(self.paged_layers) and self.arena is not None:
            self.arena.reserve(self, getattr(self, "_steady_reservation", 0))
            self.arena.trim()

    def stats(self) -> dict[str, float]:
        stats = super().stats()
        stats["repacks"] = sum(layer.repacks for layer in self.paged_layers)
        stats["repack_seconds"] = sum(layer.repack_seconds for layer in self.paged_layers)
        return stats

    stats.__doc__ = stats_doc(
        "Exact memory counts over all paged layers (blocks held by tables, not pool capacity), "
        "and what repacking did",
        STATS_UNITS,
    )
