"""``HeadwiseCache``: per-head budgets calibrated offline, whose savings are real bytes (Tangram).

A head profile (``kvstack.calibrate``, ``kvstack calibrate``) gives every KV head of every
attention layer a budget B, the fraction of a prompt's tokens it keeps. The cache keeps one token
table per KV head (each head its own tokens, in its own blocks drawn from the arena), and

1. **prefill**: the prompt is attended in full; then each head keeps SnapKV's observation window
   (its last ``window`` tokens) and the top ``ceil(B * (N - window))`` of the other N - window
   prompt tokens by SnapKV's score. The evicted tokens' slots are released and their tables
   repacked, so the blocks go back to the arena: a head of budget 0.2 holds about a fifth of
   the blocks of a full one, where kvpress-style head-wise compression (AdaKV) only masks them.
2. **decode**: every new token is kept (Tangram compresses the prompt once); attention reads only
   the tables, so it is a full cache's attention with the evicted prompt entries of each head
   masked. With every budget 1.0 nothing is evicted: the tokens are ``PagedCache``'s. A decode
   step runs the ragged decode attention (``kvstack.reference.ragged``, a registered op) from
   Tangram's static work list: per layer, the head groups sorted by budget and each group's
   KV splits for ``workers`` workers (``kvstack.head_groups.plan_ahead_of_time``), planned
   once from the profile and reused at every step, length and batch size.

Tables hold one KV head each (``heads_per_group`` 1 in ``kvstack.head_groups``' terms): each
head's pages are sized by its own budget, so nothing is reserved beyond block rounding. Groups of
several heads sharing one table (Tangram's layout for GPU kernels, which the ragged attention
takes) are not built here.

    profile = HeadProfile.load("profile.json")
    cache = HeadwiseCache(model.config, profile)
    model.generate(ids, past_key_values=cache, max_new_tokens=64)
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch

from kvstack.arena import KVArena
from kvstack.calibrate import HeadProfile, ProfileError
from kvstack.errors import InvalidArgumentError
from kvstack.head_groups import group_heads, plan_ahead_of_time, work_list
from kvstack.hf.token_table_cache import TokenTableCache, TokenTableLayer
from kvstack.policies import EvictionPolicy, SnapKV
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD


class HeadwiseLayer(TokenTableLayer):
    """One attention layer of a ``HeadwiseCache``: a token table per (row, KV head), each with
    its head's budget; evicts once, after the prompt."""

    def _start(self) -> None:
        # Tables are row-major (row * groups + head): table i is KV head i % groups.
        self.state = self.policy.init_state(self.batch.num_tables)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else self.batch.num_live
        self.budgets = [
            self.cache.head_budget(self.layer_idx, index % self.groups, tokens)
            for index, tokens in enumerate(prompt)
        ]

    def wants_attention_weights(self) -> bool:
        # The policy scores the prompt only: after it, nothing is evicted.
        return not self.prefilled

    def after_attention(self) -> None:
        if self.prefilled:  # a decode step: its token is kept, nothing to evict or repack
            return
        super().after_attention()

    def ragged_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        # Decode steps run the ragged attention from the cache's work list for this layer.
        return self.cache.ragged_plan(self.layer_idx, self.device)


