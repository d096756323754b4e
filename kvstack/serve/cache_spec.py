"""``CacheSpec``: which kvstack cache every request of an engine gets, and what it costs.

``CacheSpec()`` is the lossless ``PagedCache``; ``CacheSpec(policy=H2O(), ratio=0.5)`` an
evicting ``TokenTableCache`` (``reclaim=False``: vToken's Naive-Evict baseline, whose blocks never
shrink); ``CacheSpec(profile=HeadProfile.load(path))`` a ``HeadwiseCache`` (Tangram's per-head
budgets: the prompt compressed head by head, then every decode token kept). The spec builds one cache per request on the engine's arena; ``CacheGeometry`` says
what its pages cost, from which ``Engine.admission_bytes`` and ``Engine.lifetime_bytes`` answer
the scheduler's two memory questions.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from kvstack.arena import KVArena
from kvstack.calibrate import HeadProfile
from kvstack.errors import InvalidArgumentError
from kvstack.hf import ATTENTION_NAME, HeadwiseCache, PagedCache, TokenTableCache
from kvstack.policies import EvictionPolicy
from kvstack.reference.checks import check_positive_int


@dataclass(frozen=True)
class CacheSpec:
    """The cache kind: ``policy`` None is lossless (``PagedCache``); otherwise a
    ``TokenTableCache`` keeping ``budget`` live tokens per table, or ``ratio`` of the prompt.
    ``profile`` (a ``HeadProfile``): a ``HeadwiseCache`` with its per-head budgets (``policy``,
    if given, its per-head score; SnapKV by default)."""

    policy: EvictionPolicy | None = None
    budget: int | None = None
    ratio: float | None = None
    reclaim: bool = True
    block_size: int = 16
    profile: HeadProfile | None = None

    def __post_init__(self) -> None:
        check_positive_int("block_size", self.block_size)
        if not isinstance(self.reclaim, bool):
            raise InvalidArgumentError(f"reclaim must be True or False, got {self.reclaim!r}")
        if self.profile is not None:
            if not isinstance(self.profile, HeadProfile):
                raise InvalidArgumentError(
                    "profile must be a kvstack.calibrate.HeadProfile (HeadProfile.load(path)), "
                    f"got {type(self.profile).__name__}"
                )
            if self.budget is not None or self.ratio is not None or not self.reclaim:
                raise InvalidArgumentError(
                    "a profile gives every head its own budget and always reclaims; give no "
                    f"budget, ratio or reclaim=False with it (got budget={self.budget!r}, "
                    f"ratio={self.ratio!r}, reclaim={self.reclaim!r})"
                )
            return  # the policy (per-head) is checked by HeadwiseCache itself
        if self.policy is None:
            if self.budget is not None or self.ratio is not None or not self.reclaim:
                raise InvalidArgumentError(
                    "budget, ratio and reclaim=False describe an evicting cache; give a policy "
                    f"(got policy=None, budget={self.budget!r}, ratio={self.ratio!r}, "
                    f"reclaim={self.reclaim!r})"
                )
            return
        if not isinstance(self.policy, EvictionPolicy):
            raise InvalidArgumentError(
                f"policy must be a kvstack.policies.EvictionPolicy or None, got "
                f"{type(self.policy).__name__}"
            )
        # Budget and ratio (exactly one, in range for this policy) are checked by
        # TokenTableCache itself when the engine builds its first cache from this spec.

    def __repr__(self) -> str:
        # A profile's budgets would fill the line: name it by its model and mean budget.
        fields = [f"policy={self.policy!r}"] if self.policy is not None else []
        fields += [f"budget={self.budget!r}"] if self.budget is not None else []
        fields += [f"ratio={self.ratio!r}"] if self.ratio is not None else []
        fields += ["reclaim=False"] if not self.reclaim else []
        fields += [f"block_size={self.block_size}"]
        if self.profile is not None:
            fields.append(
                f"profile=<{self.profile.num_layers} layers x {self.profile.num_kv_heads} heads, "
                f"mean budget {self.profile.mean_budget:.3f}>"
            )
        return f"CacheSpec({', '.join(fields)})"

    @property
    def evicting(self) -> bool:
        return self.policy is not None or self.headwise

    @property
    def headwise(self) -> bool:
        """Per-head budgets (``HeadwiseCache``): the prompt is compressed, decode tokens kept."""
        return self.profile is not None

    @property
    def bounded(self) -> bool:
        """Whether a request's pages are bounded by its budget (an evicting cache that
        reclaims); otherwise its cache keeps a block for every token it has seen (or, head-wise,
        for every token since its compressed prompt)."""
        return self.evicting and self.reclaim and not self.headwise

    @property
    def compresses_prompt(self) -> bool:
        """Whether the prompt is evicted down to a budget chunk by chunk as it is computed."""
        return self.bounded or self.headwise

    def build(self, config: Any, arena: KVArena, prefill_chunk: int | None) -> PagedCache:
        """A fresh cache for one request, on ``arena``. ``config`` must run the ``"kvstack"``
        attention (the engine hands each request's cache its own attention call)."""
        if not self.evicting:
            return PagedCache(config, block_size=self.block_size, arena=arena)
        if self.headwise:
            return HeadwiseCache(
                config,
                self.profile,
                arena,
                policy=self.policy,
                block_size=self.block_size,
                prefill_chunk=prefill_chunk,
            )
        return TokenTableCache(
            config,
            policy=self.policy,
            budget=self.budget,
            ratio=self.ratio,
            block_size=self.block_size,
            reclaim=self.reclaim,
            prefill_chunk=prefill_chunk,
            arena=arena,
        )


@dataclass(frozen=True)
class CacheGeometry:
    """What one request's cache looks like in the arena: per attention layer, ``tables`` token
    tables whose blocks are ``block_bytes`` each."""

    attention_layers: int
    tables: int  # per layer, for one sequence: 1, or the KV heads (per-head eviction)
    block_size: int
    block_bytes: int

    @classmethod
    def of(cls, cache: PagedCache, itemsize: int) -> CacheGeometry:
        heads = 1 if cache.per_head_tables() else cache.expected_kv_heads
        return cls(
            attention_layers=len(cache.paged_layers),
            tables=cache.expected_kv_heads // heads,
            block_size=cache.block_size,
            block_bytes=cache.min_page_bytes(itemsize),
        )

    def bytes_for(self, tokens_per_table: int, *, extra_blocks_per_table: int = 0) -> int:
        """Arena bytes for every attention layer's tables to hold ``tokens_per_table`` tokens."""
        blocks = math.ceil(tokens_per_table / self.block_size) + extra_blocks_per_table
        return self.attention_layers * self.tables * blocks * self.block_bytes


def cache_config(config: Any) -> Any:
    """A copy of a model's config whose attention is ``"kvstack"``: each request's cache then
    behaves as under ``generate`` with the kvstack attention, while the model itself runs the
    engine's attention (which calls the kvstack attention once per sequence)."""
    config = copy.deepcopy(config)
    config._attn_implementation = ATTENTION_NAME
    return config
