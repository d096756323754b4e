"""``TieredCache``: a lossless Hugging Face cache whose KV blocks live across device, host and
disk, with the next layer's blocks fetched while the current layer computes.

    cache = TieredCache(model.config, device_budget="4MiB", host_budget="16MiB",
                        disk_path="kv_pages", disk_budget="1GiB", policy="cost")
    out = model.generate(ids, past_key_values=cache, max_new_tokens=64)

Each attention layer keeps its newest, partly filled block on the device (the *tail*) and
stores every full block as a page (``L{layer}.B{block}``: keys and values, [batch, kv_heads,
block_size, head_dim]) in a ``TieredStore``. A page starts on the device; when the device
budget is spent the store demotes pages to host, then disk, in the order of the eviction rule.
At each step a layer reads all its pages back in logical order (from the device, or as fetched
copies: the attention sees exactly the keys ``DynamicCache`` would hold, so the tokens are the
same) and then hands the next layer's pages to the ``Prefetcher``, which fetches them while this
layer's attention and MLP run.

Device memory is the device tier's budget, the layers' tails, and the pages one layer gathers
for its attention (``peak_layer_page_bytes``; fetched copies are freed after use) plus those
of the next layer being fetched. This is the layer-wise streaming of offloading systems. When
the tiers cannot take a step's new blocks, the step raises ``TierFull`` (``TieredCache`` says
exactly when, and what is left): the layers before the failing one have taken the step, so
the cache must be ``reset()``.

**Multi-segment attention** (AsymCache; ``merge_segments=True``, with the model on the
``"kvstack_tiers"`` attention): a layer does not concatenate its pages into one K/V in logical
order. It hands the attention its keys by source: the device-resident pages with the tail, the
fetched pages, the recomputed pages; each segment is attended on its own by the registered
``multi_segment_attention`` op (positions give each key its causal place) and the results merge
by log-sum-exp, which equals attention over the union. Each segment is still copied once into
the paged attention's pool layout (pages are [B, H, block, D] tensors, the pool
[B, T_s, H, D]): the same bytes as the gather, plus an attention call per segment (on CPU
the cpp backend's decode kernel) and one merge where the gather makes one sdpa call. On this project's CPU benchmark that is slower
(``tiers.decode_speed_ratio.segments_over_gathered``), so it is off by default; a device tier
kept in one pool, attended in place, is what would make it pay. Other attentions (sdpa, eager)
always get the gathered K/V.

Placement and the attention-aware rule need the attention scores, which sdpa does not give a
cache: with the model on the ``"kvstack_tiers"`` attention (``kvstack.tiers.attention``: sdpa's
outputs, so the tokens are the same), each layer's keys are scored by an observation window of
the step's last queries. ``placement="attention"`` then places the pages once a prefill's last
layer has scored them: the most attended on device, the next on host, the rest on disk
(SnapKV-style, ``TieredStore.place``); ``policy="attention"`` demotes the pages with the lowest
running average of those scores first (KVDrive); ``track_attention=True`` scores the steps for
``stats()["device_attention_share"]`` alone. Scores are computed only for a cache that asks for
them (each is a small matmul per layer and step), and such a cache refuses a config on another
attention.

**Lossless recompute** (``recompute_with=model``, AsymCache): when every tier is full, the lowest
tier on drops pages instead of refusing the step (``TierFull``), in the eviction rule's order
with ``demote_to=None`` (the cost-aware rule then drops the pages cheapest to recompute: the
earliest positions). A dropped page is computed again from its tokens when a layer reads it:
one forward of the model over the tokens from the first dropped block to the last, on a
``DynamicCache`` holding every layer's pages before them, gives the dropped pages of this and
every later layer (kept until those layers read them in this step, then freed: a dropped page
is recomputed at every step that reads it, never stored again, so the tiers' budgets hold).
A page file that fails its checksum when read is dropped (deleted, with a warning) and
recomputed the same way, never attended to (without ``recompute_with`` it raises
``PageCorrupted``). The cache learns the tokens from a forward pre-hook on ``model`` (each
step's ``input_ids``);
rows with padding and ``inputs_embeds`` are refused, before anything changes. The recompute
forward holds that span's K/V for every layer: transient device memory beside the budgets.

Hybrid models (Jamba, Bamba, Qwen3-Next, LFM2, NemotronH): their state layers keep transformers'
own ``LinearAttentionLayer`` on the device (fixed-size conv and recurrent states, rewritten every
step); ``save()`` writes each one's states as a page beside the KV, and ``resume()`` restores
them before any K/V is used. A saved conversation whose state page is missing or damaged is a
miss (deleted, and ``generate`` recomputes it), never K/V continued from zeroed states.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
import weakref
from pathlib import Path
from typing import Any

import torch
from transformers import Cache, DynamicCache, cache_utils
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, LinearAttentionLayer

from kvstack.arena import parse_bytes
from kvstack.errors import InvalidArgumentError, KVStackError, PageCorrupted, TierFull
from kvstack.tiers import attention as tiers_attention
from kvstack.tiers.disk import DiskTier, Page, page_file_bytes, page_nbytes
from kvstack.tiers.eviction import RULES, EvictionRule
from kvstack.tiers.prefetch import Prefetcher, check_worker_count
from kvstack.tiers.store import TieredStore
from kvstack.transformers_compat import cache_keyword

# The layer transformers gives a layer without attention or state (NemotronH's MLP layers);
# transformers before 5.2x has none (such a model then has no such layer in its cache).
DummyLayer = getattr(cache_utils, "DummyLayer", None)

PLACEMENTS = ("recency", "attention")  # where prefill leaves pages: newest on device, or by score
MANIFEST = "conversation.json"  # a saved conversation's record, on the disk tier
# The segments of a layer's keys, by where they came from this step, in the order they are
# attended and merged (``TieredCache(merge_segments=True)``).
SEGMENT_SOURCES = ("device", "fetched", "recomputed")


def _entry_keys(entry: dict[str, Any]) -> list[str]:
    """The page keys one layer's manifest entry names: KV pages and tail, or its state page."""
    keys = [*entry.get("pages", []), entry.get("tail"), entry.get("state")]
    return [key for key in keys if key]


def _layer_states(layer: LinearAttentionLayer) -> dict[str, torch.Tensor]:
    """A state layer's initialised states by name (``conv0``, ``recurrent0``, ...)."""
    states = {}
    for index in range(layer.number_of_states):
        for kind, tensors in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            if tensors[index] is not None:
                states[f"{kind}{index}"] = tensors[index]
    return states


def _restore_states(
    layer: LinearAttentionLayer, page: dict[str, torch.Tensor], flags: list[bool], device
) -> None:
    """Put a saved state page back into a fresh layer, as transformers' own lazy
    initialisation would have built it, then copied into (static addresses kept)."""
    for index in range(layer.number_of_states):
        conv, recurrent = page.get(f"conv{index}"), page.get(f"recurrent{index}")
        if conv is not None:
            conv = conv.to(device)
            layer.lazy_initialization(conv_states=conv, state_idx=index)
            layer.conv_states[index].copy_(conv)
        if recurrent is not None:
            recurrent = recurrent.to(device)
            layer.lazy_initialization(recurrent_states=recurrent, state_idx=index)
            layer.recurrent_states[index].copy_(recurrent)
            if layer.device is None:
                layer.dtype, layer.device = recurrent.dtype, recurrent.device
        layer.has_previous_state[index] = bool(flags[index])


