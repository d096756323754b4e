"""Token eviction policies on one small interface (vToken: a new policy is tens of lines).

A policy ranks the live tokens of the token tables of one cache layer; ``TokenTableCache`` asks
it for victims whenever a table holds more live tokens than its budget, evicts them and reclaims
their memory. Everything is by *logical index* (the i-th token a table ever appended) over the
N tables of a layer at once, so per-token state survives evictions and repacks unchanged and a
decode step costs a few tensor ops per layer, not per table:

    class EvictionPolicy:
        needs_attention_weights    the cache must hand it each step's attention weights
        per_head                   one token table per KV head (each head keeps its own tokens)
        init_state(N)              state for N tables (e.g. accumulated attention)
        observe(state, alive, w)   alive [N, T] bool; w [N, heads, T_q, T]: this step's attention
                                   weights by logical index (0 for dead tokens)
        observed_queries(state, T_q)   how many of a step's last queries ``observe`` reads:
                                   the cache computes weights for those rows only (SnapKV its
                                   observation window, TOVA the newest query, H2O all of them)
        skip_queries(state, n)     the step's first n queries, whose weights were not computed
        scores(state, alive)       [N, T] float by logical index, higher = more worth keeping
                                   (values at dead tokens are ignored)
        protected(alive, budgets)  [N, T] bool, tokens never evicted (sinks, recent window)

``choose_victims`` is shared: in each table, the ``live - budget`` unprotected live tokens with
the lowest scores (ties go to the older token). "Recent" and "sink" count live tokens: the
k-th newest live token, not logical index T - k.

Two shared fast paths serve the decode step, where the same rule costs fewer tensor ops:
``observe_columns`` takes the weights over the attention view's columns (each table's live
tokens) and by default scatters them to logical indices for ``observe``; a policy whose
observation is a per-token sum (H2O) adds them in place instead. ``choose_one_victim_each``
picks one victim per table among the view's columns when every table holds the same number of
live tokens, one over its budget: the sinks are the first columns and the recent window the
last, so protection is a slice. Both give exactly what the general methods give (tests pin it).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from kvstack.compiled.token_tables import grown_capacity
from kvstack.errors import InvalidArgumentError


def _check_count(name: str, value: Any, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def select_state(state: Any, picks: torch.Tensor) -> Any:
    """State for new tables ``picks`` (new table i continues old table picks[i]): every tensor
    indexed on its first (table) axis, through dicts, lists and tuples."""
    if isinstance(state, torch.Tensor):
        return state[picks.to(state.device)]
    if isinstance(state, LogicalScores):
        return LogicalScores(select_state(state.values, picks))
    if isinstance(state, dict):
        return {key: select_state(value, picks) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(select_state(value, picks) for value in state)
    if state is None or isinstance(state, (int, float)):  # a scalar shared by every table
        return state
    raise TypeError(f"cannot select tables of a {type(state).__name__} state; override select")


class LogicalScores:
    """A float per table and logical index that grows with the tables (shared state helper)."""

    def __init__(self, values: torch.Tensor) -> None:
        self.values = values  # [N, capacity]

    @classmethod
    def zeros(cls, num_tables: int) -> LogicalScores:
        return cls(torch.zeros(num_tables, 0))

    def at(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """[N, num_tokens] view of the values on ``device``, grown (with zeros) to
        ``num_tokens``."""
        if self.values.device != device:
            self.values = self.values.to(device)
        capacity = self.values.shape[1]
        if capacity < num_tokens:
            grown = self.values.new_zeros(
                self.values.shape[0], grown_capacity(num_tokens, capacity)
            )
            grown[:, :capacity] = self.values
            self.values = grown
        return self.values[:, :num_tokens]


def stack_columns(rows: Sequence[torch.Tensor], fill: float = 0) -> torch.Tensor:
    """[N_i, L_i] each -> [sum N_i, max L_i]: the rows stacked, each filled with ``fill`` past
    its L_i."""
    width = max(row.shape[1] for row in rows)
    return torch.cat(
        [
            row if row.shape[1] == width else F.pad(row, (0, width - row.shape[1]), value=fill)
            for row in rows
        ]
    )


def _padded_sum(rows: Sequence[torch.Tensor], num_tables: int, num_tokens: int, device):
    """Sum of [N, T_i] rows (T_i <= num_tokens), each zero-padded to [N, num_tokens]."""
    total = torch.zeros(num_tables, num_tokens, device=device)
    for row in rows:
        total[:, : row.shape[1]] += row
    return total


# What a decode step of the general path asks the policy; ``batched_decode_scores`` stands for
# all of them.
_GENERAL_DECODE_METHODS = (
    "observe",
    "observe_columns",
    "observed_queries",
    "skip_queries",
    "scores",
    "protected",
    "recent_window",
    "choose_one_victim_each",
)


@functools.cache
def _batched_scores_hold(policy_type: type) -> bool:
    """Whether ``policy_type``'s ``batched_decode_scores`` gives what its general methods give:
    each of them is defined by the class that defines ``batched_decode_scores`` or by a base of
    it."""
    mro = policy_type.__mro__
    owner = next(cls for cls in mro if "batched_decode_scores" in vars(cls))
    return all(
        next(cls for cls in mro if name in vars(cls)) in owner.__mro__
        for name in _GENERAL_DECODE_METHODS
    )


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

    def init_state(self, num_tables: int) -> Any:
        return None

    def observe(self, state: Any, alive: torch.Tensor, weights: torch.Tensor) -> None:
        """``weights`` [N, heads, T_q, T]: this step's attention by logical index."""

    def observed_queries(self, state: Any, num_queries: int) -> int:
        """How many of the last of a step's ``num_queries`` queries ``observe`` reads (all of
        them by default; none for a policy that needs no weights). The cache computes attention
        weights only for those rows and calls ``skip_queries`` for the others first, so the
        state ends as it would have after observing every row."""
        return num_queries if self.needs_attention_weights else 0

    def skip_queries(self, state: Any, count: int) -> None:
        """The step's first ``count`` queries, left out by ``observed_queries``: nothing to do
        for a policy whose state depends only on the rows it reads."""

    def observe_columns(
        self, state: Any, alive: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor
    ) -> None:
        """``observe`` for weights over view columns: ``weights`` [N, heads, T_q, W] where
        column j of table i is logical token ``indices[i, j]`` ([N, W], distinct per row;
        padding columns carry weight 0). Tokens of no column received no attention."""
        if bool(alive.all()):  # nothing evicted: column j is logical token j
            by_index = F.pad(weights, (0, alive.shape[1] - weights.shape[-1]))
        else:
            by_index = weights.new_zeros((*weights.shape[:3], alive.shape[1]))
            by_index.scatter_(3, indices[:, None, None, :].expand(weights.shape), weights)
        self.observe(state, alive, by_index)

    def scores(self, state: Any, alive: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def select(self, state: Any, picks: Sequence[int]) -> Any:
        """State for a new set of tables, new table i continuing old table ``picks[i]`` (beam
        search, repeats). The default indexes every tensor of the state on its first axis."""
        return select_state(state, torch.as_tensor(list(picks), dtype=torch.int64))

    def recent_window(self, budget: int) -> int:
        """How many of the newest live tokens a table with this budget keeps."""
        return self.recent_tokens

    def protected(self, alive: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
        count = alive.cumsum(dim=1)  # [N, T]: the k-th oldest live token has count k
        keep = count <= self.sink_tokens
        recent = [self.recent_window(b) for b in budgets]
        if any(recent):
            live = count[:, -1:]  # [N, 1]
            keep |= count > live - torch.tensor(recent, device=alive.device)[:, None]
        return keep & alive

    def choose_victims(
        self, state: Any, alive: torch.Tensor, budgets: Sequence[int]
    ) -> torch.Tensor:
        """[N, T] bool: the tokens to evict so that each table keeps at most its budget."""
        budget = torch.tensor(list(budgets), device=alive.device)
        excess = (alive.sum(dim=1) - budget).clamp(min=0)  # [N]
        most = int(excess.max()) if excess.numel() else 0
        if most == 0:
            return torch.zeros_like(alive)
        candidate = alive & ~self.protected(alive, budgets)
        key = self.scores(state, alive).float().masked_fill(~candidate, math.inf)
        if most == 1:  # a decode step: at most one victim per table
            # argmin returns the first minimum: the older token on a tie, as the sort below.
            victim = key.argmin(dim=1, keepdim=True)  # [N, 1]
            return torch.zeros_like(alive).scatter_(1, victim, (excess == 1)[:, None])
        # Stable sort: among equal scores the older token (smaller logical index) goes first.
        order = torch.sort(key, dim=1, stable=True).indices  # [N, T]
        first = torch.arange(alive.shape[1], device=alive.device)[None, :] < excess[:, None]
        return torch.zeros_like(alive).scatter_(1, order, first)

    def batched_decode(self) -> bool:
        """Whether a serving engine may run a decode step of many caches' layers at once
        through ``batched_decode_scores`` (``kvstack.serve.evicting_decode``): the policy
        implements it, protects tokens by the shared rule (sinks and recent window), and its
        batched scores still mean what its general methods compute (``_batched_scores_hold``:
        a subclass of H2O that overrides ``scores``, say, keeps the general path)."""
        return (
            type(self).batched_decode_scores is not EvictionPolicy.batched_decode_scores
            and type(self).protected is EvictionPolicy.protected
            and _batched_scores_hold(type(self))
        )

    def batched_decode_scores(
        self,
        states: list[Any],
        indices: list[torch.Tensor],
        num_tokens: list[int],
        received: torch.Tensor,
    ) -> torch.Tensor:
        """A decode step of R caches' layers at once, each table holding its budget + 1 live
        tokens: ``states`` the layers' states, ``indices`` [N_i, L_i] each layer's view (its
        tables' live tokens in logical order), ``num_tokens`` each layer's logical length,
        ``received`` [sum N_i, W] the attention each view column got this step, summed over
        the table's query heads (0 past a row's L_i). Observes the step into every state and
        returns the scores by column [sum N_i, W] (past a row's L_i: anything): exactly what
        ``observe_columns`` then ``scores`` give at those columns, with the same floats."""
        raise NotImplementedError(f"{type(self).__name__} has no batched decode")

    def choose_one_victim_each(
        self, state: Any, alive: torch.Tensor, live_indices: torch.Tensor, budget: int
    ) -> torch.Tensor | None:
        """Decode fast path of ``choose_victims`` when every table holds L = budget + 1 live
        tokens, ``live_indices`` [N, L] (each table's live tokens in logical order): the logical
        index of each table's victim, [N]. None when the policy protects tokens other than by
        the shared rule (then use ``choose_victims``)."""
        if type(self).protected is not EvictionPolicy.protected:
            return None
        width = live_indices.shape[1]
        first, end = self.sink_tokens, width - self.recent_window(budget)  # candidate columns
        candidates = live_indices[:, first:end]  # [N, end - first]
        key = self.scores(state, alive).gather(1, candidates)
        # argmin returns the first minimum: the older token on a tie, as choose_victims.
        column = key.float().argmin(dim=1, keepdim=True)  # [N, 1]
        return candidates.gather(1, column)[:, 0]


class StreamingLLM(EvictionPolicy):
    """Attention sinks + a recent window (Xiao et al., ICLR'24): keep the first ``sink_tokens``
    tokens and evict the oldest of the rest."""

    def __init__(self, *, sink_tokens: int = 4) -> None:
        super().__init__(sink_tokens=sink_tokens)

    def scores(self, state: Any, alive: torch.Tensor) -> torch.Tensor:
        newer = torch.arange(alive.shape[1], device=alive.device, dtype=torch.float32)
        return newer.expand(alive.shape)  # newer tokens score higher


class RandomEviction(EvictionPolicy):
    """Evict uniformly at random among unprotected tokens (a baseline); seeded, reproducible,
    one generator per table."""

    def __init__(self, *, seed: int = 0, sink_tokens: int = 0, recent_tokens: int = 0) -> None:
        super().__init__(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
        self.seed = _check_count("seed", seed)

    def init_state(self, num_tables: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(self.seed) for _ in range(num_tables)]

    def select(self, state: list[torch.Generator], picks: Sequence[int]):
        return [torch.Generator().set_state(state[i].get_state()) for i in picks]

    def scores(self, state: list[torch.Generator], alive: torch.Tensor) -> torch.Tensor:
        scores = torch.zeros(alive.shape, device=alive.device)
        for index, generator in enumerate(state):
            live = alive[index]
            draws = torch.rand(int(live.sum()), generator=generator)
            scores[index, live] = draws.to(alive.device)
        return scores


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

    def recent_window(self, budget: int) -> int:
        return int(self.recent_fraction * budget)

    def init_state(self, num_tables: int) -> LogicalScores:
        return LogicalScores.zeros(num_tables)

    def observe(self, state: LogicalScores, alive: torch.Tensor, weights: torch.Tensor) -> None:
        state.at(alive.shape[1], alive.device).add_(weights.sum(dim=(1, 2)).float())

    def observe_columns(
        self, state: LogicalScores, alive: torch.Tensor, weights: torch.Tensor, indices
    ) -> None:
        # The same sums, added where the columns belong (no [N, heads, T_q, T] scatter).
        received = weights.sum(dim=(1, 2)).float()  # [N, L]
        state.at(alive.shape[1], alive.device).scatter_add_(1, indices, received)

    def scores(self, state: LogicalScores, alive: torch.Tensor) -> torch.Tensor:
        return state.at(alive.shape[1], alive.device)

    def batched_decode_scores(self, states, indices, num_tokens, received):
        sums = [s.at(n, received.device) for s, n in zip(states, num_tokens, strict=True)]
        # observe_columns' scatter_add_: one addition per column, the old sum plus the step's.
        scores = stack_columns([s.gather(1, i) for s, i in zip(sums, indices, strict=True)])
        scores += received
        start = 0
        for values, columns in zip(sums, indices, strict=True):
            end = start + columns.shape[0]
            values.scatter_(1, columns, scores[start:end, : columns.shape[1]])
            start = end
        return scores


class TOVA(EvictionPolicy):
    """Token Omission Via Attention (Oren et al., 2024): keep the tokens the newest query attends
    to most, its weights averaged over the layer's heads."""

    needs_attention_weights = True

    def init_state(self, num_tables: int) -> dict:
        return {"last": torch.zeros(num_tables, 0)}  # by logical index: survives evictions

    def observe(self, state: dict, alive: torch.Tensor, weights: torch.Tensor) -> None:
        state["last"] = weights[:, :, -1, :].mean(dim=1).float()  # [N, T]

    def observed_queries(self, state: dict, num_queries: int) -> int:
        return min(1, num_queries)  # the newest query alone

    def scores(self, state: dict, alive: torch.Tensor) -> torch.Tensor:
        last = state["last"]
        return _padded_sum([last], last.shape[0], alive.shape[1], alive.device)


class Scissorhands(EvictionPolicy):
    """Persistence of importance (Liu et al., NeurIPS'23), per KV head: over the last
    ``history`` queries, count how often each token was important (attention >= the uniform
    1/L); evict the least persistent, keeping a recent window."""

    needs_attention_weights = True
    per_head = True

    def __init__(self, *, history: int = 32, recent_tokens: int = 16, sink_tokens: int = 0) -> None:
        super().__init__(sink_tokens=sink_tokens, recent_tokens=recent_tokens)
        self.history = _check_count("history", history, minimum=1)

    def init_state(self, num_tables: int) -> dict:
        return {"marks": []}  # one [N, T] row of 0/1 per remembered query, oldest first

    def observe(self, state: dict, alive: torch.Tensor, weights: torch.Tensor) -> None:
        per_query = weights.float().mean(dim=1)  # [N, T_q, T], averaged over the heads
        # The uniform weight 1/L of each table's L live tokens (computed as the paper's float).
        uniform = (1.0 / alive.sum(dim=1).double()).float()[:, None]  # [N, 1]
        for query in range(max(0, per_query.shape[1] - self.history), per_query.shape[1]):
            important = (per_query[:, query] >= uniform) & alive
            state["marks"].append(important.float())
        del state["marks"][: -self.history]

    def observed_queries(self, state: dict, num_queries: int) -> int:
        return min(self.history, num_queries)  # the marks of the last ``history`` queries

    def scores(self, state: dict, alive: torch.Tensor) -> torch.Tensor:
        return _padded_sum(state["marks"], alive.shape[0], alive.shape[1], alive.device)


class SnapKV(EvictionPolicy):
    """SnapKV (Li et al., 2024), per KV head: a token's score is the attention it receives from
    the last ``window`` queries (the observation window), summed over those queries and the
    heads that read this KV head, then max-pooled over neighbouring tokens (``kernel_size``) so
    that kept tokens come with their context; the window itself is always kept.

    The paper compresses once, after prefill, from the last ``window`` prompt queries. Here
    eviction goes on through decode, and the observation window hops rather than slides:
    windows of ``window`` queries tile the query stream from its first query, and the votes
    are those of the last closed window plus the open one's (``window`` to ``2 * window - 1``
    queries; a P-token prompt's first eviction uses its last ``window + P % window``). Tiling
    the stream makes the votes independent of how queries are split across calls (prefill
    chunks, observation chunks), and the state is two running sums per table instead of
    ``window`` rows of attention: it costs what H2O's does (kvpress's DecodingPress likewise
    rescores from a buffer of recent queries every few steps)."""

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

    def init_state(self, num_tables: int) -> dict:
        # By logical index: the votes of the last closed window, of the open one, and how many
        # queries the open one holds (the same for every table: they see the same queries).
        return {
            "closed": LogicalScores.zeros(num_tables),
            "open": LogicalScores.zeros(num_tables),
            "open_queries": 0,
        }

    def observe(self, state: dict, alive: torch.Tensor, weights: torch.Tensor) -> None:
        per_query = weights.float().sum(dim=1)  # [N, T_q, T], summed over the group's heads
        num_queries, num_tokens = per_query.shape[1], alive.shape[1]
        start = 0
        while start < num_queries:
            if state["open_queries"] == 0 and num_queries - start >= 2 * self.window:
                start += self.window  # this window and the next close here: the next wins
                continue
            fill = min(self.window - state["open_queries"], num_queries - start)
            state["open"].at(num_tokens, alive.device).add_(
                per_query[:, start : start + fill].sum(dim=1)
            )
            state["open_queries"] += fill
            start += fill
            if state["open_queries"] == self.window:  # close it; it replaces the last closed
                state["closed"], state["open"] = state["open"], state["closed"]
                state["open"].at(num_tokens, alive.device).zero_()
                state["open_queries"] = 0

    def observed_queries(self, state: dict, num_queries: int) -> int:
        # After the step the open window holds the stream's last (open + T_q) % window queries
        # and the closed one the window before them: the step's rows before those only fill
        # windows that are replaced before it ends.
        return min(num_queries, self.window + (state["open_queries"] + num_queries) % self.window)

    def skip_queries(self, state: dict, count: int) -> None:
        if count == 0:
            return
        # ``observed_queries`` leaves out whole windows' worth of rows, from the open window's
        # start: the tiling goes on at a window boundary, and the next window to close (read in
        # full) replaces the closed votes. Both are zeroed, so nothing stale can remain.
        if (state["open_queries"] + count) % self.window:
            raise InvalidArgumentError(
                f"count must end at a window boundary of SnapKV's tiling (window {self.window}, "
                f"{state['open_queries']} queries in the open one), got {count}"
            )
        state["open_queries"] = 0
        for key in ("closed", "open"):
            state[key].values.zero_()

    def scores(self, state: dict, alive: torch.Tensor) -> torch.Tensor:
        votes = state["closed"].at(alive.shape[1], alive.device) + state["open"].at(
            alive.shape[1], alive.device
        )  # [N, T]
        # SnapKV (Listing 1) pools the prefix only, over live neighbours: the window is kept
        # whole, and its own votes must not leak into the scores of the prefix tokens next to it.
        order = torch.sort(~alive, dim=1, stable=True).indices  # [N, T]: live first, in order
        compact = votes.gather(1, order)  # [N, T]: each table's live votes, then dead ones
        prefix = (alive.sum(dim=1) - self.window).clamp(min=0)  # [N]
        in_prefix = torch.arange(alive.shape[1], device=alive.device)[None, :] < prefix[:, None]
        pooled = F.max_pool1d(
            compact.masked_fill(~in_prefix, -math.inf)[:, None, :],  # [N, 1, T]
            self.kernel_size,
            stride=1,
            padding=self.kernel_size // 2,
        )[:, 0]
        compact = torch.where(in_prefix, pooled, compact)
        return torch.empty_like(votes).scatter_(1, order, compact)

    def batched_decode_scores(self, states, indices, num_tokens, received):
        device = received.device
        closed = stack_columns(
            [
                s["closed"].at(n, device).gather(1, i)
                for s, i, n in zip(states, indices, num_tokens, strict=True)
            ]
        )  # [sum N, W]
        opened = stack_columns(
            [
                s["open"].at(n, device).gather(1, i)
                for s, i, n in zip(states, indices, num_tokens, strict=True)
            ]
        )
        opened += received  # ``observe`` of one query: it joins the open window
        start = 0
        for state, columns, n in zip(states, indices, num_tokens, strict=True):
            rows, width = slice(start, start + columns.shape[0]), columns.shape[1]
            state["open_queries"] += 1
            if state["open_queries"] == self.window:  # it closes and replaces the last closed
                state["closed"], state["open"] = state["open"], state["closed"]
                state["open"].at(n, device).zero_()
                state["open_queries"] = 0
                closed[rows] = opened[rows]
                opened[rows] = 0.0
                state["closed"].at(n, device).scatter_(1, columns, closed[rows, :width])
            else:
                state["open"].at(n, device).scatter_(1, columns, opened[rows, :width])
            start = rows.stop
        votes = closed + opened  # [sum N, W]: each row's live tokens in order, as ``scores``
        # ``scores``' pooling: the prefix (a row's live tokens but the window) only.
        live = torch.tensor(
            [columns.shape[1] for columns in indices for _ in range(columns.shape[0])],
            device=device,
        )
        prefix = (live - self.window).clamp(min=0)[:, None]  # [sum N, 1]
        in_prefix = torch.arange(votes.shape[1], device=device)[None, :] < prefix
        pooled = F.max_pool1d(
            votes.masked_fill(~in_prefix, -math.inf)[:, None, :],  # [sum N, 1, W]
            self.kernel_size,
            stride=1,
            padding=self.kernel_size // 2,
        )[:, 0]
        return torch.where(in_prefix, pooled, votes)


# The policies by the name the CLI, the demo and the benchmarks use.
BY_NAME: dict[str, type[EvictionPolicy]] = {
    "h2o": H2O,
    "scissorhands": Scissorhands,
    "random": RandomEviction,
    "streamingllm": StreamingLLM,
    "snapkv": SnapKV,
    "tova": TOVA,
}

__all__ = [
    "BY_NAME",
    "H2O",
    "TOVA",
    "EvictionPolicy",
    "RandomEviction",
    "Scissorhands",
    "SnapKV",
    "StreamingLLM",
]
