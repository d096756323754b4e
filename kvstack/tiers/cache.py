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

Device memory is the device tier's budget, the layers' tails, and the pages of the layer being
computed and the one being fetched (transient copies, freed after use); ``stats()`` reports
each. This is the layer-wise streaming of offloading systems; attention over resident and
fetched segments merged by log-sum-exp, without gathering, is the next step.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import CacheLayerMixin, DynamicLayer

from kvstack.arena import parse_bytes
from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.tiers.eviction import RULES, EvictionRule
from kvstack.tiers.prefetch import Prefetcher
from kvstack.tiers.store import TieredStore


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
        self.device = key_states.device
        self.tail_keys = key_states[..., :0, :]
        self.tail_values = value_states[..., :0, :]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        block = self.cache.block_size
        keys = torch.cat([self.tail_keys, key_states], dim=-2)  # [B, H, tail + T, D]
        values = torch.cat([self.tail_values, value_states], dim=-2)
        full = keys.shape[-2] // block
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
        # The tail is copied out so it does not keep this step's whole K/V alive.
        self.tail_keys = keys[..., full * block :, :].clone()
        self.tail_values = values[..., full * block :, :].clone()
        pages = [self.cache.prefetcher.take(key) for key in self.page_keys]
        self.cache.note_transient(pages)
        self.cache.prefetch_after(self.layer_idx)
        all_keys = torch.cat([p["k"] for p in pages] + [self.tail_keys], dim=-2)  # [B, H, seen, D]
        all_values = torch.cat([p["v"] for p in pages] + [self.tail_values], dim=-2)
        return all_keys, all_values

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
    ``"4MiB"``); ``policy`` is ``"lru"``, ``"attention"``, ``"cost"`` or an eviction rule object.
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
        block_size: int = 16,
        device: str | torch.device = "cpu",
        prefetch_workers: int = 1,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise InvalidArgumentError(f"block_size={block_size!r}; expected a positive int")
        if isinstance(policy, str):
            if policy not in RULES:
                raise InvalidArgumentError(f"policy={policy!r}; expected one of {sorted(RULES)}")
            policy = RULES[policy]()
        text_config = config.get_text_config(decoder=True)
        kv_heads = (
            getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        )
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        dtype = getattr(text_config, "dtype", None) or torch.float32
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
        self.block_size = block_size
        self.page_bytes = 2 * block_size * kv_heads * head_dim * itemsize  # one row's K and V
        budgets = {
            name: parse_bytes(name, value)
            for name, value in (
                ("device_budget", device_budget),
                ("host_budget", host_budget),
                ("disk_budget", disk_budget),
            )
        }
        for name, budget in budgets.items():
            if 0 < budget < self.page_bytes:
                raise InvalidArgumentError(
                    f"{name}={budget} cannot hold one page of {self.page_bytes} bytes (K and V "
                    f"of {block_size} tokens); expected 0 (tier off) or at least {self.page_bytes}"
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
        )
        self.prefetcher = Prefetcher(self.store, device, workers=prefetch_workers)
        layers: list[CacheLayerMixin] = []
        for index, layer in enumerate(DynamicCache(config=config).layers):
            if type(layer) is not DynamicLayer:
                raise KVStackError(
                    f"layer {index} is a {type(layer).__name__}; TieredCache supports models "
                    "whose layers are all full attention (no sliding window, no state layers)"
                )
            layers.append(TieredLayer(self, index))
        super().__init__(layers=layers)
        self.peak_transient_bytes = 0

    def prefetch_after(self, layer_idx: int) -> None:
        """Fetch the next layer's pages (after the last layer: the first, for the next step)."""
        following = self.layers[(layer_idx + 1) % len(self.layers)]
        self.prefetcher.prefetch(list(following.page_keys))

    def note_transient(self, pages: list[dict[str, torch.Tensor]]) -> None:
        fetched = sum(t.numel() * t.element_size() for p in pages for t in p.values())
        self.peak_transient_bytes = max(self.peak_transient_bytes, fetched)

    def stats(self) -> dict[str, Any]:
        store = self.store.stats()
        tails = sum(
            t.numel() * t.element_size()
            for layer in self.layers
            if layer.is_initialized
            for t in (layer.tail_keys, layer.tail_values)
        )
        return {
            **store,
            "seen_tokens": self.layers[0].get_seq_length(),
            "tail_bytes": tails,
            "peak_layer_bytes": self.peak_transient_bytes,
            "fetched_bytes": dict(self.prefetcher.bytes_fetched),
            "transfer_seconds": self.prefetcher.transfer_seconds,
            "stall_seconds": self.prefetcher.stall_seconds,
            "overlap_fraction": self.prefetcher.overlap_fraction,
        }

    def reset(self) -> None:
        """Forget every token: pending fetches are drained first (page keys are reused)."""
        self.prefetcher.drain()
        super().reset()

    def close(self) -> None:
        self.prefetcher.close()