def _page_file_bytes(
    batch: int, heads: int, block_size: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The bytes of one KV page's file on the disk tier, under the shortest key a page gets
    (``L0.B0``): its K and V, [batch, heads, block_size, head_dim] each, and the file's header
    and checksum."""
    empty = torch.empty(batch, heads, block_size, head_dim, dtype=dtype, device="meta")
    return page_file_bytes("L0.B0", {"k": empty, "v": empty})


def _token_list(token_ids: torch.Tensor | list[int]) -> list[int]:
    """One sequence's ids as a list: a [1, n] or [n] tensor, or a list."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() == 2 and token_ids.shape[0] == 1:
            token_ids = token_ids[0]
        if token_ids.dim() != 1:
            raise InvalidArgumentError(
                f"token_ids has shape {tuple(token_ids.shape)}; expected [n] or [1, n] (one sequence)"
            )
        return [int(t) for t in token_ids.tolist()]
    return [int(t) for t in token_ids]


def _record_step_ids(
    cache_ref: weakref.ref, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]
) -> None:
    """``recompute_with``'s forward pre-hook: hand the step's ids to the cache it runs on (they
    are committed when its first attention layer takes the step's K/V)."""
    cache = cache_ref()
    # transformers >= 5.24 names the model's cache argument ``cache``, earlier ones
    # ``past_key_values`` (still accepted, with a warning).
    if cache is None or kwargs.get("cache", kwargs.get("past_key_values")) is not cache:
        return
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache.note_step_ids(ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))


def _forget_step_ids(cache_ref: weakref.ref, *hook_args: Any) -> None:
    """``recompute_with``'s forward hook, called even when the forward raises: ids the step did
    not commit (it failed before its first attention layer) belong to no K/V, and must not be
    committed by a later step that reaches the cache without the pre-hook."""
    cache = cache_ref()
    if cache is not None:
        cache._step_ids = None


class TieredLayer(CacheLayerMixin):
    """One attention layer's K/V: full blocks in the store, the newest partial block on device."""

    is_compileable = False
    is_sliding = False

    def __init__(self, cache: TieredCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.page_keys: list[str] = []
        self.tail_keys: torch.Tensor | None = None  # [B, H, <block_size, D]
        self.tail_values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.cache.check_first_states(key_states)
        self.device = key_states.device
        self.tail_keys = key_states[..., :0, :]
        self.tail_values = value_states[..., :0, :]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ):
        pending = tiers_attention.pending()
        if pending.layer is not None and pending.layer.cache is self.cache:
            # The layer before stored K/V and no "kvstack_tiers" attention call took it: the
            # model runs another attention, so no scores reach this cache, and a layer that
            # handed over segments returned only its step's K/V to an attention that read them.
            segments = pending.segments is not None
            pending.clear()
            if segments:
                raise KVStackError(self.cache.segments_need_attention())
            if self.cache.needs_attention:
                raise KVStackError(self.cache.attention_needed())
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        block = self.cache.block_size
        keys = torch.cat([self.tail_keys, key_states], dim=-2)  # [B, H, tail + T, D]
        values = torch.cat([self.tail_values, value_states], dim=-2)
        full = keys.shape[-2] // block
        stored = len(self.page_keys)
        try:
            for i in range(full):  # store each filled block as a page (on device, demoting others)
                index = len(self.page_keys)
                key = f"L{self.layer_idx}.B{index}"
                span = slice(i * block, (i + 1) * block)
                self.cache.store.put(
                    key,
                    {"k": keys[..., span, :], "v": values[..., span, :]},
                    position=index * block,
                    tokens=block,
                )
                self.page_keys.append(key)
        except BaseException:
            # This layer is left as it was before the step (its tail unchanged, the pages of
            # this step gone). Earlier layers have taken the step: the cache as a whole can
            # only be reset() now, which the error's caller (generate) cannot continue anyway.
            for key in self.page_keys[stored:]:
                self.cache.store.delete(key)
            del self.page_keys[stored:]
            raise
        if self is self.cache.attention_layers[0]:
            # The first layer has stored the step's K/V: now its ids name tokens the cache
            # holds (a recompute reading them may follow in this very layer).
            self.cache.commit_step_ids(key_states.shape[-2])
        # The tail is copied out so it does not keep this step's whole K/V alive.
        self.tail_keys = keys[..., full * block :, :].clone()
        self.tail_values = values[..., full * block :, :].clone()
        sourced = self.cache.read_layer_pages(self)  # [(page, where it came from)], in order
        pages = [page for page, _ in sourced]
        self.cache.note_layer_pages(pages)
        self.cache.prefetch_after(self.layer_idx)
        if self.cache.attends_by_segments():
            # The attention call that follows reads the segments; it gets the step's K/V only.
            pending.layer, pending.key = self, key_states
            pending.segments = self.segments(sourced)
            pending.gather = functools.partial(self.gather, pages)
            return key_states, value_states
        all_keys, all_values = self.gather(pages)
        if self.cache.needs_attention:  # scores are computed only for a cache that uses them
            pending.layer, pending.key = self, all_keys  # for the attention call that follows
        return all_keys, all_values

    def gather(self, pages: list[Page]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value of the layer in order, ``pages`` then the tail: [B, H, seen, D]
        each (a copy)."""
        keys = torch.cat([p["k"] for p in pages] + [self.tail_keys], dim=-2)
        values = torch.cat([p["v"] for p in pages] + [self.tail_values], dim=-2)
        return keys, values

    def segments(self, sourced: list[tuple[Page, str]]) -> list[tiers_attention.Segment]:
        """The layer's keys as segments by source (``read_layer_pages``' order of sources:
        device, fetched, recomputed; the tail with the device pages), each a pool of one block
        of its keys per row, [B, T_s, H, D]: the layout the paged attention reads."""
        block, device = self.cache.block_size, self.device
        by_source: dict[str, list[int]] = {}
        for index, (_, source) in enumerate(sourced):
            by_source.setdefault(source, []).append(index)
        by_source.setdefault("device", [])
        segments = []
        for source in SEGMENT_SOURCES:
            if source not in by_source:
                continue
            indices = by_source[source]
            keys = [sourced[i][0]["k"] for i in indices]  # each [B, H, block, D]
            values = [sourced[i][0]["v"] for i in indices]
            positions = [torch.arange(i * block, (i + 1) * block) for i in indices]
            if source == "device":  # the newest tokens, after every page
                keys.append(self.tail_keys)
                values.append(self.tail_values)
                first = len(sourced) * block
                positions.append(torch.arange(first, first + self.tail_keys.shape[-2]))
            segments.append(
                tiers_attention.Segment(
                    source,
                    # [B, H, T, D] pieces -> [B, T_s, H, D]: one copy, in the pool's layout.
                    torch.cat([k.transpose(1, 2) for k in keys], dim=1),
                    torch.cat([v.transpose(1, 2) for v in values], dim=1),
                    torch.cat(positions).to(device),
                )
            )
        return segments

    def observe_attention(self, mass: torch.Tensor, query_length: int) -> None:
        """Take the attention scores of this step's keys ([B, seen] float32, each row summing to
        1, from ``kvstack.tiers.attention``): each page's share goes to the cache."""
        block, pages = self.cache.block_size, len(self.page_keys)
        # [B, pages * block] -> [B, pages, block]: a page's share is its tokens' sum, and the
        # rows of a batch share their pages.
        shares = mass[:, : pages * block].reshape(mass.shape[0], pages, block).sum(-1).mean(0)
        self.cache.observe_page_attention(self, shares.tolist(), prefill=query_length > 1)

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return len(self.page_keys) * self.cache.block_size + self.tail_keys.shape[-2]

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple[int, int]:
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for key in self.page_keys:
            self.cache.store.delete(key)
        self.page_keys = []
        self.tail_keys = self.tail_values = None
        self.is_initialized = False

    def _unsupported(self, *args: Any, **kwargs: Any) -> None:
        raise KVStackError(
            "TieredCache keeps one sequence's blocks in its tiers; beam search and batch "
            "reordering are not supported yet (use num_beams=1)"
        )

    reorder_cache = batch_repeat_interleave = batch_select_indices = crop = _unsupported


