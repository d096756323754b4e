"""``TokenTableCache``: token-level eviction whose freed memory is really reclaimed (vToken).

Each attention layer keeps at most ``budget`` live tokens per token table (per row, or per row
and KV head for per-head policies such as H2O). After every attention step — the prefill, then
each decode step — the layer hands the step's attention weights to the policy, evicts the
lowest-ranked unprotected tokens, and

* ``reclaim=True``: releases their slots (the next appends fill them) and repacks the table when
  its waste F exceeds ``repack_threshold``, returning whole blocks to the pool;
* ``reclaim=False``: Naive-Evict, the baseline of vToken's figures — the same victims, but their
  slots stay occupied, so the blocks a request holds never shrink.

Prefill attends over the whole prompt and then evicts down to the budget (as H2O, SnapKV and
vToken do); a decode step attends over budget + 1 tokens and evicts one. The attention runs in
kvstack's own implementation, which is the only one that reads through the token tables and
hands the weights to policies: the model must use ``attn_implementation="kvstack"``.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

from kvstack import ops
from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.hf.paged import PagedCache, PagedLayer
from kvstack.policies import EvictionPolicy
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD, execute_repack, plan_repack


class TokenTableLayer(PagedLayer):
    def __init__(
        self, cache: TokenTableCache, layer_idx: int, block_size: int, window: int | None
    ) -> None:
        super().__init__(cache, layer_idx, block_size, window)
        self.policy: EvictionPolicy = cache.policy
        self.states: list[Any] = []
        self.budgets: list[int] = []  # per table, fixed at prefill
        self.repacks = 0
        self.repack_seconds = 0.0

    def per_head_tables(self) -> bool:
        return self.policy.per_head

    def wants_attention_weights(self) -> bool:
        return self.policy.needs_attention_weights

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ):
        if not self.cache.uses_kvstack_attention():
            raise KVStackError(
                f"{type(self.cache).__name__} evicts tokens, which needs the kvstack attention "
                f"implementation (the model uses {self.cache.config._attn_implementation!r}); call "
                "model.set_attn_implementation('kvstack') after `import kvstack.hf`, or load with "
                "from_pretrained(..., attn_implementation='kvstack')"
            )
        return super().update(key_states, value_states, *args, **kwargs)

    def after_attention(self, weights: torch.Tensor | None) -> None:
        """Evict down to the budget after this step's attention ([N, heads, T_q, T_k] or None)."""
        if not self.states:  # first step: the prompt's real tokens fix each table's budget
            self.states = [self.policy.init_state(table) for table in self.tables]
            self.budgets = [self.cache.budget_for(table.num_live) for table in self.tables]
        for index, table in enumerate(self.tables):
            state = self.states[index]
            if weights is not None:
                self.policy.observe(state, table, weights[index, :, :, : table.num_live])
            victims = self.policy.choose_victims(state, table, self.budgets[index])
            if victims.numel() == 0:
                continue
            table.evict(victims, release=self.cache.reclaim)
            if self.cache.reclaim:
                self._maybe_repack(index)

    def _maybe_repack(self, index: int) -> None:
        plan = plan_repack(self.tables[index], threshold=self.cache.repack_threshold)
        if plan is None:
            return
        start = time.perf_counter()
        execute_repack(self.tables[index], self.pool, plan, copy=ops.get("copy_slots"))
        self.repack_seconds += time.perf_counter() - start
        self.repacks += 1

    def _select_rows(self, rows: list[int]) -> None:
        if self.states:  # per-table state follows its table (beam search, repeats)
            groups = self.groups
            picks = [row * groups + g for row in rows for g in range(groups)]
            self.states = [copy.deepcopy(self.states[i]) for i in picks]
            self.budgets = [self.budgets[i] for i in picks]
        super()._select_rows(rows)


class TokenTableCache(PagedCache):
    """Token-level eviction with reclamation, as a drop-in Hugging Face cache.

    >>> cache = TokenTableCache(model.config, policy=H2O(), budget=256, block_size=16)
    >>> cache = TokenTableCache(model.config, policy=StreamingLLM(), ratio=0.5)

    ``budget``: live tokens kept per table; ``ratio``: a fraction of each row's prompt instead.
    """

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
        self.policy = policy
        self.budget = budget
        self.ratio = ratio
        self.repack_threshold = repack_threshold
        self.reclaim = reclaim
        super().__init__(config, block_size=block_size)

    def budget_for(self, prompt_tokens: int) -> int:
        if self.budget is not None:
            return self.budget
        return max(self.policy.min_budget(), math.ceil(self.ratio * prompt_tokens))

    def stats(self) -> dict[str, float]:
        stats = super().stats()
        stats["repacks"] = sum(layer.repacks for layer in self.paged_layers)
        stats["repack_seconds"] = sum(layer.repack_seconds for layer in self.paged_layers)
        return stats
