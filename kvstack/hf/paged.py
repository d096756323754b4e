"""``PagedCache``: a Hugging Face ``Cache`` whose K/V live in block pools behind token tables.

One ``PagedLayer`` per attention layer holds a ``BlockPool`` ([num_blocks, block_size, H_kv, D])
and one ``TokenTable`` per batch row. ``update`` appends the step's K/V rows to the tables; with
the ``"kvstack"`` attention implementation it returns nothing to copy and the attention function
reads through the tables (``kvstack.hf.attention``); with any other implementation (eager, sdpa)
it gathers the rows back into the contiguous [B, H_kv, T, D] tensors transformers expects.

``PagedCache`` never evicts, so greedy ``generate`` gives exactly the tokens ``DynamicCache``
gives. Padding of left-padded batches is evicted at prefill by the kvstack attention function.
``get_seq_length()`` is the number of tokens *seen* (what transformers uses for positions).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
)

from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.hf import attention as kv_attention
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.checks import check_positive_int
from kvstack.reference.token_table import TokenTable

# The layer classes DynamicCache uses for plain (full or sliding) attention: the ones we page.
_ATTENTION_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer)


class PagedLayer(CacheLayerMixin):
    """One attention layer: a block pool and a token table per batch row."""

    is_compileable = False
    is_croppable = False

    def __init__(
        self, cache: PagedCache, layer_idx: int, block_size: int, window: int | None = None
    ) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.block_size = block_size
        # A sliding-window layer (Mistral, Gemma's local layers) attends to its last ``window``
        # positions; PagedCache keeps every token and the attention applies the window.
        self.window = window
        self.is_sliding = window is not None
        self.pool: BlockPool | None = None
        self.tables: list[TokenTable] = []

    def __repr__(self) -> str:
        return f"PagedLayer(layer_idx={self.layer_idx}, rows={len(self.tables)}, pool={self.pool})"

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, num_kv_heads, _, head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.pool = BlockPool(
            1,
            self.block_size,
            num_kv_heads,
            head_dim,
            dtype=key_states.dtype,
            device=key_states.device,
        )
        self.pool.free([self.pool.allocate(1)[0]])  # a valid empty pool; grown on demand
        self.tables = [TokenTable(self.block_size, device=key_states.device) for _ in range(batch)]
        self.is_initialized = True

    def _reserve(self, new_tokens: int) -> None:
        """Grow the pool (doubling) so that every row can append ``new_tokens`` tokens."""
        needed = sum(
            math.ceil(max(0, new_tokens - len(table.free_slots)) / self.block_size)
            for table in self.tables
        )
        if needed > self.pool.num_free_blocks:
            self.pool.grow(max(needed - self.pool.num_free_blocks, self.pool.num_blocks))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's K/V ([B, H_kv, T, D]); return what the attention function needs."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, _, new_tokens, _ = key_states.shape
        if batch != len(self.tables):
            raise InvalidArgumentError(
                f"key_states has batch {batch}, but layer {self.layer_idx} of this cache holds "
                f"{len(self.tables)} rows; use a fresh cache for a new batch"
            )
        self._reserve(new_tokens)
        for row, table in enumerate(self.tables):
            table.append(
                self.pool,
                key_states[row].transpose(0, 1),  # [T, H_kv, D]
                value_states[row].transpose(0, 1),
            )
        if self.cache.uses_kvstack_attention():
            kv_attention.STEP.layer, kv_attention.STEP.key = self, key_states
            return key_states, value_states
        return self.gather_contiguous()

    def gather_contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All rows' live K/V as [B, H_kv, T, D] (for eager/sdpa attention; needs equal lengths)."""
        rows = [self.pool.read(table.live_slots()) for table in self.tables]
        keys = torch.stack([k for k, _ in rows]).transpose(1, 2)  # [B, H_kv, T, D]
        values = torch.stack([v for _, v in rows]).transpose(1, 2)
        return keys, values

    # ------------------------------------------------------------------ what attention reads
    def attention_view(self):
        """(key_cache, value_cache, slots [B, T_k], positions [B, T_k]) with -1 padding."""
        slots = torch.nn.utils.rnn.pad_sequence(
            [table.live_slots() for table in self.tables], batch_first=True, padding_value=-1
        )
        # Causality is by logical index (arrival order), which is what transformers' masks use.
        positions = torch.nn.utils.rnn.pad_sequence(
            [table.live_indices() for table in self.tables], batch_first=True, padding_value=0
        )
        return self.pool.key, self.pool.value, slots, positions

    def query_positions(self, query_length: int) -> torch.Tensor:
        """Logical indices of the last ``query_length`` tokens of each row: [B, T_q]."""
        seen = self.tables[0].num_tokens
        start = seen - query_length
        return torch.arange(start, seen, device=self.device).expand(len(self.tables), query_length)

    def evict_padding(self, new_token_mask: torch.Tensor) -> None:
        """Evict this step's padding tokens (mask False) so attention never reads them."""
        if bool(new_token_mask.all()):
            return
        start = self.tables[0].num_tokens - new_token_mask.shape[1]
        for row, table in enumerate(self.tables):
            padding = (~new_token_mask[row].bool()).nonzero().flatten() + start
            if padding.numel():
                table.evict(padding.to(table.device))

    def wants_attention_weights(self) -> bool:
        return False

    def observe_attention(self, weights: torch.Tensor) -> None:
        """Attention weights of the step ([B, H_q, T_q, T_k]); used by eviction policies."""

    # ------------------------------------------------------------------ transformers API
    def get_seq_length(self) -> int:
        return self.tables[0].num_tokens if self.is_initialized and self.tables else 0

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple[int, int]:
        # transformers >= 5.2x passes an int query length; older 5.x a cache_position tensor.
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.is_initialized:
            for table in self.tables:
                table.release_all(self.pool)

    def _select_rows(self, rows: list[int]) -> None:
        """New row i is a copy of old row ``rows[i]`` (beam search, repeat, select)."""
        if not self.is_initialized:
            return
        old = self.tables
        taken: set[int] = set()
        new_tables = []
        for source in rows:
            if source not in taken:  # first use: take the table over, no copy
                taken.add(source)
                new_tables.append(old[source])
                continue
            table = old[source]
            self._reserve_for_copy(table.num_live)
            new_tables.append(table.fork(self.pool))
        for index, table in enumerate(old):
            if index not in taken:
                table.release_all(self.pool)
        self.tables = new_tables

    def _reserve_for_copy(self, tokens: int) -> None:
        needed = math.ceil(tokens / self.block_size)
        if needed > self.pool.num_free_blocks:
            self.pool.grow(max(needed - self.pool.num_free_blocks, self.pool.num_blocks))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self.tables)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    @property
    def batch_size(self) -> int:
        return len(self.tables)