class TieredCache(Cache):
    """Lossless: ``generate`` with it makes exactly ``DynamicCache``'s tokens, whatever the budgets.

    ``device_budget``, ``host_budget`` and ``disk_budget`` are bytes (an int or a string such as
    ``"4MiB"``); ``policy`` is ``"lru"``, ``"attention"``, ``"cost"`` or an eviction rule object;
    ``placement`` is ``"recency"`` or ``"attention"``; ``track_attention`` scores decode steps
    for ``stats()["device_attention_share"]`` (see the module docstring). ``recompute_with``:
    the model, for lossless recompute (when every tier is full, pages are dropped and computed
    again when read, instead of ``TierFull``). ``merge_segments`` (on the ``"kvstack_tiers"``
    attention): each step attends the device-resident, fetched and recomputed pages as separate
    segments merged by log-sum-exp (AsymCache's multi-segment attention); False, the default,
    gathers them into one K/V for sdpa (faster on CPU today: see the module docstring). Other
    attentions always get the gathered K/V. ``prefetch_workers`` threads fetch the next layer's
    pages while a layer computes; 0 fetches each page on the model's thread when it is read (no
    overlap; on a CPU with no spare core, a worker competes with the model's thread for the GIL
    and the core: ``tiers.decode_speed_ratio.device25_fetch_when_read`` measures both).

    ``TierFull`` is raised in exactly two places:

    * **A step** (a forward through the model), when an attention layer stores a block that
      the step filled and the store cannot make room for it: room is made by dropping copies,
      then demoting pages one tier down in the rule's order, and the lowest tier on is full of
      pages that cannot go (without ``recompute_with``: any page; with it, pages that are not
      KV, such as a save's tails, or are being copied). Left: the failing layer as it was
      before the step (the pages it stored in this step deleted, its tail unchanged); the
      attention layers before it have taken the step, those after it have not; pages demoted
      (or dropped) while room was made stay where they went, whole (or recomputable). The
      layers may disagree on the sequence's length, so ``reset()`` the cache before using it
      again.
    * **save()**, when the disk cannot hold every page of the conversation: no manifest is
      written, the previous save stays in force, and the cache goes on (see ``save``).

    Reads never raise it: a page is promoted only into free room, and fetched copies are
    outside the budgets.
    """

    def __init__(
        self,
        config: Any,
        *,
        device_budget: int | str,
        host_budget: int | str,
        disk_path: str | os.PathLike | None = None,
        disk_budget: int | str = 0,
        policy: str | EvictionRule = "lru",
        placement: str = "recency",
        track_attention: bool = False,
        block_size: int = 16,
        device: str | torch.device = "cpu",
        prefetch_workers: int = 1,
        recompute_with: torch.nn.Module | None = None,
        merge_segments: bool = False,
        _resuming: bool = False,
    ) -> None:
        default_layers = DynamicCache(config=config).layers  # checked before anything is built
        for index, layer in enumerate(default_layers):
            # Exact types: a subclass (a sliding window) has semantics the pages would lose.
            if type(layer) not in (DynamicLayer, LinearAttentionLayer, DummyLayer):
                raise KVStackError(
                    f"layer {index} is a {type(layer).__name__}; TieredCache supports full "
                    "attention layers and state layers (LinearAttentionLayer: Mamba, gated "
                    "delta-net, short conv), not sliding windows or layers holding both"
                )
        if recompute_with is not None:
            if not isinstance(recompute_with, torch.nn.Module):
                raise InvalidArgumentError(
                    f"recompute_with={type(recompute_with).__name__}; expected the model (a "
                    "torch.nn.Module) whose K/V this cache holds"
                )
            if any(type(layer) is LinearAttentionLayer for layer in default_layers):
                raise KVStackError(
                    "recompute_with: a dropped page is recomputed from the K/V of the tokens "
                    "before it, but a hybrid model's state layers would need their recurrent "
                    "state at that position, which is not kept; use recompute_with=None"
                )
        if not any(type(layer) is DynamicLayer for layer in default_layers):
            raise KVStackError(
                "the model has no full attention layer; TieredCache pages attention K/V (a "
                "model of state layers only has nothing to tier)"
            )
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size={block_size!r}; expected a positive int")
        check_worker_count(prefetch_workers, "prefetch_workers")  # before the store's directory
        if isinstance(policy, str):
            if policy not in RULES:
                raise InvalidArgumentError(f"policy={policy!r}; expected one of {sorted(RULES)}")
            policy = RULES[policy]()
        if placement not in PLACEMENTS:
            raise InvalidArgumentError(f"placement={placement!r}; expected one of {PLACEMENTS}")
        self.placement = placement
        self._rule_name = type(policy).__name__
        if not isinstance(merge_segments, bool):
            raise InvalidArgumentError(f"merge_segments={merge_segments!r}; expected a bool")
        self.merge_segments = merge_segments
        if not isinstance(track_attention, bool):
            raise InvalidArgumentError(f"track_attention={track_attention!r}; expected a bool")
        self.track_attention = track_attention
        # Whether the attention scores pages for this cache (a cost per layer and step).
        self.needs_attention = (
            placement == "attention" or getattr(policy, "uses_attention", False) or track_attention
        )
        text_config = config.get_text_config(decoder=True)
        self._text_config = text_config  # its attention implementation can change later
        if self.needs_attention and (
            getattr(text_config, "_attn_implementation", None) != tiers_attention.ATTENTION_NAME
        ):
            raise InvalidArgumentError(self.attention_needed())
        kv_heads = (
            getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        )
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        dtype = getattr(text_config, "dtype", None) or torch.float32
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
        self.block_size = block_size
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype = dtype if isinstance(dtype, torch.dtype) else torch.float32
        self.device = torch.device(device)
        self.page_bytes = 2 * block_size * kv_heads * head_dim * itemsize  # one row's K and V
        budgets = {
            name: parse_bytes(name, value)
            for name, value in (
                ("device_budget", device_budget),
                ("host_budget", host_budget),
                ("disk_budget", disk_budget),
            )
        }
        # A disk page is a file: its header and checksum take room in the budget beside the
        # K/V (checked with the shortest key a page gets: the least a file can take).
        self.page_file_bytes = _page_file_bytes(1, kv_heads, block_size, head_dim, self.dtype)
        for name, budget in budgets.items():
            needed = self.page_file_bytes if name == "disk_budget" else self.page_bytes
            if 0 < budget < needed:
                what = "a page file" if name == "disk_budget" else "K and V"
                raise InvalidArgumentError(
                    f"{name}={budget} cannot hold one page of {needed} bytes ({what} of "
                    f"{block_size} tokens); expected 0 (tier off) or at least {needed}"
                )
        if budgets["device_budget"] == 0:
            raise InvalidArgumentError(
                f"device_budget=0; expected at least one page ({self.page_bytes} bytes): new "
                "blocks are stored on the device first"
            )
        self.store = TieredStore(
            device_bytes=budgets["device_budget"],
            host_bytes=budgets["host_budget"],
            disk_path=disk_path,
            disk_bytes=budgets["disk_budget"],
            device=device,
            rule=policy,
            min_page_bytes=self.page_bytes,
            min_page_file_bytes=self.page_file_bytes,
            may_drop=recompute_with is not None,
        )
        disk = self.store.disk
        if disk is not None and not _resuming and (disk.keys() or disk.read_record(MANIFEST)):
            raise InvalidArgumentError(
                f"disk_path={str(disk_path)!r} already holds pages ({len(disk.keys())} files) or "
                "a saved conversation; resume it with TieredCache.resume, or give an empty "
                "directory"
            )
        self.prefetcher = Prefetcher(self.store, device, workers=prefetch_workers)
        # State layers keep transformers' own LinearAttentionLayer, on the device: their states
        # are fixed-size and rewritten every step. They reach disk with the KV on save().
        layers = [
            TieredLayer(self, index) if type(layer) is DynamicLayer else layer
            for index, layer in enumerate(default_layers)
        ]
        super().__init__(layers=layers)
        self.attention_layers = [layer for layer in layers if isinstance(layer, TieredLayer)]
        self.peak_layer_page_bytes = 0
        self.resume_miss: str | None = None  # why resume() could not use a saved conversation
        self.resume_damage: str | None = None  # why resume() kept only a prefix of it
        # The save in force: its serial and its tail and state pages. Each save writes these
        # under new names and deletes the previous ones only once its manifest is written.
        self._save_serial = 0
        self._saved_keys: set[str] = set()
        # Attention scores (from the "kvstack_tiers" attention): a prefill's page shares, kept
        # until its last layer places the pages, and the decode steps' share on the device.
        self._prefill_shares: dict[str, float] = {}
        self._device_share_sum = 0.0
        self._device_share_count = 0
        # Lossless recompute: the model, the ids of every token fed so far ([B, n]), the pages
        # recomputed for layers that have not read them yet in this step, and what it cost.
        self._config = config
        self._recompute_model = recompute_with
        self._token_ids: torch.Tensor | None = None
        # The ids of the step under way: recorded before the forward (``note_step_ids``),
        # committed to ``_token_ids`` when the first attention layer stores the step's K/V.
        self._step_ids: torch.Tensor | None = None
        self._recomputed: dict[str, Page] = {}
        self.recomputes = 0
        self.damaged_pages_recomputed = 0
        self.recomputed_tokens = 0
        self.recompute_seconds = 0.0
        if recompute_with is not None:
            # The hook holds the cache weakly; it is removed when the cache goes.
            hooks = [
                recompute_with.register_forward_pre_hook(
                    functools.partial(_record_step_ids, weakref.ref(self)), with_kwargs=True
                ),
                recompute_with.register_forward_hook(
                    functools.partial(_forget_step_ids, weakref.ref(self)), always_call=True
                ),
            ]
            for hook in hooks:
                weakref.finalize(self, hook.remove)

    def attention_needed(self) -> str:
        """Why this cache needs the ``"kvstack_tiers"`` attention, and how to give it."""
        return (
            f"TieredCache(policy={self._rule_name}, placement={self.placement!r}, "
            f"track_attention={self.track_attention}) uses attention scores, which only the "
            f"{tiers_attention.ATTENTION_NAME!r} attention reports; load the model with "
            f"attn_implementation={tiers_attention.ATTENTION_NAME!r}, or call "
            f"model.set_attn_implementation({tiers_attention.ATTENTION_NAME!r}) after importing "
            "kvstack.tiers, and build the cache from that model's config"
        )

    def attends_by_segments(self) -> bool:
        """Whether a layer hands its keys to the attention as segments (merged by log-sum-exp)
        rather than gathered into one K/V: with ``merge_segments``, on the ``"kvstack_tiers"``
        attention (the only one that reads segments)."""
        return self.merge_segments and (
            getattr(self._text_config, "_attn_implementation", None)
            == tiers_attention.ATTENTION_NAME
        )

    def segments_need_attention(self) -> str:
        """Why a step whose layer handed over segments went wrong, and what to do."""
        return (
            "a TieredCache layer handed its keys to the attention as segments, but no "
            f"{tiers_attention.ATTENTION_NAME!r} attention call read them (the cache's config "
            "says the model runs it; is the cache built from another config object than the "
            "model's?); build the cache from model.config, or use merge_segments=False"
        )

    def observe_page_attention(
        self, layer: TieredLayer, shares: list[float], prefill: bool
    ) -> None:
        """A layer's page shares of this step's attention: each page's running average for
        the attention-aware rule; at prefill, placement once the last layer has scored its
        pages; at decode, the share that fell on the device (pages homed there and the tail)."""
        for key, share in zip(layer.page_keys, shares, strict=True):
            self.store.observe_attention(key, share)
        if prefill:
            if self.placement == "attention":
                self._prefill_shares.update(zip(layer.page_keys, shares, strict=True))
                if layer is self.attention_layers[-1]:
                    scores, self._prefill_shares = self._prefill_shares, {}  # even if place fails
                    self.store.place(sorted(scores, key=lambda k: (-scores[k], k)))
            return
        homes = self.store.homes(layer.page_keys)
        on_device = sum(
            s for key, s in zip(layer.page_keys, shares, strict=True) if homes[key] == "device"
        )
        self._device_share_sum += on_device + max(0.0, 1.0 - sum(shares))  # the tail's share
        self._device_share_count += 1

    def prefetch_after(self, layer_idx: int) -> None:
        """Fetch the next layer's pages (after the last layer: the first, for the next step);
        dropped pages are recomputed when read, not fetched."""
        later = [layer for layer in self.attention_layers if layer.layer_idx > layer_idx]
        following = later[0] if later else self.attention_layers[0]
        dropped = self.store.dropped_among(following.page_keys) if self.store.may_drop else set()
        self.prefetcher.prefetch([key for key in following.page_keys if key not in dropped])

    def read_layer_pages(self, layer: TieredLayer) -> list[tuple[Page, str]]:
        """Every page of ``layer``, in order, on the device, with where it came from:
        ``"device"`` (the device tier), ``"fetched"`` (from host or disk; a page with room above
        moves up: after a resume, or pages deleted) or ``"recomputed"`` (dropped from every
        tier, or, with ``recompute_with``, damaged)."""
        keys = layer.page_keys
        dropped = self.store.dropped_among(keys) if self.store.may_drop else set()
        self.prefetcher.forget(dropped)
        present = [key for key in keys if key not in dropped]
        try:
            taken = dict(zip(present, self.prefetcher.take_all(present), strict=True))
        except PageCorrupted:
            if not self.store.may_drop:
                raise
            taken = self._take_dropping_damaged(present, dropped)
        self.store.promote_all(
            [(key, page) for key, (page, tier) in taken.items() if tier != "device"]
        )
        if dropped - self._recomputed.keys():
            self._recompute(layer)
        return [
            (taken[key][0], "device" if taken[key][1] == "device" else "fetched")
            if key in taken
            else (self._recomputed.pop(key), "recomputed")
            for key in keys
        ]

    def _take_dropping_damaged(
        self, keys: list[str], dropped: set[str]
    ) -> dict[str, tuple[Page, str]]:
        """``take_all`` of ``keys`` page by page, after one of them failed its checksum: a
        damaged page is dropped (its file deleted, with a warning) and added to ``dropped``, to
        be recomputed like any dropped page, never attended to."""
        taken = {}
        for key in keys:
            try:
                taken[key] = self.prefetcher.take_all([key])[0]
            except PageCorrupted as error:
                self._drop_damaged(key, error)
                dropped.add(key)
        return taken

    def _drop_damaged(self, key: str, error: PageCorrupted) -> None:
        self.store.drop(key)
        self.damaged_pages_recomputed += 1
        warnings.warn(
            f"TieredCache: page {key!r} is damaged ({error}); it is dropped and recomputed "
            "from its tokens",
            stacklevel=3,
        )

    def note_step_ids(
        self, input_ids: torch.Tensor | None, attention_mask: Any, position_ids: Any = None
    ) -> None:
        """Record a step's token ids before the model runs it (``recompute_with``'s forward
        pre-hook): what a dropped page is recomputed from. They are held aside until the first
        attention layer stores the step's K/V (``commit_step_ids``): a forward that fails or is
        refused before that leaves no ids for tokens without K/V. Refuses, changing nothing, a
        step it could not recompute."""
        self._step_ids = None  # a step before this one that never reached the cache
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise InvalidArgumentError(
                "TieredCache(recompute_with=model) recomputes dropped pages from each step's "
                f"input_ids; got input_ids={type(input_ids).__name__} (inputs_embeds are not "
                "supported); expected a [batch, tokens] tensor"
            )
        if isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all()):
            raise InvalidArgumentError(
                "TieredCache(recompute_with=model) recomputes a page of every row at once; "
                "rows with padding (zeros in attention_mask) are not supported"
            )
        seen = self.get_seq_length()
        if isinstance(position_ids, torch.Tensor):
            # A recompute gives the tokens the positions that follow the K/V before them.
            expected = torch.arange(seen, seen + input_ids.shape[1], device=position_ids.device)
            if position_ids.shape[-1] != input_ids.shape[1] or not bool(
                (position_ids == expected).all()
            ):
                raise InvalidArgumentError(
                    "TieredCache(recompute_with=model) recomputes a page at the positions that "
                    f"follow the tokens before it; this step's position_ids are not {seen}, "
                    f"{seen + 1}, ... (rows with padding are not supported)"
                )
        recorded = 0 if self._token_ids is None else self._token_ids.shape[1]
        if recorded != seen:
            raise KVStackError(
                f"TieredCache(recompute_with=model) knows the ids of {recorded} tokens but holds "
                f"the K/V of {seen}: a step reached it through another module than the model "
                "it was built with"
            )
        self._step_ids = input_ids.detach().to("cpu", torch.long)  # [B, T]

    def commit_step_ids(self, tokens: int) -> None:
        """Append the recorded step's ids to the ids of the tokens the cache holds: called by
        the first attention layer once it stored the step's ``tokens`` tokens of K/V. Nothing
        to commit (a step that reached the cache without the model's pre-hook) leaves the
        count behind, which the next step's ``note_step_ids`` refuses."""
        ids, self._step_ids = self._step_ids, None
        if ids is None or ids.shape[1] != tokens:
            return
        self._token_ids = ids if self._token_ids is None else torch.cat([self._token_ids, ids], 1)

    def _recompute_span(
        self, requesting: TieredLayer
    ) -> tuple[int, int, dict[TieredLayer, list[int]]]:
        """(first block, last block, each layer's dropped blocks) of the span a recompute for
        ``requesting`` runs. It ends at the last dropped page a layer still to read this step
        needs, and starts at the first page any layer lacks: the forward needs every layer's
        pages before it. A layer that has not stored this step's blocks yet (a long prefill)
        holds fewer pages, and the span starts earlier."""
        dropped = {}  # layer -> indices of its dropped blocks, ascending
        for layer in self.attention_layers:
            gone = self.store.dropped_among(layer.page_keys)
            dropped[layer] = [i for i, key in enumerate(layer.page_keys) if key in gone]
        last = max(
            blocks[-1]
            for layer, blocks in dropped.items()
            if blocks and layer.layer_idx >= requesting.layer_idx
        )
        first = min(
            [blocks[0] for blocks in dropped.values() if blocks]
            + [len(layer.page_keys) for layer in self.attention_layers]
        )
        return first, last, dropped

    def _recompute(self, requesting: TieredLayer) -> None:
        """One forward over the tokens of the span of dropped pages (``_recompute_span``) on a
        ``DynamicCache`` holding every layer's pages before it; keeps the dropped pages of
        ``requesting`` and the layers after it (those before it have read this step's pages)
        in ``_recomputed``. A page before the span that fails its checksum is dropped too, and
        the span starts earlier."""
        start = time.perf_counter()
        while True:
            first, last, dropped = self._recompute_span(requesting)
            before: dict[str, Page] = {}
            damaged = None
            for layer in self.attention_layers:
                for key in layer.page_keys[:first]:
                    try:
                        before[key] = self.store.peek(key)[0]
                    except PageCorrupted as error:
                        damaged = key, error
                        break
                if damaged:
                    break
            if damaged is None:
                break
            self._drop_damaged(*damaged)
        ids = self._token_ids
        block = self.block_size
        if ids is None or ids.shape[1] < (last + 1) * block:
            raise KVStackError(
                f"TieredCache: page {last} of a layer was dropped, but the cache knows the ids "
                f"of {0 if ids is None else ids.shape[1]} tokens; expected at least "
                f"{(last + 1) * block}"
            )
        prefix = DynamicCache(config=self._config)
        if first:
            for layer in self.attention_layers:
                # Pages come from every tier (host and disk ones on the CPU): each goes to the
                # layer's device before the concatenation, which needs them all on one.
                pages = [before[key] for key in layer.page_keys[:first]]
                keys = torch.cat([p["k"].to(layer.device) for p in pages], dim=-2)  # [B, H, T, D]
                values = torch.cat([p["v"].to(layer.device) for p in pages], dim=-2)
                prefix.update(keys, values, layer.layer_idx)
        model = self._recompute_model
        backbone = getattr(model, "base_model", model)  # no logits needed, only the K/V
        # The ids go where the model embeds them: not necessarily the cache's device (a model
        # placed across devices, or a cache built with device="cuda" for the model's cuda:1).
        embed_device = model.get_input_embeddings().weight.device
        span = ids[:, first * block : (last + 1) * block].to(embed_device)  # [B, span]
        with torch.no_grad():
            backbone(input_ids=span, use_cache=True, **{cache_keyword(backbone): prefix})
        for layer, blocks in dropped.items():
            if layer.layer_idx < requesting.layer_idx or not blocks:
                continue
            computed = prefix.layers[layer.layer_idx]  # [B, H, last + 1 blocks, D] each
            keys, values = computed.keys, computed.values
            # Each recomputed page goes to the device, and the dtype, of the K/V the layer
            # attends with (its tail: what the step's own K/V came as): the recompute ran
            # wherever the model's layer runs, and it is concatenated with resident and fetched
            # pages, or attended as a segment beside them, all of which are there. A copy in
            # any case (``.to`` may return a view): a slice would keep the span's K/V alive.
            target = {"device": layer.device, "dtype": layer.tail_keys.dtype}
            for index in blocks:
                cut = slice(index * block, (index + 1) * block)
                self._recomputed[layer.page_keys[index]] = {
                    "k": keys[..., cut, :].to(**target, copy=True),
                    "v": values[..., cut, :].to(**target, copy=True),
                }
        self.recomputes += 1
        self.recomputed_tokens += span.shape[1]
        self.recompute_seconds += time.perf_counter() - start

    def note_layer_pages(self, pages: list[dict[str, torch.Tensor]]) -> None:
        """Track the most page bytes one layer gathered for its attention (device-tier pages
        and fetched copies alike)."""
        gathered = sum(t.numel() * t.element_size() for p in pages for t in p.values())
        self.peak_layer_page_bytes = max(self.peak_layer_page_bytes, gathered)

    def check_first_states(self, key_states: torch.Tensor) -> None:
        """Refuse K/V this cache was not built for, before any is stored: another device, or a
        batch and dtype whose pages no budget can hold."""
        if key_states.device != self.device and not (
            key_states.device.type == self.device.type == "cuda" and self.device.index is None
        ):
            raise KVStackError(
                f"TieredCache was built with device={str(self.device)!r}, but the model's K/V are "
                f"on {key_states.device}; build it with device={str(key_states.device)!r}"
            )
        batch, heads, _, head_dim = key_states.shape
        page = 2 * batch * heads * self.block_size * head_dim * key_states.element_size()
        page_file = _page_file_bytes(batch, heads, self.block_size, head_dim, key_states.dtype)
        for name, budget, needed in (
            ("device_budget", self.store.capacity["device"], page),
            ("host_budget", self.store.capacity["host"], page),
            ("disk_budget", self.store.capacity["disk"], page_file),  # a file: header and all
        ):
            if 0 < budget < needed:
                raise InvalidArgumentError(
                    f"{name}={budget} cannot hold one page of this batch ({needed} bytes: batch "
                    f"{batch}, {heads} KV heads, {key_states.dtype}); expected 0 or at least "
                    f"{needed}"
                )

    def _states(self) -> dict[str, torch.Tensor]:
        """Every state layer's states, as ``L{layer}.{name}``."""
        return {
            f"L{index}.{name}": tensor
            for index, layer in enumerate(self.layers)
            if isinstance(layer, LinearAttentionLayer)
            for name, tensor in _layer_states(layer).items()
        }

    def stats(self) -> dict[str, Any]:
        store = self.store.stats()
        tails = sum(
            t.numel() * t.element_size()
            for layer in self.attention_layers
            if layer.is_initialized
            for t in (layer.tail_keys, layer.tail_values)
        )
        return {
            **store,
            "seen_tokens": self.get_seq_length(),
            "tail_bytes": tails,
            "state_bytes": sum(t.numel() * t.element_size() for t in self._states().values()),
            "peak_layer_page_bytes": self.peak_layer_page_bytes,
            "fetched_bytes": dict(self.prefetcher.bytes_fetched),
            "transfer_seconds": self.prefetcher.transfer_seconds,
            "stall_seconds": self.prefetcher.stall_seconds,
            "overlap_fraction": self.prefetcher.overlap_fraction,
            "recomputes": self.recomputes,
            "damaged_pages_recomputed": self.damaged_pages_recomputed,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_seconds": self.recompute_seconds,
            # Mean over decode steps and layers; None unless the cache asks for scores.
            "device_attention_share": (
                self._device_share_sum / self._device_share_count
                if self._device_share_count
                else None
            ),
        }

    # ------------------------------------------------------------------ across processes
    def geometry(self) -> dict[str, Any]:
        """What a saved conversation's pages assume about the model."""
        return {
            "layers": len(self.layers),
            "layer_kinds": [
                {TieredLayer: "attention", LinearAttentionLayer: "state"}.get(type(layer), "none")
                for layer in self.layers
            ],
            "block_size": self.block_size,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype),
        }

    def save(self, token_ids: torch.Tensor | list[int]) -> None:
        """Persist the conversation so far on the disk tier: every page gets a copy on disk
        (pages already there are not written again; full blocks never change), each layer's
        tail and each state layer's states are written as pages under names of this save, and a
        manifest naming them, with the token ids whose K/V they hold, is written last
        (atomically); only then are the previous save's tail and state pages deleted. A process
        killed, or a full disk, before the manifest leaves the previous save in force. Later
        steps keep the save whole: its pages' disk files are not pushed out to make room (a
        step that finds no other room raises ``TierFull``), except in lossless mode
        (``recompute_with``), which drops them last; ``resume(damaged="recompute")`` then
        recomputes from the first one dropped. The save itself never drops a page: while it
        runs the store's ``may_drop`` is off.
        ``token_ids``: the conversation's ids, at least the tokens the cache has seen (the
        output of ``generate``; its last token, never fed back, is not saved).

        Raises ``TierFull`` when the disk budget (or the disk) cannot hold every page of the
        conversation; then no manifest was written, this save's tail and state pages are
        deleted, the previous save stays in force, and the cache goes on as it was (every page
        keeps its home; only disk copies that no save needed may have been deleted for room)."""
        if self.store.disk is None:
            raise InvalidArgumentError(
                "save() needs a disk tier; build the cache with disk_path and disk_budget"
            )
        if self.store.dropped:
            raise InvalidArgumentError(
                f"save(): {len(self.store.dropped)} pages were dropped from every tier (they are "
                "recomputed when read); a saved conversation holds every page: give the disk "
                "tier room for all of them"
            )
        ids = _token_list(token_ids)
        seen = self.get_seq_length()
        if len(ids) < seen:
            raise InvalidArgumentError(
                f"token_ids has {len(ids)} tokens; expected at least the {seen} the cache has seen"
            )
        self.prefetcher.drain()
        # While it saves, the store drops nothing (lossless mode, may_drop, is off until it
        # returns): room made on disk for one of the save's files could otherwise drop a page
        # that the save has written or is about to name, a page of the save still in force
        # among them. A disk that cannot hold the conversation raises TierFull instead: every
        # page keeps its home (disk copies not kept by the save in force may have made room).
        may_drop, self.store.may_drop = self.store.may_drop, False
        try:
            self._save(ids, seen)
        finally:
            self.store.may_drop = may_drop

    def _save(self, ids: list[int], seen: int) -> None:
        """``save`` of ``ids`` (the first ``seen`` of them hold K/V), its checks done."""
        serial = self._save_serial + 1
        written: list[str] = []  # this save's tail and state pages
        try:
            layers = self._save_pages(serial, written)
            missing = [
                key
                for entry in layers
                for key in _entry_keys(entry)
                if "disk" not in self.store.tiers_of(key)
            ]
            if missing:  # a later copy pushed an earlier one out: the budget cannot hold them all
                raise TierFull(
                    f"disk tier: disk_budget={self.store.capacity['disk']} bytes cannot hold the "
                    f"conversation's {sum(len(_entry_keys(e)) for e in layers)} pages "
                    f"({len(missing)} did not fit); the previous save, if any, is still in force"
                )
            record = {
                "geometry": self.geometry(),
                "page_bytes": self.page_bytes,
                "serial": serial,
                "token_ids": ids[:seen],
                "layers": layers,
            }
            self.store.disk.write_record(MANIFEST, record)
        except BaseException:
            for key in written:  # named by no manifest
                if key in self.store.pages:
                    self.store.delete(key)
            raise
        for key in self._saved_keys - set(written):
            if key in self.store.pages:
                self.store.delete(key)
        self._save_serial, self._saved_keys = serial, set(written)
        # Later steps must not push this save's files out of a full disk (they would drop
        # them as copies first): the store keeps them, or raises TierFull.
        self.store.keep_on_disk = {key for entry in layers for key in _entry_keys(entry)}

    def _save_pages(self, serial: int, written: list[str]) -> list[dict[str, Any]]:
        """Copy every page to disk and write the tails and states of save ``serial`` (their
        keys appended to ``written`` as they are stored); the manifest's layer entries."""
        layers = []
        for index, layer in enumerate(self.layers):
            if type(layer) is DummyLayer:  # a layer without attention or state (an MLP)
                layers.append({})
                continue
            if not isinstance(layer, TieredLayer):  # its recurrent state, as one page
                state = f"L{index}.state.{serial}"
                if state in self.store.pages:  # left by a save that failed before its manifest
                    self.store.delete(state)
                states = _layer_states(layer)
                if states:
                    self.store.put(state, states, tier="disk")
                    written.append(state)
                layers.append(
                    {
                        "state": state if states else None,
                        "has_previous_state": [
                            bool(layer.has_previous_state[i]) for i in range(layer.number_of_states)
                        ],
                    }
                )
                continue
            for key in layer.page_keys:
                self.store.copy(key, "disk")
            tail = f"L{layer.layer_idx}.tail.{serial}"
            if tail in self.store.pages:  # left by a save that failed before its manifest
                self.store.delete(tail)
            if layer.is_initialized:
                self.store.put(tail, {"k": layer.tail_keys, "v": layer.tail_values}, tier="disk")
                written.append(tail)
            layers.append(
                {"pages": list(layer.page_keys), "tail": tail if layer.is_initialized else None}
            )
        return layers

    @staticmethod
    def saved_token_ids(disk_path: str | os.PathLike) -> torch.Tensor:
        """The token ids ([1, n]) whose K/V a saved conversation under ``disk_path`` holds: what
        a new process continues from (the conversation's last generated token, never fed back,
        is not among them)."""
        path = Path(disk_path)
        if not path.is_dir():
            raise InvalidArgumentError(f"disk_path={str(path)!r} is not a directory")
        record = DiskTier.read_record_at(path, MANIFEST)
        if record is None:
            raise InvalidArgumentError(f"disk_path={str(path)!r} holds no saved conversation")
        return torch.tensor([record["token_ids"]], dtype=torch.long)

    @classmethod
    def resume(
        cls,
        config: Any,
        *,
        disk_path: str | os.PathLike,
        token_ids: torch.Tensor | list[int],
        damaged: str = "raise",
        **kwargs: Any,
    ) -> TieredCache:
        """A cache holding a saved conversation's K/V, in a new process: ``generate`` with
        ``token_ids`` (the saved tokens and anything after them, e.g. the next user turn)
        computes only the new tokens. Pages the manifest does not name (a save that never
        finished) are deleted. ``kwargs``: the budgets and policy, as for the constructor.

        ``damaged``: what a missing or corrupt page costs.

        * ``"raise"``: pages stay on disk until read, and are checked then: a damaged one raises
          ``PageCorrupted`` in the step that reads it (a page whose file is missing raises it
          here).
        * ``"recompute"`` (lossless): every page is read and checked now; the cache keeps the
          longest prefix whose pages are whole in every layer and deletes the rest, with a
          warning (``resume_damage`` says why), and ``generate`` recomputes from there. A
          hybrid's recurrent state cannot be rewound to that prefix: there, damage is a miss.

        A resume reads the saved pages through the disk tier, so it needs one: ``disk_path``
        must be the directory of a saved conversation and ``disk_budget`` (in ``kwargs``) at
        least the bytes of its files; anything else is refused before the directory is touched.
        """
        if damaged not in ("raise", "recompute"):
            raise InvalidArgumentError(f"damaged={damaged!r}; expected 'raise' or 'recompute'")
        if not isinstance(disk_path, (str, os.PathLike)):
            raise InvalidArgumentError(
                f"disk_path={disk_path!r}; resume() reads a saved conversation through the disk "
                "tier: expected the directory TieredCache.save wrote it to"
            )
        if not Path(disk_path).is_dir():
            raise InvalidArgumentError(
                f"disk_path={str(disk_path)!r} holds no saved conversation (it is not a "
                "directory); expected the directory TieredCache.save wrote one to"
            )
        disk_budget = kwargs.get("disk_budget", 0)
        if parse_bytes("disk_budget", disk_budget) == 0:
            raise InvalidArgumentError(
                f"disk_budget={disk_budget!r}; resume() reads the saved pages through the disk "
                "tier, so it needs one: expected at least the bytes of the saved files"
            )
        if DiskTier.read_record_at(Path(disk_path), MANIFEST) is None:
            raise InvalidArgumentError(f"disk_path={str(disk_path)!r} holds no saved conversation")
        cache = cls(config, disk_path=disk_path, _resuming=True, **kwargs)
        disk = cache.store.disk
        record = disk.read_record(MANIFEST)
        if record is None:
            raise InvalidArgumentError(f"disk_path={str(disk_path)!r} holds no saved conversation")
        if record["geometry"] != cache.geometry():
            raise InvalidArgumentError(
                f"the conversation in {str(disk_path)!r} was saved for {record['geometry']}; "
                f"this config and block size give {cache.geometry()}"
            )
        saved, ids = record["token_ids"], _token_list(token_ids)
        if ids[: len(saved)] != saved:
            raise InvalidArgumentError(
                f"token_ids do not start with the {len(saved)} tokens saved in {str(disk_path)!r}; "
                "its K/V belong to those tokens only"
            )
        named = {key for entry in record["layers"] for key in _entry_keys(entry)}
        for key in disk.keys():
            if key not in named:
                disk.delete(key)
        # The recurrent states first: K/V without the state it was saved with would continue
        # from zeroed states, every token after silently wrong. A KV hit without its state is
        # a miss (LMCache's and SGLang's users hit exactly this).
        states: dict[int, dict[str, torch.Tensor]] = {}
        for index, (layer, entry) in enumerate(zip(cache.layers, record["layers"], strict=True)):
            if not isinstance(layer, LinearAttentionLayer) or (
                # Nothing saved, and nothing to restore: no tokens, or a layer that never held a
                # state (transformers before 5.2x gives NemotronH's MLP layers a state layer).
                entry["state"] is None and (not saved or not any(entry["has_previous_state"]))
            ):
                continue
            if entry["state"] is None:
                return cache._resume_missed(
                    named, len(saved), f"layer {index}'s state page: none was saved"
                )
            try:
                states[index] = disk.read(entry["state"])  # checksum-verified
            except (KeyError, PageCorrupted) as error:
                return cache._resume_missed(
                    named, len(saved), f"layer {index}'s state page {entry['state']!r}: {error}"
                )
        if damaged == "recompute":
            intact, reason = cache._intact_blocks(record)
            if reason is not None:
                if states:
                    return cache._resume_missed(named, len(saved), reason)
                for layer, entry in zip(cache.layers, record["layers"], strict=True):
                    if isinstance(layer, TieredLayer):
                        for key in [*entry["pages"][intact:], *filter(None, [entry["tail"]])]:
                            disk.delete(key)
                        entry["pages"], entry["tail"] = entry["pages"][:intact], None
                # The manifest now names only what is left: a later resume (or a process killed
                # before the next save) finds a whole, shorter conversation.
                record["token_ids"] = saved = saved[: intact * cache.block_size]
                disk.write_record(MANIFEST, record)
                cache.resume_damage = reason
                warnings.warn(
                    f"TieredCache.resume: {reason}; the K/V from token {intact * cache.block_size} "
                    "on are recomputed by generate",
                    stacklevel=2,
                )
        if damaged == "raise":  # a missing file is damage found now, not a bare KeyError
            for key in sorted(k for entry in record["layers"] for k in _entry_keys(entry)):
                if key not in disk:
                    raise PageCorrupted(
                        f"page {key!r} of the conversation saved in {str(disk_path)!r} has no "
                        "file; resume with damaged='recompute' to keep the prefix before it"
                    )
        dtype = getattr(torch, record["geometry"]["dtype"].removeprefix("torch."))
        empty_tail = torch.empty(1, cache.kv_heads, 0, cache.head_dim, dtype=dtype)  # [1, H, 0, D]
        for layer, entry in zip(cache.layers, record["layers"], strict=True):
            if not isinstance(layer, TieredLayer):
                continue
            if not entry["tail"] and entry["pages"]:  # saved at a block boundary
                layer.lazy_initialization(*[empty_tail.to(cache.device)] * 2)
            for index, key in enumerate(entry["pages"]):
                cache.store.adopt_disk_page(
                    key,
                    record["page_bytes"],
                    position=index * cache.block_size,
                    tokens=cache.block_size,
                )
                layer.page_keys.append(key)
            if entry["tail"]:
                tail = disk.read(entry["tail"])
                keys, values = tail["k"].to(cache.device), tail["v"].to(cache.device)
                layer.lazy_initialization(keys, values)
                layer.tail_keys, layer.tail_values = keys, values
                # Kept on disk, named in the store: resuming twice finds the save intact.
                cache.store.adopt_disk_page(entry["tail"], keys.nbytes + values.nbytes)
                cache._saved_keys.add(entry["tail"])
        for index, page in states.items():
            entry = record["layers"][index]
            _restore_states(cache.layers[index], page, entry["has_previous_state"], cache.device)
            cache.store.adopt_disk_page(entry["state"], page_nbytes(page))  # kept, as the tails
            cache._saved_keys.add(entry["state"])
        cache._save_serial = record.get("serial", 0)
        cache.store.keep_on_disk = {k for entry in record["layers"] for k in _entry_keys(entry)}
        if cache._recompute_model is not None and saved:
            cache._token_ids = torch.tensor([saved], dtype=torch.long)  # [1, n]
        cache.prefetch_after(-1)  # the first layer's pages, for the first step
        return cache

    def _intact_blocks(self, record: dict[str, Any]) -> tuple[int, str | None]:
        """Read and check every saved K/V page: (blocks whole in every attention layer, why not
        all of them are usable or None)."""
        disk = self.store.disk
        entries = [
            entry
            for layer, entry in zip(self.layers, record["layers"], strict=True)
            if isinstance(layer, TieredLayer)
        ]
        intact = min(len(entry["pages"]) for entry in entries)
        reason = None
        for entry in entries:
            for index, key in enumerate(entry["pages"][:intact]):
                try:
                    disk.read(key)
                except (KeyError, PageCorrupted) as error:
                    intact, reason = index, f"page {key!r} is damaged or missing ({error})"
                    break
        if reason is None:
            for entry in entries:
                try:
                    if entry["tail"]:
                        disk.read(entry["tail"])
                except (KeyError, PageCorrupted) as error:
                    reason = f"page {entry['tail']!r} is damaged or missing ({error})"
                    break
        return intact, reason

    def _resume_missed(self, named: set[str], tokens: int, reason: str) -> TieredCache:
        """A saved conversation that cannot be used whole: its files are deleted (K/V without
        their state are worth nothing) and this empty cache is returned, so ``generate`` with
        the same ids recomputes every token: a miss, never a wrong continuation."""
        disk = self.store.disk
        for key in named:
            disk.delete(key)
        disk.delete_record(MANIFEST)
        self.resume_miss = reason
        warnings.warn(
            f"TieredCache.resume: {reason}; the saved conversation ({tokens} tokens) is a miss: "
            "it was deleted and generate recomputes it",
            stacklevel=3,
        )
        return self

    def reset(self) -> None:
        """Forget every token, deleting its pages from every tier and the save in force, if
        any (a resumed conversation's too: resume it again from a copy of its directory if it
        must survive); pending fetches are drained first (page keys are reused)."""
        self.prefetcher.drain()
        pending = tiers_attention.pending()
        if pending.layer is not None and pending.layer.cache is self:  # a step cut short
            pending.clear()
        super().reset()
        self._token_ids = self._step_ids = None
        self._recomputed = {}
        self._prefill_shares = {}  # a prefill cut short leaves the scores of its first layers
        self.store.keep_on_disk = set()  # the save in force is deleted below
        for key in self._saved_keys:  # the saved tails and states
            if key in self.store.pages:
                self.store.delete(key)
        self._saved_keys = set()
        if self._save_serial and self.store.disk is not None:
            self.store.disk.delete_record(MANIFEST)  # it named the pages just deleted

    def close(self) -> None:
        self.prefetcher.close()
