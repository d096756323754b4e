"""Token eviction policies on one small interface (vToken: a new policy is tens of lines).

A policy ranks the live tokens of one token table; ``TokenTableCache`` asks it for victims
whenever a table holds more live tokens than its budget, evicts them and reclaims their memory.

    class EvictionPolicy:
        needs_attention_weights   the cache must hand it each step's attention weights
        per_head                  one token table per KV head (each head keeps its own tokens)
        init_state(table)         per-table state (e.g. accumulated attention)
        observe(state, table, w)  w: [heads, T_q, L] weights of this step over the live tokens
        scores(state, table)      [L] float, higher = more worth keeping
        protected(L, budget)      [L] bool, tokens never evicted (attention sinks, recent window)

``choose_victims`` is shared: the ``L - budget`` unprotected tokens with the lowest scores
(ties go to the older token). All tensors over live tokens are in logical order
(``table.live_indices()``); per-token state is stored by logical index, so it survives evictions
and repacks unchanged.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from kvstack.errors import InvalidArgumentError
from kvstack.reference.token_table import TokenTable


def _check_count(name: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


class LogicalScores:
    """A float per logical token index that grows with the table (shared state helper)."""

    def __init__(self) -> None:
        self.values = torch.zeros(0)

    def at(self, table: TokenTable) -> torch.Tensor:
        """View of the values, grown to the table's logical length."""
        if self.values.numel() < table.num_tokens:
            grown = torch.zeros(max(table.num_tokens, 2 * self.values.numel()))
            grown[: self.values.numel()] = self.values
            self.values = grown
        return self.values[: table.num_tokens]


class EvictionPolicy:
    needs_attention_weights = False
    per_head = False

    def __init__(self, *, sink_tokens: int = 0, recent_tokens: int = 0) -> None:
        self.sink_tokens = _check_count("sink_tokens", sink_tokens)
        self.recent_tokens = _check_count("recent_tokens", recent_tokens)

    def __repr__(self) -> str:
        # Valid Python: the subclass's own constructor arguments, read back from its attributes.
        names = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        args = ", ".join(f"{name}={getattr(self, name)!r}" for name in names)
        return f"{type(self).__name__}({args})"

    def min_budget(self) -> int:
        """The smallest budget this policy can honour: everything it must keep, plus one."""
        return self.sink_tokens + self.recent_tokens + 1

    def init_state(self, table: TokenTable) -> Any:
        return None

    def observe(self, state: Any, table: TokenTable, weights: torch.Tensor) -> None:
        """``weights`` [heads, T_q, L]: this step's attention over the table's live tokens."""

    def scores(self, state: Any, table: TokenTable) -> torch.Tensor:
        raise NotImplementedError

    def protected(self, live: int, budget: int) -> torch.Tensor:
        keep = torch.zeros(live, dtype=torch.bool)
        keep[: self.sink_tokens] = True
        if self.recent_tokens:
            keep[-self.recent_tokens :] = True
        return keep

    def choose_victims(self, state: Any, table: TokenTable, budget: int) -> torch.Tensor:
        """Logical indices of the tokens to evict so that at most ``budget`` stay live."""
        live = table.live_indices()
        excess = live.numel() - budget
        if excess <= 0:
            return live[:0]
        scores = self.scores(state, table).float().cpu()
        scores = scores.masked_fill(self.protected(live.numel(), budget), math.inf)
        # Stable sort: among equal scores the older token (smaller logical index) goes first.
        order = torch.sort(scores, stable=True).indices
        return live[order[:excess].to(live.device)].sort().values


class StreamingLLM(EvictionPolicy):
    """Attention sinks + a recent window (Xiao et al., ICLR'24): keep the first ``sink_tokens``
    tokens and evict the oldest of the rest."""

    def __init__(self, *, sink_tokens: int = 4) -> None:
        super().__init__(sink_tokens=sink_tokens)

    def scores(self, state: Any, table: TokenTable) -> torch.Tensor:
        return table.live_indices().float()  # newer tokens score higher


class RandomEviction(EvictionPolicy):
    """Evict uniformly at random among unprotected tokens (a baseline); seeded, reproducible."""

    def __init__(self, *, seed: int = 0, sink_tokens: int = 0, recent_tokens: int = 0) -> None:
        super().__init__(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
        self.seed = _check_count("seed", seed)

    def init_state(self, table: TokenTable) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)

    def scores(self, state: torch.Generator, table: TokenTable) -> torch.Tensor:
        return torch.rand(table.num_live, generator=state)