class HeadwiseCache(TokenTableCache):
    """Per-KV-head budgets from a calibrated head profile, as a drop-in Hugging Face cache.

    >>> profile = HeadProfile.load("profile.json")      # kvstack calibrate --out profile.json
    >>> cache = HeadwiseCache(model.config, profile)    # or HeadwiseCache(config, "profile.json")

    ``profile``: a ``HeadProfile`` or the path of a profile file, made for this model (its layer
    and KV head counts must match the config's). ``policy``: the per-head score that picks each
    head's tokens, SnapKV by default (the score the profile was calibrated with). ``workers``:
    how many workers the decode attention's static work list balances its splits over; by
    default the device's (a GPU's multiprocessors, or torch's CPU threads)."""

    layer_class = HeadwiseLayer

    def __init__(
        self,
        config: Any,
        profile: HeadProfile | str | os.PathLike[str],
        arena: KVArena | None = None,
        *,
        policy: EvictionPolicy | None = None,
        block_size: int = 16,
        repack_threshold: float = DEFAULT_WASTE_THRESHOLD,
        prefill_chunk: int | None = None,
        workers: int | None = None,
    ) -> None:
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise InvalidArgumentError(f"workers must be an int >= 1 or None, got {workers!r}")
        if isinstance(profile, (str, os.PathLike)):
            profile = HeadProfile.load(profile)
        if not isinstance(profile, HeadProfile):
            raise InvalidArgumentError(
                "profile must be a kvstack.calibrate.HeadProfile or the path of a profile file, "
                f"got {type(profile).__name__}"
            )
        profile.check_model(config.get_text_config(decoder=True))
        policy = SnapKV() if policy is None else policy
        if not isinstance(policy, EvictionPolicy) or not policy.per_head:
            raise InvalidArgumentError(
                f"policy must be a per-head kvstack.policies.EvictionPolicy (SnapKV, H2O, "
                f"Scissorhands), got {policy!r}"
            )
        self.profile = profile
        # ratio=1.0 only satisfies TokenTableCache: each table's budget is head_budget's.
        super().__init__(
            config,
            policy,
            ratio=1.0,
            block_size=block_size,
            repack_threshold=repack_threshold,
            reclaim=True,
            prefill_chunk=prefill_chunk,
            arena=arena,
        )
        if len(self.paged_layers) != profile.num_layers:
            raise ProfileError(
                f"profile has budgets for {profile.num_layers} attention layers, but this model "
                f"has {len(self.paged_layers)}; calibrate this model (kvstack calibrate ...)"
            )
        # Model layer index -> the profile's row (its place among the attention layers).
        self._profile_row = {layer.layer_idx: i for i, layer in enumerate(self.paged_layers)}
        self.workers = workers  # of the decode attention's work list (ragged_plan)

    def __repr__(self) -> str:
        return (
            f"HeadwiseCache(layers={self.profile.num_layers}, kv_heads={self.profile.num_kv_heads}"
            f", mean budget={self.profile.mean_budget:.3f}, policy={self.policy!r})"
        )

    def per_head_tables(self) -> bool:
        return True

    def ragged_plan(
        self, layer_idx: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(members [G, 1], work [W, 3]) of layer ``layer_idx`` on ``device``: its head groups
        and Tangram's ahead-of-time work list for them, made on first use and reused by every
        cache of this profile object."""
        device = torch.device(device)
        workers = self.workers or device_workers(device)
        return _ragged_plan(self.profile, self._profile_row[layer_idx], workers, device)

    def head_budget(self, layer_idx: int, head: int, prompt_tokens: int) -> int:
        """Live tokens KV head ``head`` of layer ``layer_idx`` keeps of a ``prompt_tokens``-token
        prompt: the policy's protected tokens (SnapKV's window) and ``ceil(B * rest)`` of the
        rest, B the head's budget. Budget 1.0 keeps the whole prompt."""
        share = self.profile.budgets[self._profile_row[layer_idx]][head]
        protected = min(prompt_tokens, self.policy.min_budget() - 1)
        return max(
            self.policy.min_budget(), protected + math.ceil(share * (prompt_tokens - protected))
        )

    def budget_for(self, prompt_tokens: int) -> int:
        """The largest head budget of any layer for a prompt of ``prompt_tokens`` tokens."""
        return max(
            self.head_budget(layer.layer_idx, head, prompt_tokens)
            for layer in self.paged_layers
            for head in range(self.expected_kv_heads)
        )

    def _steady_blocks(self, tables: int, prompt_tokens: int) -> int:
        # Each head's table at its own budget (and one decode token), for every row.
        rows = tables // self.expected_kv_heads
        return rows * sum(
            self.steady_blocks_per_table(self.head_budget(layer.layer_idx, head, prompt_tokens))
            for layer in self.paged_layers
            for head in range(self.expected_kv_heads)
        )


