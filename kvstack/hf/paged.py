"""``PagedCache``: a Hugging Face ``Cache`` whose K/V live in block pools behind token tables.

One ``PagedLayer`` per attention layer holds a ``BlockPool`` ([num_blocks, block_size, H_kv, D])
and one token table per batch row, kept together as a ``TokenTableBatch`` (the vectorised twin of
N reference ``TokenTable``s, so a decode step costs a few tensor ops per layer, not per row). ``update`` appends the step's K/V rows to the tables; with
the ``"kvstack"`` attention implementation it returns nothing to copy and the attention function
reads through the tables (``kvstack.hf.attention``); with any other implementation (eager, sdpa)
it gathers the rows back into the contiguous [B, H_kv, T, D] tensors transformers expects.

``PagedCache`` never evicts, so greedy ``generate`` gives exactly the tokens ``DynamicCache``
gives. Padding of left-padded batches is evicted at prefill by the kvstack attention function.
``get_seq_length()`` is the number of tokens *seen* (what transformers uses for positions).
``stats()`` gives exact memory counts, each key in the unit :data:`STATS_UNITS` states.
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

from kvstack.arena import KVArena
from kvstack.compiled.token_tables import TokenTableBatch, grown_capacity
from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.hf import attention as kv_attention
from kvstack.hf import state_layers
from kvstack.reference.arena import ArenaBlockPool
from kvstack.reference.checks import check_positive_int
from kvstack.reference.token_table import TokenTable

PREFILL_HEADROOM = 64  # decode tokens per table a lossless cache reserves room for at prefill

# The layer classes DynamicCache uses for plain (full or sliding) attention: the ones we page.
_ATTENTION_LAYER_TYPES = (DynamicLayer, DynamicSlidingWindowLayer)

STATS_UNITS: dict[str, str] = {
    "blocks_allocated": "blocks held, summed over attention layers, rows and token tables (a "
    "per-head table's blocks hold one KV head each)",
    "bytes_reserved": "arena bytes this cache may use: the real bytes of its private arena, or, "
    "on a shared arena, the bytes it holds plus the arena's free bytes",
    "bytes_used": "arena bytes this cache's pages hold, both kinds",
    "bytes_used_kv": "arena bytes of this cache's attention KV blocks (K and V)",
    "bytes_used_state": "arena bytes of this cache's recurrent-state pages (hybrid models)",
    "peak_bytes_used": "the most arena bytes this cache's pages held at once",
    "peak_bytes_reserved": "the most real bytes its private arena held at once, both buffers "
    "counted while it grew or shrank (on a shared arena: its capacity)",
    "live_tokens_all_layers": "live token-equivalents, summed over attention layers and rows "
    "(a token of a per-head table counts 1 / KV heads)",
    "live_tokens_per_layer": "live token-equivalents per attention layer: the mean over "
    "attention layers, summed over rows",
    "seen_tokens_per_sequence": "tokens each row has seen, evicted ones included (Hugging "
    "Face's get_seq_length)",
    "repacks": "repacks run, summed over layers (0: PagedCache never evicts)",
    "waste": "1 - live / capacity over all blocks held (a fraction in [0, 1])",
}
"""Every key of :meth:`PagedCache.stats` and its unit; ``TokenTableCache`` adds its own."""


def stats_doc(summary: str, units: dict[str, str]) -> str:
    """A ``stats()`` docstring: ``summary``, then one line per key and its unit."""
    return f"{summary}, one number per key:\n\n" + "\n".join(
        f"* ``{key}``: {unit}." for key, unit in units.items()
    )


class PagedLayer(CacheLayerMixin):
    """One attention layer: a block pool and a token table per batch row."""

    is_compileable = False
    is_croppable = False
    # Whether the layer can only run under the "kvstack" attention (a layer that evicts).
    needs_kvstack_attention = False

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
        self.pool: ArenaBlockPool | None = None
        self.batch: TokenTableBatch | None = None  # the layer's token tables, vectorised

    def __repr__(self) -> str:
        return f"PagedLayer(layer_idx={self.layer_idx}, rows={self.batch_size}, pool={self.pool})"

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, num_kv_heads, _, head_dim = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        # One table per row holding all KV heads, or (per-head eviction) one table per row and
        # KV head: each head then keeps its own tokens. Tables are row-major: row * groups + g.
        self.heads_per_table = 1 if self.per_head_tables() else num_kv_heads
        self.groups = num_kv_heads // self.heads_per_table
        arena = self.cache.arena_for(key_states.dtype, key_states.device)  # raises on mismatch
        self.pool = ArenaBlockPool(arena, self.block_size, self.heads_per_table, head_dim)
        self.pool.account = self.cache.account
        self.pool.listeners.append(self._blocks_renamed)
        self.batch = TokenTableBatch(batch * self.groups, self.block_size, device=self.device)
        self._arange = torch.arange(0, device=self.device)  # 0, 1, 2, ...: query positions
        self.is_initialized = True

    def per_head_tables(self) -> bool:
        return self.cache.per_head_tables()

    @property
    def tables(self) -> list[TokenTable]:
        """The layer's token tables as reference ``TokenTable`` copies (for inspection)."""
        return self.batch.tables() if self.is_initialized else []

    def _blocks_renamed(self, renamed: dict[int, int]) -> None:
        """The arena compacted and moved some of this layer's blocks: follow them."""
        self.batch.rename_blocks(renamed)

    def _reserve(self, new_tokens: int) -> None:
        """Make room in the arena for every table to append ``new_tokens`` tokens (compacting or
        growing it), or raise ``ArenaExhausted`` with nothing changed."""
        needed = self.batch.blocks_needed(new_tokens)
        if needed:
            self.pool.reserve(needed)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's K/V ([B, H_kv, T, D]); return what the attention function needs."""
        kvstack_attention = self.cache.uses_kvstack_attention()  # one config read per layer step
        if self.needs_kvstack_attention and not kvstack_attention:
            raise KVStackError(
                f"{type(self.cache).__name__} evicts tokens, which needs the kvstack attention "
                f"implementation (the model uses {self.cache.config._attn_implementation!r}); call "
                "model.set_attn_implementation('kvstack') after `import kvstack.hf`, or load with "
                "from_pretrained(..., attn_implementation='kvstack')"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.device != self.device or value_states.device != self.device:
            raise KVStackError(
                f"layer {self.layer_idx} got K/V on {key_states.device} and "
                f"{value_states.device}, but its pool is on {self.device}; a cache stays on the "
                "device of its first step (use a fresh cache after moving the model)"
            )
        batch, _, new_tokens, head_dim = key_states.shape
        if batch != self.batch_size:
            raise InvalidArgumentError(
                f"key_states has batch {batch}, but layer {self.layer_idx} of this cache holds "
                f"{self.batch_size} rows; use a fresh cache for a new batch"
            )
        self.store(key_states, value_states)
        if kvstack_attention:
            kv_attention.STEP.layer, kv_attention.STEP.key = self, key_states
            return key_states, value_states
        return self.gather_contiguous()

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append the step's K/V ([B, H_kv, T, D]) to every table."""
        self.reserve_first_step(key_states.shape[2])
        self.append(key_states, value_states)

    def reserve_first_step(self, new_tokens: int) -> None:
        """On the cache's very first step, let its arena reserve what the whole cache will hold
        (a private arena then grows once instead of once per layer)."""
        if self.batch.num_tokens == 0 and self.layer_idx == self.cache.first_paged_layer:
            self.cache.reserve_for_prompt(self.batch.num_tables, new_tokens, self.pool.block_bytes)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append K/V [B, H_kv, T, D] to the tables: room first (all or nothing), then rows."""
        batch, _, new_tokens, head_dim = key_states.shape
        self._reserve(new_tokens)
        # [B, H_kv, T, D] -> [B * groups, T, heads_per_table, D]: one slab per table.
        shape = (batch * self.groups, self.heads_per_table, new_tokens, head_dim)
        self.batch.append(
            self.pool,
            key_states.reshape(shape).transpose(1, 2),
            value_states.reshape(shape).transpose(1, 2),
            check=False,  # our pool; shapes from PagedCache.update's checked key_states
        )

    def gather_contiguous(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All rows' live K/V as [B, H_kv, T, D] (for eager/sdpa attention; needs one table per
        row and equal lengths)."""
        _, slots = self.batch.live_view()  # [B, T]
        keys, values = self.pool.read(slots.flatten())  # [B * T, H_kv, D]
        shape = (*slots.shape, self.pool.num_kv_heads, self.pool.head_dim)
        return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)

    # ------------------------------------------------------------------ what attention reads
    def attention_view(self):
        """(key_cache, value_cache, slots [N, T_k], positions [N, T_k]) with -1 slot padding,
        where N = B * groups is the number of tables. Remembers the view's logical indices
        (``view_indices`` [N, T_k]) for the policy, which observes weights over these columns,
        and whether the view has no padding (``view_is_dense``)."""
        indices, slots = self.batch.live_view()
        self.view_indices = indices
        # Tables with equal live counts give a view without -1 padding (``live_view``).
        self.view_is_dense = min(self.batch.num_live) == max(self.batch.num_live)
        # Causality is by logical index (arrival order), which is what transformers' masks use.
        return self.pool.key, self.pool.value, slots, indices

    def split_query(self, query: torch.Tensor) -> torch.Tensor:
        """[B, T_q, H_q, D] -> [B * groups, T_q, H_q / groups, D]: each table's query heads."""
        batch, t_q, h_q, head_dim = query.shape
        if self.groups == 1:
            return query
        grouped = query.reshape(batch, t_q, self.groups, h_q // self.groups, head_dim)
        return grouped.transpose(1, 2).reshape(
            batch * self.groups, t_q, h_q // self.groups, head_dim
        )

    def merge_output(self, out: torch.Tensor) -> torch.Tensor:
        """Inverse of ``split_query``: [B * groups, T_q, H', D] -> [B, T_q, groups * H', D]."""
        if self.groups == 1:
            return out
        tables, t_q, heads, head_dim = out.shape
        grouped = out.reshape(tables // self.groups, self.groups, t_q, heads, head_dim)
        return grouped.transpose(1, 2).reshape(
            tables // self.groups, t_q, self.groups * heads, head_dim
        )

    def query_positions(self, query_length: int) -> torch.Tensor:
        """Logical indices of the last ``query_length`` tokens of each table: [N, T_q]."""
        seen = self.batch.num_tokens
        if self._arange.shape[0] < seen:  # grown ahead: a decode step slices, not allocates
            self._arange = torch.arange(
                grown_capacity(seen, self._arange.shape[0]), device=self.device
            )
        return self._arange[seen - query_length : seen].expand(self.batch.num_tables, query_length)

    def evict_padding(self, new_token_mask: torch.Tensor) -> None:
        """Evict this step's padding tokens (mask [B, T_q] False) so attention never reads them."""
        if bool(new_token_mask.all()):
            return
        padding = ~new_token_mask.bool().to(self.device).repeat_interleave(self.groups, dim=0)
        victims = torch.zeros_like(self.batch.alive)  # [N, T]
        victims[:, self.batch.num_tokens - padding.shape[1] :] = padding
        self.batch.evict(victims & self.batch.alive)

    def wants_attention_weights(self) -> bool:
        return False

    def ragged_plan(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(members [G, H_p], work [W, 3]) when this layer's decode steps run the ragged decode
        attention (``kvstack.reference.ragged``) from a static work list; None: the paged one."""
        return None

    def observed_queries(self, query_length: int) -> int:
        """How many of this step's last queries need attention weights (``observe_attention``);
        the first ``query_length`` minus that many are announced to ``skip_queries``."""
        return 0

    def skip_queries(self, count: int) -> None:
        """The step's first ``count`` queries, whose weights are not computed."""

    def holds_only_new_tokens(self, query_length: int) -> bool:
        """Whether every table holds exactly this step's ``query_length`` tokens, all live: a
        first prefill without padding, whose K/V are the ones the attention call was handed."""
        batch = self.batch
        return batch.num_tokens == query_length and min(batch.num_live) == query_length

    def pending_prefill(self, attention_mask: torch.Tensor | None) -> list[tuple[int, int]] | None:
        """The (start, end) chunks of a prefill whose K/V ``store`` kept back, or None when
        this step's K/V are in the tables already (PagedCache appends everything at once)."""
        return None

    def observe_attention(self, weights: torch.Tensor) -> None:
        """Called with the attention weights of each chunk of the step's queries ([N, H', T_c,
        W] over the view's first W columns) when ``wants_attention_weights``."""

    def after_attention(self) -> None:
        """Called once after each step's attention; PagedCache keeps everything."""

    # ------------------------------------------------------------------ transformers API
    def get_seq_length(self) -> int:
        return self.batch.num_tokens if self.is_initialized else 0

    def get_mask_sizes(self, query_length: Any, *args: Any) -> tuple[int, int]:
        # transformers >= 5.2x passes an int query length; older 5.x a cache_position tensor.
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Forget every token and return the layer's blocks to the arena."""
        if self.is_initialized:
            self.batch.release_all(self.pool)

    def release(self) -> None:
        self.reset()

    def _select_rows(self, rows: list[int]) -> None:
        """New row i is a copy of old row ``rows[i]`` (beam search, repeat, select)."""
        if not self.is_initialized:
            return
        old = self.batch.tables()
        taken: set[int] = set()
        new_tables = []
        for source in (row * self.groups + g for row in rows for g in range(self.groups)):
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
        self.batch = TokenTableBatch.from_tables(new_tables, self.block_size, device=self.device)

    def _reserve_for_copy(self, tokens: int) -> None:
        self.pool.reserve(math.ceil(tokens / self.block_size))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(self.batch_size) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    @property
    def batch_size(self) -> int:
        return self.batch.num_tables // self.groups if self.is_initialized else 0


class PagedCache(Cache):
    """Paged K/V storage for every attention layer of a decoder-only model; never evicts.

    >>> cache = PagedCache(model.config, block_size=16)
    >>> model.generate(ids, past_key_values=cache, max_new_tokens=32)
    """

    STATS_UNITS = STATS_UNITS  # stats() key -> its unit

    layer_class = PagedLayer

    def __init__(
        self,
        config: Any,
        *,
        block_size: int = 16,
        arena: KVArena | None = None,
        **layer_kwargs: Any,
    ) -> None:
        check_positive_int("block_size", block_size)
        if arena is not None and not isinstance(arena, KVArena):
            raise InvalidArgumentError(
                f"arena must be a kvstack.arena.KVArena or None, got {type(arena).__name__}"
            )
        if getattr(config, "is_encoder_decoder", False):
            raise KVStackError(
                f"config describes an encoder-decoder model ({config.model_type}); kvstack caches "
                "support decoder-only models"
            )
        self.config = config
        self.block_size = block_size
        text_config = config.get_text_config(decoder=True)
        self.expected_kv_heads = getattr(text_config, "num_key_value_heads", None) or getattr(
            text_config, "num_attention_heads", None
        )
        self.expected_head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self._check_arena(arena, text_config)
        self.arena = arena  # None until the first step builds a private one
        self.private_arena = arena is None or arena.growable  # growable: real bytes are its own
        self._bytes_used = dict.fromkeys(("kv", "state"), 0)
        self._peak_bytes_used = 0
        # Start from the layers transformers itself would build, so hybrid models keep their
        # state layers (conv / recurrent, "linear_attention", "conv", ...) with the semantics the
        # model expects, their states moved into arena pages; each plain attention layer is paged.
        layers = []
        for index, layer in enumerate(DynamicCache(config=config).layers):
            if type(layer) in _ATTENTION_LAYER_TYPES:
                window = getattr(layer, "sliding_window", None)
                layer = self.layer_class(self, index, block_size, window, **layer_kwargs)
            elif state_layers.is_state_layer(layer):
                layer = state_layers.arena_state_layer(self, index, layer)
            layers.append(layer)
        super().__init__(layers=layers)
        self.first_paged_layer = next(
            (layer.layer_idx for layer in layers if isinstance(layer, PagedLayer)), -1
        )

    def per_head_tables(self) -> bool:
        """Whether each row keeps one token table per KV head (per-head eviction)."""
        return False

    def blocks_to_reserve(self, tables: int, prompt_tokens: int) -> int:
        """Blocks the whole cache expects to hold after a prompt of ``prompt_tokens`` in
        ``tables`` tables per layer: every token, plus ``PREFILL_HEADROOM`` decode tokens."""
        per_table = math.ceil((prompt_tokens + PREFILL_HEADROOM) / self.block_size)
        return len(self.paged_layers) * tables * per_table

    def reserve_for_prompt(self, tables: int, prompt_tokens: int, block_bytes: int) -> None:
        """Reserve (private arenas) what ``blocks_to_reserve`` expects; shared arenas ignore it."""
        if self.arena is not None:
            blocks = self.blocks_to_reserve(tables, prompt_tokens)
            self.arena.reserve(self, blocks * block_bytes)

    # ------------------------------------------------------------------ the arena
    def min_page_bytes(self, itemsize: int) -> int:
        """Bytes of the smallest KV block this cache can take (one KV head per table when the
        cache keeps per-head tables)."""
        heads = 1 if self.per_head_tables() else self.expected_kv_heads
        return self.block_size * heads * self.expected_head_dim * 2 * itemsize

    def _check_arena(self, arena: KVArena | None, text_config: Any) -> None:
        """Refuse an arena this model cannot use, before anything is built."""
        if arena is None:
            return
        dtype = getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
        if isinstance(dtype, torch.dtype) and dtype != arena.dtype:
            raise InvalidArgumentError(
                f"arena holds {arena.dtype}, but config describes a {dtype} model; build the "
                f"arena with dtype={dtype} (one arena serves one dtype)"
            )
        page = self.min_page_bytes(arena.itemsize)
        if not arena.growable and arena.capacity_bytes < page:
            raise InvalidArgumentError(
                f"arena capacity is {arena.capacity_bytes} bytes, smaller than one KV block of "
                f"this model ({page} bytes: block_size {self.block_size} x head_dim "
                f"{self.expected_head_dim} x K and V); give the arena at least {page} bytes"
            )

    def arena_for(self, dtype: torch.dtype, device: torch.device) -> KVArena:
        """The arena this cache's pages come from (built on the first step when private); raises
        if K/V of ``dtype`` on ``device`` cannot live in it."""
        if self.arena is None:
            self.arena = KVArena.private(device=device, dtype=dtype)
        if self.arena.dtype != dtype or self.arena.device != torch.device(device):
            raise InvalidArgumentError(
                f"the model runs in {dtype} on {device}, but this cache's arena holds "
                f"{self.arena.dtype} on {self.arena.device}; build the arena with the model's "
                "dtype and device"
            )
        return self.arena

    def account(self, kind: str, delta_bytes: int) -> None:
        """Pages of ``kind`` this cache holds grew (or shrank) by ``delta_bytes``."""
        self._bytes_used[kind] += delta_bytes
        self._peak_bytes_used = max(self._peak_bytes_used, sum(self._bytes_used.values()))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ):
        # A cache serves the model it was built for; say so instead of failing somewhere deeper.
        if layer_idx >= len(self.layers):
            raise KVStackError(
                f"layer_idx {layer_idx} is out of range: this {type(self).__name__} was built for a "
                f"model with {len(self.layers)} layers ({self.config.model_type}); build a cache "
                "from the config of the model you generate with"
            )
        heads, head_dim = key_states.shape[1], key_states.shape[-1]
        if (heads, head_dim) != (self.expected_kv_heads, self.expected_head_dim):
            raise KVStackError(
                f"layer {layer_idx} got key_states with {heads} KV heads of dim {head_dim}, but this "
                f"{type(self).__name__} was built for a model with {self.expected_kv_heads} KV heads "
                f"of dim {self.expected_head_dim}; build a cache from the config of the model you "
                "generate with"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def release(self) -> None:
        """Return every page this cache holds (KV blocks and state pages) to its arena; the cache
        is empty afterwards and can be used again. A cache on a shared arena should be released
        when its request is done: the arena's pages refer to it, so dropping it frees nothing."""
        for layer in self.layers:
            release = getattr(layer, "release", None)
            if release is not None:
                release()
        if self.arena is not None:
            self.arena.reserve(self, 0)
            self.arena.trim()

    @property
    def paged_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def uses_kvstack_attention(self) -> bool:
        return getattr(self.config, "_attn_implementation", None) == kv_attention.ATTENTION_NAME

    def stats(self) -> dict[str, float]:
        blocks = live_entries = capacity = 0
        live_tokens = 0.0
        for layer in self.paged_layers:
            if not layer.is_initialized:
                continue
            layer_blocks = sum(len(blocks) for blocks in layer.batch.blocks)
            layer_live = sum(layer.batch.num_live)
            blocks += layer_blocks
            capacity += layer_blocks * self.block_size
            live_entries += layer_live
            live_tokens += layer_live / layer.groups  # per-head tables: token-equivalents
        attention_layers = len(self.paged_layers)
        used = sum(self._bytes_used.values())
        arena = self.arena
        if arena is None:
            reserved = peak_reserved = 0
        elif self.private_arena:
            reserved, peak_reserved = arena.capacity_bytes, arena.peak_reserved * arena.itemsize
        else:
            reserved, peak_reserved = used + arena.bytes_free, arena.capacity_bytes
        return {
            "blocks_allocated": blocks,
            "bytes_reserved": reserved,
            "bytes_used": used,
            "bytes_used_kv": self._bytes_used["kv"],
            "bytes_used_state": self._bytes_used["state"],
            "peak_bytes_used": self._peak_bytes_used,
            "peak_bytes_reserved": peak_reserved,
            "live_tokens_all_layers": live_tokens,
            "live_tokens_per_layer": live_tokens / attention_layers if attention_layers else 0.0,
            "seen_tokens_per_sequence": max(
                (layer.get_seq_length() for layer in self.paged_layers), default=0
            ),
            "repacks": 0,
            "waste": 1.0 - live_entries / capacity if capacity else 0.0,
        }

    stats.__doc__ = stats_doc(
        "Exact memory counts: blocks and tokens over all paged layers, real arena bytes",
        STATS_UNITS,
    )