class PagedCache(Cache):
    """Paged K/V storage for every attention layer of a decoder-only model; never evicts.

    >>> cache = PagedCache(model.config, block_size=16)
    >>> model.generate(ids, past_key_values=cache, max_new_tokens=32)
    """

    layer_class = PagedLayer

    def __init__(self, config: Any, *, block_size: int = 16, **layer_kwargs: Any) -> None:
        check_positive_int("block_size", block_size)
        if getattr(config, "is_encoder_decoder", False):
            raise KVStackError(
                f"config describes an encoder-decoder model ({config.model_type}); kvstack caches "
                "support decoder-only models"
            )
        self.config = config
        self.block_size = block_size
        # Start from the layers transformers itself would build, so hybrid models keep their
        # state layers (conv / recurrent, "linear_attention", "conv", ...) exactly as the model
        # expects, and replace each plain attention layer with a paged one.
        layers = []
        for index, layer in enumerate(DynamicCache(config=config).layers):
            if type(layer) in _ATTENTION_LAYER_TYPES:
                window = getattr(layer, "sliding_window", None)
                layer = self.layer_class(self, index, block_size, window, **layer_kwargs)
            layers.append(layer)
        super().__init__(layers=layers)

    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def uses_kvstack_attention(self) -> bool:
        return getattr(self.config, "_attn_implementation", None) == kv_attention.ATTENTION_NAME

    def stats(self) -> dict[str, float]:
        """Exact memory counts over all layers (blocks held by tables, not pool capacity)."""
        blocks = live = 0
        block_bytes = 0
        for layer in self.paged_layers:
            if not layer.is_initialized:
                continue
            pool = layer.pool
            block_bytes = (
                pool.block_size * pool.num_kv_heads * pool.head_dim * pool.key.element_size() * 2
            )
            blocks += sum(len(t.blocks) for t in layer.tables)
            live += sum(t.num_live for t in layer.tables)
        seen = max((layer.get_seq_length() for layer in self.paged_layers), default=0)
        capacity = blocks * self.block_size
        return {
            "blocks_allocated": blocks,
            "live_tokens": live,
            "seen_tokens": seen,
            "repacks": 0,
            "bytes": blocks * block_bytes,
            "waste": 1.0 - live / capacity if capacity else 0.0,
        }
