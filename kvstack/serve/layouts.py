"""How an engine's arena is divided between attention KV and hybrid models' recurrent states.

The three layouts of ``kvstack.reference.arena_layouts`` (its docstring cites the systems),
applied to real requests of a real model:

  ``kvstack``         one budget: KV blocks of the cache spec's size and exact state pages take
                      whatever the arena has free.
  ``padded_unified``  vLLM: attention blocks enlarged to ``vllm_attention_block_size`` tokens
                      (the caches are built with that block size) and every state page padded
                      up to one attention-layer block, P bytes (``vllm_page_bytes``).
  ``fixed_dual``      SGLang: the capacity split once, by ``--mamba-full-memory-ratio``
                      (``sglang_pool_split``), into a state pool and a token-granular KV pool
                      (the caches are built with 1-token blocks); neither pool lends to the
                      other.

The engine's caches always live in the one ``KVArena``; a layout says what a request is charged
and whether a charge fits. ``kvstack`` charges the arena's own bytes (its free space, after
fragmentation). The other two charge by their rules on top of what the caches hold: the state
padding ``padded_unified`` would hold, and for ``fixed_dual`` each kind against its own pool.
Their block sizes are real (the caches use them), so partly filled blocks are real bytes.

Sizes of the state pages come from the model's config (``geometry_from_config``, in the model's
dtype: what transformers' cache holds, a conv window of ``conv_kernel`` inputs); the engine checks
them against the first request's pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.reference import arena_layouts

LAYOUTS = arena_layouts.LAYOUTS  # ("padded_unified", "fixed_dual", "kvstack")


@dataclass(frozen=True)
class Need:
    """Arena bytes of the two kinds: attention KV blocks and recurrent-state pages."""

    kv: int = 0
    state: int = 0

    def __add__(self, other: Need) -> Need:
        return Need(self.kv + other.kv, self.state + other.state)

    @property
    def total(self) -> int:
        return self.kv + self.state


class KVStackLayout:
    """One budget for both kinds: a charge fits when the arena's free bytes hold it."""

    name = "kvstack"

    def __init__(self, arena: KVArena, block_size: int) -> None:
        self.arena = arena
        self.block_size = block_size

    def charged(self, need: Need) -> int:
        """The bytes a layout takes for ``need`` (what ``submit``'s error reports)."""
        return need.total

    def fits(self, need: Need, held: Need) -> bool:
        """Whether ``need`` more bytes fit beside what running requests hold (``held``)."""
        return need.total <= self.arena.bytes_free

    def could_ever_fit(self, need: Need) -> bool:
        return need.total <= self.arena.capacity_bytes


class PaddedUnifiedLayout(KVStackLayout):
    """vLLM's unified pool: enlarged attention blocks, state pages padded to one block (P)."""

    name = "padded_unified"

    def __init__(self, arena: KVArena, geometry: arena_layouts.HybridGeometry) -> None:
        super().__init__(arena, arena_layouts.vllm_attention_block_size(geometry))
        self.state_page_bytes = geometry.state_page_bytes  # conv + recurrent of one layer
        self.padded_page_bytes = arena_layouts.vllm_page_bytes(geometry)  # P

    def _padding(self, state_bytes: int) -> int:
        """Bytes the padding of ``state_bytes`` of exact state pages adds."""
        pages = -(-state_bytes // self.state_page_bytes)
        return pages * self.padded_page_bytes - state_bytes

    def charged(self, need: Need) -> int:
        return need.total + self._padding(need.state)

    def fits(self, need: Need, held: Need) -> bool:
        free = self.arena.bytes_free - self._padding(held.state)
        return self.charged(need) <= free

    def could_ever_fit(self, need: Need) -> bool:
        return self.charged(need) <= self.arena.capacity_bytes


class FixedDualLayout(KVStackLayout):
    """SGLang's two pools, split once: each kind must fit its own pool."""

    name = "fixed_dual"

    def __init__(self, arena: KVArena, geometry: arena_layouts.HybridGeometry) -> None:
        super().__init__(arena, arena_layouts.SGLANG_PAGE_SIZE)
        split = arena_layouts.sglang_pool_split(arena.capacity_bytes, geometry)
        self.state_pool_bytes = split.state_pool_bytes
        self.kv_pool_bytes = split.kv_pool_bytes

    def fits(self, need: Need, held: Need) -> bool:
        return (
            held.state + need.state <= self.state_pool_bytes
            and held.kv + need.kv <= self.kv_pool_bytes
            and need.total <= self.arena.bytes_free
        )

    def could_ever_fit(self, need: Need) -> bool:
        return need.state <= self.state_pool_bytes and need.kv <= self.kv_pool_bytes


def hybrid_geometry(config: Any, itemsize: int) -> arena_layouts.HybridGeometry:
    """The state and KV page sizes of a hybrid model's cache, as transformers holds them: every
    tensor in the model's dtype (``itemsize`` bytes), a conv window of ``conv_kernel``."""
    text = config.get_text_config(decoder=True)
    return arena_layouts.geometry_from_config(
        text,
        name=getattr(text, "model_type", "model"),
        kv_dtype_bytes=itemsize,
        conv_dtype_bytes=itemsize,
        recurrent_dtype_bytes=itemsize,
    )


def make_layout(name: str, config: Any, arena: KVArena, block_size: int) -> KVStackLayout:
    """The layout ``name`` (one of ``LAYOUTS``) for a model of ``config`` on ``arena``;
    ``block_size`` is the cache spec's, which ``kvstack`` keeps."""
    if name not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS}, got {name!r}")
    if name == "kvstack":
        return KVStackLayout(arena, block_size)
    try:
        geometry = hybrid_geometry(config, arena.itemsize)
    except InvalidArgumentError as error:
        raise InvalidArgumentError(
            f"layout {name!r} models a hybrid serving system's pools and needs a Jamba, "
            f"NemotronH, Qwen3-Next or Qwen3.5 model ({error})"
        ) from None
    if name == "padded_unified":
        return PaddedUnifiedLayout(arena, geometry)
    return FixedDualLayout(arena, geometry)