# id(profile) -> {(layer row, workers, device): (members, work)}: the plans of a profile
# object, shared by every cache built on it (the engine sees at a glance, with ``is``, that its
# head-wise requests run one plan). An entry goes when its profile is collected, so an id is
# never reused while its plans live, and nothing needs a bound.
_PLANS: dict[int, dict[tuple, tuple[torch.Tensor, torch.Tensor]]] = {}


def _ragged_plan(
    profile: HeadProfile, row: int, workers: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(members [G, 1], work [W, 3]) of the profile's attention layer ``row``: its heads sorted
    by budget, one per group, and Tangram's ahead-of-time splits of them for ``workers``."""
    plans = _PLANS.get(id(profile))
    if plans is None:
        plans = _PLANS[id(profile)] = {}
        weakref.finalize(profile, _PLANS.pop, id(profile), None)
    key = (row, workers, device)
    if key not in plans:
        groups = group_heads(profile.budgets, 1, "sorted")[row]
        plan = plan_ahead_of_time([groups], workers)[0]
        members = torch.tensor([group.heads for group in groups], device=device)
        plans[key] = (members, torch.tensor(work_list(plan), device=device))
    return plans[key]  # the same tuple for every cache of this profile


def device_workers(device: torch.device) -> int:
    """How many workers run a decode attention's splits at once on ``device``: a GPU's
    multiprocessors, or the CPU threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return torch.get_num_threads()


def kept_prompt_entries(cache: HeadwiseCache, prompt_tokens: int) -> dict[int, torch.Tensor]:
    """Per attention layer (by model layer index), [KV heads, prompt_tokens] bool: which prompt
    tokens each head of a one-row ``HeadwiseCache`` still holds."""
    if cache.paged_layers[0].batch_size != 1:
        raise InvalidArgumentError(
            f"kept_prompt_entries reads a one-row cache, got {cache.paged_layers[0].batch_size} "
            "rows"
        )
    return {
        layer.layer_idx: layer.batch.alive[:, :prompt_tokens].clone()  # table i is KV head i
        for layer in cache.paged_layers
    }


def masked_attention(kept: dict[int, torch.Tensor], prompt_tokens: int) -> Callable[..., Any]:
    """The kvpress way of head-wise compression, as a transformers attention function over a
    full cache (``DynamicCache``): eager attention in which every query after the prompt sees,
    of the prompt, only the entries its KV head kept (``kept``, from ``kept_prompt_entries``).
    Register it with ``AttentionInterface``: the tokens it gives are what a ``HeadwiseCache``
    must give, and it holds every entry's K/V, which is what ``HeadwiseCache`` frees."""

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **_):
        # query [B, H_q, T, D]; key/value [B, H_kv, S, D]: the whole sequence so far.
        groups = query.shape[1] // key.shape[1]
        t, s = query.shape[2], key.shape[2]
        device = query.device
        positions = torch.arange(s - t, s, device=device)[:, None]  # [T, 1]
        visible = torch.arange(s, device=device)[None, :] <= positions  # [T, S]: causal
        visible = visible[None].expand(key.shape[1], t, s).clone()  # [H_kv, T, S]
        after_prompt = (positions >= prompt_tokens)[None]  # [1, T, 1]
        hidden = ~kept[module.layer_idx].to(device)[:, None, :] & after_prompt  # [H_kv, T, P]
        visible[:, :, :prompt_tokens] &= ~hidden
        visible = visible.repeat_interleave(groups, dim=0)[None]  # [1, H_q, T, S]
        keys = key.repeat_interleave(groups, dim=1)  # [B, H_q, S, D]
        values = value.repeat_interleave(groups, dim=1)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        scores = torch.matmul(query, keys.transpose(-1, -2)) * scale  # [B, H_q, T, S]
        probs = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
        return torch.matmul(probs, values).transpose(1, 2), probs  # [B, T, H_q, D]

    return attention
