"""Hybrid models' conv and recurrent states on arena "state" pages.

Hybrid Mamba / linear-attention + attention models (Jamba, Bamba, Qwen3-Next, LFM2, NemotronH,
FalconH1, ...) keep, per state layer and state index, a conv state ``[B, C, K]`` (the last K
inputs of a causal convolution) and a recurrent state (an SSM or delta-rule state such as
``[B, H, D, N]``). transformers holds them in a ``LinearAttentionLayer`` ("linear_attention",
"conv") or, for FalconH1, in a ``LinearAttentionAndFullAttentionLayer`` ("hybrid"). Both are
allocated at the layer's first step and then updated in place (static addresses).

Here every one of those tensors is a view into the cache's ``KVArena``: one "state" page per
(layer, row, state tensor), exactly that row's size (AVMP's asymmetric paging: attention gets
token-granular KV blocks, state layers fixed-size state pages, both from one budget, nothing
padded to a common page size). The B pages of one state are placed back to back, so the state
is one ``[B, ...]`` view of ``arena.buffer`` that the model reads and updates in place.

transformers' semantics (``LinearAttentionLayer``, 5.17 to 5.24) are kept: lazy initialisation
at the first update (zeros), ``update_conv_state`` / ``update_recurrent_state`` copying into the
pages, ``has_previous_state``, ``reset`` (zeros, pages kept), ``reorder_cache`` (beam search, in
place), ``number_of_states > 1``. What differs, and why:

* the arena may move pages (compaction) or replace its buffer (a private arena growing); it then
  calls ``pages_moved`` and every view is taken again. A model holds a state view only inside one
  mixer call (``get_conv_state`` ... in-place update), and no page is allocated within it
  (FalconH1 runs its mamba mixer before its attention), so a move never strands a write;
* ``is_compileable`` is False: a page's address is static only until the arena moves it;
* ``batch_repeat_interleave`` / ``batch_select_indices`` (and a ``reorder_cache`` that changes
  the batch) take new pages, copy and free the old ones, all or nothing;
* ``release()`` returns the pages to the arena (``reset`` keeps them, as transformers does);
* past recording (``activate_past_recording`` / ``crop``, for assisted decoding's rollback) and
  ``offload`` / ``prefetch`` raise: recorded conv states grow past their page, offloaded ones
  leave the arena, and PagedCache's attention layers cannot crop either.

FalconH1's "hybrid" layer becomes one class combining the cache's own paged attention layer
(``cache.layer_class``: ``PagedLayer``, ``TokenTableLayer``, ...) with these state pages.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import (
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.reference.arena import KVArena, Page

_STATE_KINDS = ("conv", "recurrent")


def is_state_layer(layer: Any) -> bool:
    """Whether ``layer`` (built by ``DynamicCache(config=...)``) holds recurrent states that this
    module moves into arena pages. Exact types: a subclass may carry semantics we would lose."""
    return type(layer) in (LinearAttentionLayer, LinearAttentionAndFullAttentionLayer)


def arena_state_layer(cache: Any, layer_idx: int, layer: Any) -> Any:
    """The arena-backed replacement of transformers' state layer ``layer`` at ``layer_idx``."""
    if type(layer) is LinearAttentionLayer:
        return ArenaStateLayer(cache, layer_idx, number_of_states=layer.number_of_states)
    if type(layer) is LinearAttentionAndFullAttentionLayer:
        hybrid_class = hybrid_layer_class(cache.layer_class)
        return hybrid_class(cache, layer_idx, number_of_states=layer.number_of_states)
    raise InvalidArgumentError(
        f"layer {layer_idx} is a {type(layer).__name__}; expected a LinearAttentionLayer or a "
        "LinearAttentionAndFullAttentionLayer (see is_state_layer)"
    )


