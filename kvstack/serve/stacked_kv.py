"""``StackedKV``: a lossless request's K/V for every attention layer in one block table.

``PagedCache`` keeps a token table per layer, which eviction needs (each layer keeps its own
tokens). A lossless cache's layers all hold the same tokens, so the engine keeps them the way
vLLM and nano-vllm do: one block table per request for all layers. A *page* is
``block_size`` tokens of every attention layer side by side: L arena blocks of the layer
geometry in one run (L = attention layers), so the block of layer l in a page starting at block
b is b + l, and

    slot of token t in layer l = (first_block[t // block_size] + l) * block_size + t % block_size

(``base_slots(t) + l * block_size``). A step's slots are then computed once for all layers
(``StepContext`` in ``kvstack.serve.attention``), and each layer stores the step's K/V of every
request with one scatter and reads them through one table per request.

The pages come from the engine's arena as "kv" pages, so they count against its budget exactly
as ``PagedCache``'s blocks do (the same bytes: L blocks per ``block_size`` tokens), and the
arena may move them when it compacts (``pages_moved``). ``release`` returns them.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.reference.arena import ArenaBlockPool, Page


class StackedKV:
    """One request's lossless K/V: ``tokens`` stored so far, in pages of every layer."""

    def __init__(
        self,
        arena: KVArena,
        *,
        layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> None:
        self.arena = arena
        self.layers = layers
        self.block_size = block_size
        # A view of the arena as blocks of one layer's geometry (it holds no pages itself):
        # the key and value caches every layer's attention reads.
        self.view = ArenaBlockPool(arena, block_size, num_kv_heads, head_dim)
        self.block_elements = self.view.block_elements
        self.block_bytes = self.view.block_bytes  # one layer's block: K and V
        self.pages: list[Page] = []  # in token order: page i holds tokens [i * bs, (i + 1) * bs)
        self.tokens = 0
        self._first_blocks = torch.zeros(0, dtype=torch.int64, device=arena.device)
        self._peak_bytes = 0

    def __repr__(self) -> str:
        return f"StackedKV(tokens={self.tokens}, pages={len(self.pages)}, layers={self.layers})"

    # ------------------------------------------------------------------ memory
    @property
    def page_bytes(self) -> int:
        return self.layers * self.block_bytes

    def pages_needed(self, new_tokens: int) -> int:
        """Pages to add before ``new_tokens`` more tokens fit."""
        return max(0, -(-(self.tokens + new_tokens) // self.block_size) - len(self.pages))

    def blocks_needed(self, new_tokens: int) -> int:
        """Layer blocks (``block_bytes`` each) to add before ``new_tokens`` more tokens fit."""
        return self.pages_needed(new_tokens) * self.layers

    def reserve(self, new_tokens: int) -> None:
        """Take the pages ``new_tokens`` more tokens need, all or none (``ArenaExhausted``)."""
        count = self.pages_needed(new_tokens)
        if not count:
            return
        pages = self.arena.allocate(
            self, "kv", self.layers * self.block_elements, count, align=self.block_elements
        )
        self.pages.extend(pages)
        self._rebuild_table()
        self._peak_bytes = max(self._peak_bytes, self.bytes_used)

    def pages_moved(self, moves: dict[Page, int]) -> None:
        """The arena compacted (its owners' callback): page objects keep their new offsets, so
        the block table is rebuilt from them."""
        if self.pages:
            self._rebuild_table()

    def _rebuild_table(self) -> None:
        """[pages] int64: the first arena block of each page, from the pages' offsets."""
        self._first_blocks = torch.tensor(
            [page.offset // self.block_elements for page in self.pages], device=self.arena.device
        )

    def release(self) -> None:
        """Return every page to the arena; the store is empty afterwards."""
        if self.pages:
            self.arena.free(self.pages)
        self.pages = []
        self.tokens = 0
        self._first_blocks = self._first_blocks[:0]

    @property
    def bytes_used(self) -> int:
        return len(self.pages) * self.page_bytes

    def stats(self) -> dict[str, float]:
        """The counts the engine reads (``PagedCache.stats``'s keys of the same names)."""
        return {
            "blocks_allocated": len(self.pages) * self.layers,
            "bytes_used": self.bytes_used,
            "bytes_used_kv": self.bytes_used,
            "bytes_used_state": 0,
            "peak_bytes_used": self._peak_bytes,
        }

    # ------------------------------------------------------------------ slots
    def base_slots(self, start: int, end: int) -> torch.Tensor:
        """Layer 0's slots of tokens [start, end): [end - start] int64 (layer l adds
        l * block_size). The pages must be there (``reserve``)."""
        if not 0 <= start <= end <= len(self.pages) * self.block_size:
            raise InvalidArgumentError(
                f"tokens [{start}, {end}) are not all in this request's "
                f"{len(self.pages)} pages of {self.block_size} tokens"
            )
        positions = torch.arange(start, end, device=self.arena.device)
        return (
            self._first_blocks[positions // self.block_size] * self.block_size
            + positions % self.block_size
        )

    def key_value(self) -> tuple[Any, Any]:
        """The arena as [num_blocks, block_size, H_kv, D] keys and values (every layer's)."""
        return self.view.key, self.view.value