class H2O(EvictionPolicy):
    """Heavy-Hitter Oracle (Zhang et al., NeurIPS'23), per KV head: a token's score is the
    attention it has received so far, summed over queries and the query heads that read this KV
    head; keep the heavy hitters plus a recent window of ``recent_fraction`` of the budget."""

    needs_attention_weights = True
    per_head = True

    def __init__(self, *, recent_fraction: float = 0.5, sink_tokens: int = 0) -> None:
        if not 0.0 <= recent_fraction < 1.0:
            raise InvalidArgumentError(
                f"recent_fraction must be in [0, 1), got {recent_fraction!r}"
            )
        super().__init__(sink_tokens=sink_tokens)
        self.recent_fraction = recent_fraction

    def min_budget(self) -> int:
        # The recent window grows with the budget: the sinks, int(recent_fraction * budget)
        # recent tokens and one heavy hitter must fit, or a protected token would be evicted.
        budget = self.sink_tokens + 1
        while self.sink_tokens + int(self.recent_fraction * budget) + 1 > budget:
            budget += 1
        return budget

    def protected(self, live: int, budget: int) -> torch.Tensor:
        keep = super().protected(live, budget)
        recent = int(self.recent_fraction * budget)
        if recent:
            keep[-recent:] = True
        return keep

    def init_state(self, table: TokenTable) -> LogicalScores:
        return LogicalScores()

    def observe(self, state: LogicalScores, table: TokenTable, weights: torch.Tensor) -> None:
        state.at(table)[table.live_indices().cpu()] += weights.sum(dim=(0, 1)).float().cpu()

    def scores(self, state: LogicalScores, table: TokenTable) -> torch.Tensor:
        return state.at(table)[table.live_indices().cpu()]


class TOVA(EvictionPolicy):
    """Token Omission Via Attention (Oren et al., 2024): keep the tokens the newest query attends
    to most, its weights averaged over the layer's heads."""

    needs_attention_weights = True

    def init_state(self, table: TokenTable) -> dict:
        return {}

    def observe(self, state: dict, table: TokenTable, weights: torch.Tensor) -> None:
        last = torch.zeros(table.num_tokens)  # by logical index, so it survives evictions
        last[table.live_indices().cpu()] = weights[:, -1, :].mean(dim=0).float().cpu()
        state["last"] = last

    def scores(self, state: dict, table: TokenTable) -> torch.Tensor:
        last = torch.zeros(table.num_tokens)
        last[: state["last"].numel()] = state["last"]
        return last[table.live_indices().cpu()]


class Scissorhands(EvictionPolicy):
    """Persistence of importance (Liu et al., NeurIPS'23), per KV head: over the last
    ``history`` queries, count how often each token was important (attention >= the uniform
    1/L); evict the least persistent, keeping a recent window."""

    needs_attention_weights = True
    per_head = True

    def __init__(self, *, history: int = 32, recent_tokens: int = 16, sink_tokens: int = 0) -> None:
        super().__init__(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
        self.history = _check_count("history", history, minimum=1)

    def init_state(self, table: TokenTable) -> dict:
        return {"marks": []}  # one LogicalScores-like row per remembered query

    def observe(self, state: dict, table: TokenTable, weights: torch.Tensor) -> None:
        live = table.live_indices().cpu()
        per_query = weights.float().mean(dim=0).cpu()  # [T_q, L]
        for row in per_query[-self.history :]:
            marks = torch.zeros(table.num_tokens)
            marks[live] = (row >= 1.0 / live.numel()).float()
            state["marks"].append(marks)
        del state["marks"][: -self.history]

    def scores(self, state: dict, table: TokenTable) -> torch.Tensor:
        live = table.live_indices().cpu()
        total = torch.zeros(table.num_tokens)
        for marks in state["marks"]:
            total[: marks.numel()] += marks
        return total[live]


class SnapKV(EvictionPolicy):
    """SnapKV (Li et al., 2024), per KV head: a token's score is the attention it receives from
    the last ``window`` queries (the observation window), summed over those queries and the
    heads that read this KV head, then max-pooled over neighbouring tokens (``kernel_size``) so
    that kept tokens come with their context; the window itself is always kept."""

    needs_attention_weights = True
    per_head = True

    def __init__(self, *, window: int = 32, kernel_size: int = 7) -> None:
        super().__init__(recent_tokens=_check_count("window", window, minimum=1))
        if _check_count("kernel_size", kernel_size, minimum=1) % 2 == 0:
            raise InvalidArgumentError(
                f"kernel_size must be a positive odd integer, got {kernel_size!r}"
            )
        self.window = window
        self.kernel_size = kernel_size

    def init_state(self, table: TokenTable) -> dict:
        return {"rows": []}  # attention rows of the most recent queries, by logical index

    def observe(self, state: dict, table: TokenTable, weights: torch.Tensor) -> None:
        live = table.live_indices().cpu()
        per_query = weights.float().sum(dim=0).cpu()  # [T_q, L], summed over the group's heads
        for row in per_query[-self.window :]:
            by_index = torch.zeros(table.num_tokens)
            by_index[live] = row
            state["rows"].append(by_index)
        del state["rows"][: -self.window]

    def scores(self, state: dict, table: TokenTable) -> torch.Tensor:
        live = table.live_indices().cpu()
        votes = torch.zeros(table.num_tokens)
        for row in state["rows"]:
            votes[: row.numel()] += row
        votes = votes[live]
        # SnapKV (Listing 1) pools the prefix only: the window is kept whole, and its own votes
        # must not leak into the scores of the prefix tokens next to it.
        prefix = max(live.numel() - self.window, 0)
        if prefix:
            pooled = F.max_pool1d(
                votes[None, None, :prefix],
                self.kernel_size,
                stride=1,
                padding=self.kernel_size // 2,
            )
            votes[:prefix] = pooled[0, 0]
        return votes


__all__ = [
    "H2O",
    "TOVA",
    "EvictionPolicy",
    "RandomEviction",
    "Scissorhands",
    "SnapKV",
    "StreamingLLM",
]