class ArenaStates:
    """The storage half of a state layer: its conv / recurrent states as views of arena pages.

    Mixed in before transformers' ``LinearAttentionLayer``, whose ``__init__`` sets up the
    bookkeeping dicts (``conv_states``, ``is_conv_states_initialized``, ``has_previous_state``,
    ``conv_kernel_size``, ...) that models and ``Cache`` read."""

    is_compileable = False  # pages move under compaction: their addresses are not static
    is_croppable = False  # no past is recorded (see activate_past_recording)

    def _init_arena_states(self, cache: Any, layer_idx: int) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.state_arena: KVArena | None = None
        # (kind, state_idx) -> the B pages of that state (back to back, row order) and its shape.
        self.state_pages: dict[tuple[str, int], list[Page]] = {}
        self.state_shapes: dict[tuple[str, int], torch.Size] = {}

    # ------------------------------------------------------------------ pages and views
    def _state_dict(self, kind: str) -> dict[int, torch.Tensor | None]:
        return self.conv_states if kind == "conv" else self.recurrent_states

    def _bind_state(self, key: tuple[str, int]) -> torch.Tensor:
        """Take the view of state ``key`` from its pages' current offsets."""
        pages, shape = self.state_pages[key], self.state_shapes[key]
        size, start = pages[0].size, pages[0].offset
        # Compaction keeps the pages' order and packs state pages without gaps, so a state's
        # pages stay back to back; a single [B, ...] view depends on it.
        if any(page.offset != start + row * size for row, page in enumerate(pages)):
            raise KVStackError(
                f"layer {self.layer_idx}'s {key[0]} state {key[1]}: its {len(pages)} pages are no "
                f"longer back to back (offsets {[page.offset for page in pages]}, size {size}); "
                "the arena broke the contiguity it promised at allocation"
            )
        view = self.state_arena.buffer[start : start + len(pages) * size].view(shape)  # [B, ...]
        self._state_dict(key[0])[key[1]] = view
        return view

    def pages_moved(self, moves: dict[Page, int]) -> None:
        """The arena moved some of this layer's pages or replaced its buffer (``moves == {}``):
        take every view again (page offsets are already updated)."""
        for key in self.state_pages:
            self._bind_state(key)

    def _arena_for_states(self, state_idx: int, given: dict[str, torch.Tensor]) -> KVArena:
        """The cache's arena (built on the first step when private), after checking that every
        state in ``given`` (kind -> tensor) can live in it; raises with nothing changed."""
        arena = self.cache.arena
        expected = arena.dtype if arena is not None else next(iter(given.values())).dtype
        for kind, state in given.items():
            if state.dtype != expected:
                raise InvalidArgumentError(
                    f"layer {self.layer_idx}'s {kind} state {state_idx} is {state.dtype}, but the "
                    f"cache's arena holds {expected}; state pages must have the arena's dtype "
                    f"(build the arena with dtype={state.dtype}, or run the model in {expected})"
                )
        state = next(iter(given.values()))
        return self.cache.arena_for(state.dtype, state.device)  # also checks the device

    def _allocate_states(
        self, shapes: dict[tuple[str, int], tuple[int, ...]]
    ) -> dict[Any, list[Page]]:
        """Pages for every state in ``shapes`` ([B, ...] each), all or nothing."""
        taken: dict[tuple[str, int], list[Page]] = {}
        if not shapes:
            return taken
        try:
            for key, shape in shapes.items():
                taken[key] = self.state_arena.allocate(
                    self, "state", math.prod(shape[1:]), count=shape[0], contiguous=True
                )
        except BaseException:
            self.state_arena.free([page for pages in taken.values() for page in pages])
            raise
        self.cache.account("state", self._state_bytes(taken))
        return taken

    def _free_state_pages(self, pages: list[Page]) -> None:
        self.state_arena.free(pages)
        self.cache.account("state", -sum(page.size for page in pages) * self.state_arena.itemsize)

    def _state_bytes(self, taken: dict[Any, list[Page]]) -> int:
        return (
            sum(page.size for pages in taken.values() for page in pages) * self.state_arena.itemsize
        )

    @property
    def state_bytes_used(self) -> int:
        """Arena bytes of this layer's state pages."""
        return self._state_bytes(self.state_pages) if self.state_arena is not None else 0

    # ------------------------------------------------------------------ transformers API
    def _lazy_init_states(
        self,
        conv_states: torch.Tensor | None = None,
        recurrent_states: torch.Tensor | None = None,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
    ) -> None:
        """transformers' ``LinearAttentionLayer.lazy_initialization``, on arena pages: zeroed
        states of the first update's shape (the conv state keeps ``conv_kernel_size`` inputs)."""
        given = {"conv": conv_states, "recurrent": recurrent_states}
        given = {kind: state for kind, state in given.items() if state is not None}
        if not given:
            return
        self.state_arena = self._arena_for_states(state_idx, given)
        shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        if conv_states is not None:
            # A prefill shorter or longer than the kernel is padded or cut to it (update_conv_state).
            kernel = conv_states.shape[-1] if conv_kernel_size is None else conv_kernel_size
            shapes[("conv", state_idx)] = (*conv_states.shape[:-1], kernel)
        if recurrent_states is not None:
            shapes[("recurrent", state_idx)] = tuple(recurrent_states.shape)
        taken = self._allocate_states(shapes)  # raises with nothing changed
        # Initialising a state again (transformers would allocate anew) replaces its pages.
        replaced = [page for key in taken for page in self.state_pages.get(key, [])]
        if replaced:
            self._free_state_pages(replaced)
        if self.device is None:
            first = next(iter(given.values()))
            self.dtype, self.device = first.dtype, first.device
        for key, pages in taken.items():
            self.state_pages[key] = pages
            self.state_shapes[key] = torch.Size(shapes[key])
            self._bind_state(key).zero_()  # a reused page holds an earlier owner's bytes
            if key[0] == "conv":
                self.conv_kernel_size[state_idx] = shapes[key][-1]
                self.is_conv_states_initialized[state_idx] = True
            else:
                self.is_recurrent_states_initialized[state_idx] = True

    lazy_initialization = _lazy_init_states

    def _check_state_shape(self, kind: str, state_idx: int, state: torch.Tensor) -> None:
        """A later update must match the pages (its conv inputs may be of any length)."""
        held = self.state_shapes[(kind, state_idx)]
        expected, got = (held[:-1], state.shape[:-1]) if kind == "conv" else (held, state.shape)
        if tuple(got) != tuple(expected):
            raise InvalidArgumentError(
                f"layer {self.layer_idx}'s {kind} state {state_idx} holds pages of shape "
                f"{tuple(held)}, but the update has shape {tuple(state.shape)}; a cache keeps the "
                "batch of its first step (release() it, or use a fresh cache, for a new batch)"
            )

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Keep the last ``conv_kernel_size`` inputs in the pages; return the full conv input
        (cached state then new inputs), exactly as ``LinearAttentionLayer.update_conv_state``."""
        if not self.is_conv_states_initialized[state_idx]:
            self._lazy_init_states(
                conv_states=conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size
            )
        else:
            self._check_state_shape("conv", state_idx, conv_states)
        kernel = self.conv_kernel_size[state_idx]
        if not self.has_previous_state[state_idx]:  # prefill: pad to the kernel if shorter
            full_conv_states = conv_states
            if full_conv_states.shape[-1] < kernel:
                padding = kernel - full_conv_states.shape[-1]
                full_conv_states = torch.nn.functional.pad(full_conv_states, (padding, 0), value=0)
            self.has_previous_state[state_idx] = True
        else:  # the causal conv needs the cached left context before the new inputs
            full_conv_states = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx].copy_(full_conv_states[..., -kernel:])  # in place: the pages
        return full_conv_states

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Copy the new recurrent state into its pages and return the pages' view."""
        if not self.is_recurrent_states_initialized[state_idx]:
            self._lazy_init_states(recurrent_states=recurrent_states, state_idx=state_idx)
        else:
            self._check_state_shape("recurrent", state_idx, recurrent_states)
        self.recurrent_states[state_idx].copy_(recurrent_states)
        return self.recurrent_states[state_idx]

    def reset(self) -> None:
        """Zero every state and forget the previous step; the pages stay (transformers keeps the
        objects; ``release`` returns them)."""
        for key in self.state_pages:
            self._state_dict(key[0])[key[1]].zero_()
        for state_idx in range(self.number_of_states):
            self.has_previous_state[state_idx] = False

    def release(self) -> None:
        """Return every state page to the arena; the layer is as new (uninitialised) afterwards."""
        pages = [page for pages in self.state_pages.values() for page in pages]
        if pages:
            self._free_state_pages(pages)
        self.state_pages, self.state_shapes = {}, {}
        for state_idx in range(self.number_of_states):
            self.conv_states[state_idx] = self.recurrent_states[state_idx] = None
            self.is_conv_states_initialized[state_idx] = False
            self.is_recurrent_states_initialized[state_idx] = False
            self.has_previous_state[state_idx] = False
            self.conv_kernel_size[state_idx] = None

    def _state_rows(self) -> int:
        return next(iter(self.state_shapes.values()))[0] if self.state_shapes else 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """New row i is old row ``beam_idx[i]``: in place in the pages when the batch keeps its
        size (beam search), otherwise through new pages (``_select_state_rows``)."""
        if not self.state_pages:
            return
        if beam_idx.shape[0] != self._state_rows():
            self._select_state_rows(beam_idx)
            return
        for key in self.state_pages:
            state = self._state_dict(key[0])[key[1]]
            state.copy_(state.index_select(0, beam_idx.to(state.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = torch.arange(self._state_rows()).repeat_interleave(repeats)
        self._select_state_rows(rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_state_rows(torch.as_tensor(indices).flatten())

    def _select_state_rows(self, rows: torch.Tensor) -> None:
        """Row i of every state becomes old row ``rows[i]``, in new pages: take them all (or
        raise with nothing changed), copy, then free the old ones."""
        if not self.state_pages:
            return
        count = rows.shape[0]
        if count and not (0 <= int(rows.min()) and int(rows.max()) < self._state_rows()):
            raise InvalidArgumentError(
                f"row indices must lie in [0, {self._state_rows()}), got {rows.tolist()}"
            )
        if count == 0:  # no rows left: nothing to hold
            self.release()
            return
        shapes = {key: (count, *shape[1:]) for key, shape in self.state_shapes.items()}
        taken = self._allocate_states(shapes)
        # Read the old views only now: an allocation that compacted moved them (pages_moved).
        old_views = {key: self._state_dict(key[0])[key[1]] for key in self.state_pages}
        old_pages = [page for pages in self.state_pages.values() for page in pages]
        for key, pages in taken.items():
            self.state_pages[key], self.state_shapes[key] = pages, torch.Size(shapes[key])
            old = old_views[key]
            self._bind_state(key).copy_(old.index_select(0, rows.to(old.device)))
        self._free_state_pages(old_pages)

    def activate_past_recording(self) -> None:
        raise KVStackError(
            f"layer {self.layer_idx} keeps its states in fixed arena pages and cannot record past "
            "states for a rollback (assisted decoding, deferred stop checks); kvstack's paged "
            "caches cannot crop: generate without an assistant model"
        )

    def crop(self, tokens_to_remove: int) -> None:
        raise KVStackError(
            f"crop({tokens_to_remove}) on layer {self.layer_idx}: a state layer on arena pages "
            "records no past states, so it cannot be cropped (see activate_past_recording)"
        )

    def offload(self) -> None:
        raise KVStackError(
            f"layer {self.layer_idx}'s states live in the cache's arena on {self.device}; "
            "offloading them would take them out of its budget (kvstack caches do not offload)"
        )

    def prefetch(self) -> None:
        self.offload()  # nothing is ever offloaded: the same refusal

    def get_max_length(self) -> int:
        return -1  # no sequence dimension


class ArenaStateLayer(ArenaStates, LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` ("linear_attention", "conv") on arena pages."""

    def __init__(self, cache: Any, layer_idx: int, number_of_states: int = 1) -> None:
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self._init_arena_states(cache, layer_idx)

    def __repr__(self) -> str:
        return (
            f"ArenaStateLayer(layer_idx={self.layer_idx}, number_of_states={self.number_of_states}"
            f", state_bytes_used={self.state_bytes_used})"
        )


class HybridStateLayer(ArenaStates, LinearAttentionLayer):
    """FalconH1's "hybrid" layer: a mamba mixer and an attention in one decoder layer. The
    attention part is the cache's paged layer class (``attention_class``, set by
    ``hybrid_layer_class``), the state part arena pages; each method serves both parts, as
    transformers' ``LinearAttentionAndFullAttentionLayer`` does with ``DynamicLayer``."""

    attention_class: type | None = None  # set by hybrid_layer_class

    def __init__(self, cache: Any, layer_idx: int, number_of_states: int = 1) -> None:
        if self.attention_class is None:
            raise KVStackError(
                "HybridStateLayer has no attention part; build it as "
                "hybrid_layer_class(cache.layer_class)(cache, layer_idx, number_of_states)"
            )
        self.attention_class.__init__(self, cache, layer_idx, cache.block_size, None)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)
        self._init_arena_states(cache, layer_idx)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(layer_idx={self.layer_idx}, rows={self.batch_size}, "
            f"pool={self.pool}, state_bytes_used={self.state_bytes_used})"
        )

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        # The attention part calls it with (key_states, value_states); the state part with
        # keywords (transformers' dispatch in LinearAttentionAndFullAttentionLayer).
        if args:
            self.attention_class.lazy_initialization(self, *args, **kwargs)
        else:
            self._lazy_init_states(**kwargs)

    def reset(self) -> None:
        ArenaStates.reset(self)
        self.attention_class.reset(self)

    def release(self) -> None:
        ArenaStates.release(self)
        self.attention_class.release(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        ArenaStates.reorder_cache(self, beam_idx)
        self.attention_class.reorder_cache(self, beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        ArenaStates.batch_repeat_interleave(self, repeats)
        self.attention_class.batch_repeat_interleave(self, repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        ArenaStates.batch_select_indices(self, indices)
        self.attention_class.batch_select_indices(self, indices)


_HYBRID_CLASSES: dict[type, type] = {}


def hybrid_layer_class(attention_class: type) -> type:
    """The ``HybridStateLayer`` whose attention part is ``attention_class`` (one class per
    attention class, so ``isinstance(layer, attention_class)`` holds and the cache's stats and
    attention function treat it as one of its paged layers)."""
    if attention_class not in _HYBRID_CLASSES:
        _HYBRID_CLASSES[attention_class] = type(
            f"Hybrid{attention_class.__name__}",
            (HybridStateLayer, attention_class),
            {"attention_class": attention_class, "__module__": __name__},
        )
    return _HYBRID_CLASSES[attention_class]
