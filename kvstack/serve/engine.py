"""``Engine``: continuous batching of many requests on one fixed ``KVArena``.

    arena = KVArena("64MiB")
    engine = Engine(model, arena, cache=CacheSpec(policy=H2O(), ratio=0.5))
    handles = [engine.submit(ids, max_new_tokens=64) for ids in prompts]
    engine.run()                      # or: for request, new in engine.stream(): ...
    print(handles[0].output_ids, handles[0].stats.ttft_s)

Each request gets its own kvstack cache (``CacheSpec``) on the engine's arena, so the pages one
request frees (eviction, repacking, finishing) serve the next. A step is one forward pass of the
model over every scheduled request's tokens, packed into one row: decode tokens of running
requests and prefill work of new ones, each with its own positions. The model runs the engine's
attention (``"kvstack_serve"``, ``kvstack.serve.attention``): it hands each request's part of the
packed K/V to that request's cache, exactly as ``generate`` with that cache would, then attends
every decode token of the step in one call over all their token tables (slot ids are arena-wide)
and each prefill through the kvstack attention.

A lossless spec on a model whose layers are all full attention keeps each request's K/V in a
``StackedKV`` instead (``kvstack.serve.stacked_kv``: one block table per request for every
layer, vLLM's layout; the same arena bytes). The step's slots are then computed once per forward
pass (``kvstack.serve.attention.StepContext``), and each layer stores every request's K/V with
one scatter and attends every decode token in one call, with no work per request and layer.

A step, in order:

1. **Admission**, FIFO: the oldest waiting request starts when the arena's free bytes, less
   what running requests were promised (the rest of their admission bytes while they prefill;
   then room for ``DECODE_HEADROOM_TOKENS`` more tokens, or for an evicting cache its tables at
   their budget), hold its ``admission_bytes`` (after a preemption, those of what it must
   rebuild: its outputs too). Nobody overtakes it. With nothing running it starts at once; if
   its first step then does not fit the free bytes (a shared arena whose other users hold the
   rest), the step raises ``ArenaExhausted`` and it waits, first in line.
2. **Batch**: each running request offers its next work (``scheduler.Work``); the
   ``BatchRule`` orders the offers and the step takes them within ``max_batch_tokens``. With
   a ``step_time_target`` (adaptive chunking, ``kvstack.serve.chunking``) the step takes
   every decode token first, then prefill and recompute work in the rule's order, within the
   prefill tokens the engine's fitted step costs say the target allows. With a
   ``tpot_target`` prefill work joins a step only when, at the step's fitted cost, every
   request decoding in it stays within that time per output token; else it waits.
3. **Pages**: the step's work must fit the free pages; while it does not, the newest running
   request is preempted: its pages are returned and it waits, first in line, to recompute.
   A lossless request recomputes its prompt and outputs as a prefill; an evicting one prefills
   its prompt and replays its outputs one decode step each, so its cache makes the same
   evictions again and its output does not change. With a host swap tier
   (``swap_bytes``, lossless stacked layout: ``kvstack.serve.swap``) a preempted request's
   pages are copied to the host instead; it stays running, not resident, and its work is
   offered with the bytes it would fetch. A step that takes it copies them back first (making
   room, if needed, by swapping out the resident request the rule picks, ``choose_victim``,
   else the newest). Non-resident work after the step's first piece waits when it does not
   fit, rather than pushing others out, and work the rule would not bring back yet
   (``may_swap_in``: the page-aware rule's look-ahead) waits too, unless nothing else could
   run.
4. **Forward and sampling**: requests whose work reached their last known token draw the next
   one (``request.Sampling``); a request ends at a stop id or at ``max_new_tokens`` and returns
   its pages.

A request may come with the K/V of its prompt's first tokens already computed (``submit(...,
prefix_kv=...)``: a fact memory's injected facts, ``kvstack.facts.FactMemory.prompt_kv``). They
are written into its pages when it is admitted, and again if it is preempted, so the engine
computes only the rest of its prompt (lossless caches in the stacked layout).

Hybrid models (recurrent state layers beside attention) would run those layers across request
boundaries in a packed row. Their prefill work runs one forward pass per request (the whole
prompt at once, each request's states in its cache's arena state pages); their decode tokens
run in one forward pass with one batch row per request, each state layer holding the requests'
states stacked (gathered from their pages, written back after). FalconH1, whose layers are
attention and states at once, decodes one request per forward pass. A request whose pages run
out mid-forward is preempted and recomputed.
"""

from __future__ import annotations

import inspect
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

from kvstack.arena import KVArena, parse_bytes
from kvstack.errors import ArenaExhausted, InvalidArgumentError
from kvstack.hf import ATTENTION_NAME
from kvstack.hf.state_layers import is_state_layer
from kvstack.reference.checks import check_positive_int
from kvstack.serve.attention import SEGMENTS_KWARG, StepContext, StepRequest, serve_attention
from kvstack.serve.cache_spec import CacheGeometry, CacheSpec, cache_config
from kvstack.serve.chunking import StepTimeModel, check_seconds, tpot_slack
from kvstack.serve.layouts import Need, hybrid_geometry, make_layout
from kvstack.serve.request import (
    Request,
    RequestStats,
    Sampling,
    check_max_new_tokens,
    stop_set,
    token_ids,
)
from kvstack.serve.scheduler import BatchRule, Outlook, PageAwareRule, Work, fill_batch
from kvstack.serve.stacked_kv import StackedKV
from kvstack.serve.swap import HostSwap

SERVE_ATTENTION = "kvstack_serve"
DEFAULT_MAX_BATCH_TOKENS = 512
# Decode headroom of a cache that keeps every block: room for this many more tokens beyond its
# prompt (or its tokens so far). In tokens, not blocks, so that a layout with enlarged blocks
# (vLLM's padded_unified) is not charged a whole extra block; with 16-token blocks it is one.
DECODE_HEADROOM_TOKENS = 16
DEFAULT_PREFILL_CHUNK = 256


@dataclass
class _Segment:
    """One request's slice [start, end) of a step's packed tokens."""

    cache: Any
    start: int
    end: int
    row: int = 0  # the batch row: 0 in a packed step; the request's row in a hybrid decode


def register() -> None:
    """Register ``"kvstack_serve"`` with transformers' attention interface (idempotent). It has
    no mask function on purpose: transformers then builds no mask, and the caches mask."""
    from transformers import AttentionInterface

    AttentionInterface.register(SERVE_ATTENTION, serve_attention)


class _StepCache(Cache):
    """What the model is given as its cache during a step: it stores nothing (serve_attention
    stores each request's K/V in that request's cache) and hands K/V straight through."""

    def __init__(self) -> None:
        super().__init__(layers=[])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class Engine:
    """Serve many requests from one fixed ``arena``; see the module docstring."""

    def __init__(
        self,
        model: Any,
        arena: KVArena,
        *,
        cache: CacheSpec | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        rule: BatchRule | None = None,
        layout: str = "kvstack",
        swap_bytes: int | str | None = None,
        step_time_target: float | None = None,
        tpot_target: float | None = None,
    ) -> None:
        spec = CacheSpec() if cache is None else cache
        if not isinstance(spec, CacheSpec):
            raise InvalidArgumentError(
                f"cache must be a kvstack.serve.CacheSpec, got {type(spec).__name__}"
            )
        if not isinstance(arena, KVArena):
            raise InvalidArgumentError(
                f"arena must be a kvstack.arena.KVArena, got {type(arena).__name__}"
            )
        if arena.growable:
            raise InvalidArgumentError(
                "arena must have a fixed capacity (KVArena(capacity)); an engine schedules "
                "against one budget, and a private, growable arena has none"
            )
        check_positive_int("max_batch_tokens", max_batch_tokens)
        check_positive_int("prefill_chunk", prefill_chunk)
        if prefill_chunk > max_batch_tokens:
            raise InvalidArgumentError(
                f"prefill_chunk ({prefill_chunk}) must be at most max_batch_tokens "
                f"({max_batch_tokens}): a chunk has to fit in one step"
            )
        parameter = next(model.parameters())
        if parameter.dtype != arena.dtype or parameter.device != arena.device:
            raise InvalidArgumentError(
                f"the model runs in {parameter.dtype} on {parameter.device}, but the arena holds "
                f"{arena.dtype} on {arena.device}; build the arena with the model's dtype and "
                "device"
            )
        self.model = model
        self.arena = arena
        # How the arena is divided between KV and recurrent states (``kvstack.serve.layouts``);
        # padded_unified and fixed_dual build every cache with their systems' block size.
        self.layout = make_layout(layout, model.config, arena, spec.block_size)
        spec = replace(spec, block_size=self.layout.block_size)
        self.spec = spec
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk = prefill_chunk
        # Adaptive chunking: each step's token budget from the steps run so far; a TPOT target
        # holds prefill back while the requests decoding have no time per token to spare.
        self.step_time_target = check_seconds("step_time_target", step_time_target)
        self.tpot_target = check_seconds("tpot_target", tpot_target)
        self.step_times = StepTimeModel()
        if rule is not None and not callable(getattr(rule, "order", None)):
            raise InvalidArgumentError(
                f"rule={rule!r}; expected a batch rule: an object with order(work, step), such "
                "as kvstack.serve.PageAwareRule()"
            )
        self.rule: BatchRule = PageAwareRule() if rule is None else rule
        self._config = cache_config(model.config)
        # A probe cache: checks the spec against this model (budget, ratio, arena dtype and
        # size) before anything runs, and gives the page geometry the scheduler counts in.
        probe = spec.build(self._config, arena, prefill_chunk)
        # A hybrid model's recurrent layers would run across request boundaries in a packed
        # row: each of its requests gets its own forward pass in a step instead.
        template = DynamicCache(config=model.config).layers  # transformers' layer per index
        self.hybrid = any(is_state_layer(layer) for layer in template)
        # Its decode tokens can share one forward pass when each state layer is a plain
        # recurrent-state layer (not FalconH1's, which are attention and states at once).
        self._batched_decode = self.hybrid and all(
            type(layer) is LinearAttentionLayer for layer in template if is_state_layer(layer)
        )
        self._probe = probe
        # A lossless cache of a model whose every attention layer is full attention keeps its
        # requests' K/V in one block table per request for all layers (``StackedKV``), so a
        # step's slots are computed once, not once per request and layer.
        attention_layers = [
            index for index, layer in enumerate(template) if type(layer) is DynamicLayer
        ]
        self._stacked = (
            not spec.evicting
            and not self.hybrid
            and layout == "kvstack"
            and len(attention_layers) == len(template)
        )
        self._layer_index = {layer: place for place, layer in enumerate(attention_layers)}
        # The host swap tier: preempted requests' pages move there instead of being recomputed.
        self.swap: HostSwap | None = None
        if swap_bytes is not None:
            if not self._stacked:
                raise InvalidArgumentError(
                    f"swap_bytes needs the lossless cache (CacheSpec()) on a model whose layers "
                    f"are all full attention, in the kvstack layout; this engine runs {spec} in "
                    f"the {layout} layout" + (" on a hybrid model" if self.hybrid else "")
                )
            capacity = parse_bytes("swap_bytes", swap_bytes)
            if capacity == 0:
                raise InvalidArgumentError(
                    "swap_bytes=0; expected a host tier of at least one page (or None: no tier)"
                )
            self.swap = HostSwap(capacity, arena)
        # Arena bytes of one request's recurrent-state pages (hybrids): exact sizes, the same for
        # every request of a model; from the config where the model's state shapes are known
        # (``layouts.hybrid_geometry``), else learned from the first request that holds them.
        self.state_bytes = _state_bytes_of(model.config, arena.itemsize) if self.hybrid else 0
        self.geometry = CacheGeometry.of(probe, arena.itemsize)
        self._cache_kwarg = (
            "cache"
            if "cache" in inspect.signature(type(model).forward).parameters
            else "past_key_values"
        )
        register()
        self.attention = ATTENTION_NAME if self.hybrid else SERVE_ATTENTION
        model.set_attn_implementation(self.attention)
        self._waiting: deque[Request] = deque()  # FIFO by id (preempted requests go first)
        self._running: list[Request] = []  # in admission order
        self._next_id = 0
        self._step = 0
        self.preemptions = 0

    def __repr__(self) -> str:
        return (
            f"Engine(cache={self.spec}, running={len(self._running)}, "
            f"waiting={len(self._waiting)}, arena={self.arena})"
        )

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        stop_ids: Iterable[int] | None = None,
        sampling: Sampling | None = None,
        prefix_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        keep_kv: bool = False,
    ) -> Request:
        """Queue a request (its prompt ``input_ids``: a list of ids or a [T] / [1, T] tensor)
        and return its handle. Refused, with nothing queued, when even alone it could never fit
        the arena.

        ``prefix_kv``: the K/V of the prompt's first n tokens, known already (a fact memory's
        injected facts, ``FactMemory.prompt_kv``): keys and values [L, n, H_kv, D] for the L
        attention layers, keys rotated at positions 0..n-1, n below the prompt's length. They
        are written into the request's pages when it is admitted (and again after a preemption)
        and only the rest of the prompt is computed. The engine reads them then: leave them
        unchanged until the request is done. Lossless caches on models whose layers are all
        full attention only.

        ``keep_kv``: when the request finishes (stop or length), copy its K/V out of the arena
        before its pages are freed, as ``request.kept_kv`` (the layout of ``prefix_kv``, on the
        CPU):
        a conversation's next turn reuses them instead of computing its history again. The
        same caches only."""
        prompt, max_new_tokens, stops, sampling = self._checked_submit(
            input_ids, max_new_tokens, eos_token_id, stop_ids, sampling, keep_kv
        )
        if prefix_kv is not None:
            prefix_kv = self._check_prefix_kv(prefix_kv, len(prompt))
        request = Request(
            id=self._next_id,
            prompt_ids=prompt,
            max_new_tokens=max_new_tokens,
            stop_ids=stops,
            sampling=sampling,
            stats=RequestStats(submitted_at=time.perf_counter()),
            prefix_kv=prefix_kv,
            keep_kv=keep_kv,
        )
        self._next_id += 1
        self._waiting.append(request)
        return request

    def check_submit(
        self,
        input_ids: Any,
        max_new_tokens: int,
        *,
        eos_token_id: int | Iterable[int] | None = None,
        stop_ids: Iterable[int] | None = None,
        sampling: Sampling | None = None,
        keep_kv: bool = False,
    ) -> None:
        """Raise what ``submit`` would raise for these arguments (all but ``prefix_kv``) and
        change nothing: for a caller with work of its own to do before it submits, such as
        ``TurnStore.submit``, which reads a conversation's pages back to build ``prefix_kv``."""
        self._checked_submit(input_ids, max_new_tokens, eos_token_id, stop_ids, sampling, keep_kv)

    def _checked_submit(
        self,
        input_ids: Any,
        max_new_tokens: int,
        eos_token_id: Any,
        stop_ids: Any,
        sampling: Any,
        keep_kv: Any,
    ) -> tuple[list[int], int, frozenset[int], Sampling]:
        """``submit``'s checks: (prompt ids, max_new_tokens, stop ids, sampling), or the error."""
        prompt = token_ids("input_ids", input_ids)
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        if max(prompt) >= vocab:
            raise InvalidArgumentError(
                f"input_ids holds token id {max(prompt)}, but the model's vocabulary has "
                f"{vocab} ids (0 to {vocab - 1})"
            )
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        stops = stop_set(eos_token_id, stop_ids)
        sampling = Sampling() if sampling is None else sampling
        if not isinstance(sampling, Sampling):
            raise InvalidArgumentError(
                f"sampling must be a kvstack.serve.Sampling, got {type(sampling).__name__}"
            )
        if not self.could_run_alone(len(prompt), max_new_tokens):
            needed = max(
                self.admission_bytes(len(prompt)), self.lifetime_bytes(len(prompt), max_new_tokens)
            )
            raise InvalidArgumentError(
                f"a request of {len(prompt)} prompt tokens and up to {max_new_tokens} new tokens "
                f"needs {needed} arena bytes with {self.spec} in the {self.layout.name} layout, "
                f"more than the arena's capacity of {self.arena.capacity_bytes} bytes can "
                "give it; it could never run"
            )
        if not isinstance(keep_kv, bool):
            raise InvalidArgumentError(f"keep_kv={keep_kv!r}; expected a bool")
        if keep_kv and not self._stacked:
            raise InvalidArgumentError(
                f"keep_kv needs the lossless cache (CacheSpec()) on a model whose layers are all "
                f"full attention, in the kvstack layout; this engine runs {self.spec} in the "
                f"{self.layout.name} layout" + (" on a hybrid model" if self.hybrid else "")
            )
        return prompt, max_new_tokens, stops, sampling

    def _check_prefix_kv(self, prefix_kv: Any, prompt_tokens: int) -> tuple[Any, Any]:
        """``prefix_kv`` checked against this engine and a prompt of ``prompt_tokens``; the
        pair on the arena's device."""
        if not self._stacked:
            raise InvalidArgumentError(
                f"prefix_kv needs the lossless cache (CacheSpec()) on a model whose layers are "
                f"all full attention, in the kvstack layout; this engine runs {self.spec} in the "
                f"{self.layout.name} layout"
                + (" on a hybrid model" if self.hybrid else "")
                + ": an evicting cache decides what to keep while it computes the prompt"
            )
        if (
            not isinstance(prefix_kv, (tuple, list))
            or len(prefix_kv) != 2
            or not all(isinstance(t, torch.Tensor) for t in prefix_kv)
        ):
            raise InvalidArgumentError(
                f"prefix_kv must be a pair of tensors (keys, values), got {type(prefix_kv).__name__}"
            )
        keys, values = prefix_kv
        layers = len(self._layer_index)
        heads, head_dim = self._probe.expected_kv_heads, self._probe.expected_head_dim
        count = keys.shape[1] if keys.dim() == 4 else -1
        expected = (layers, count, heads, head_dim)
        if keys.dim() != 4 or tuple(keys.shape) != expected or keys.shape != values.shape:
            raise InvalidArgumentError(
                f"prefix_kv holds keys {tuple(keys.shape)} and values {tuple(values.shape)}; "
                f"expected both [layers={layers}, n, kv_heads={heads}, head_dim={head_dim}]"
            )
        if not 1 <= count < prompt_tokens:
            raise InvalidArgumentError(
                f"prefix_kv covers {count} tokens of a {prompt_tokens}-token prompt; expected 1 "
                f"to {prompt_tokens - 1} (at least the last prompt token is computed, for the "
                "first new token's logits)"
            )
        if keys.dtype != self.arena.dtype or values.dtype != self.arena.dtype:
            raise InvalidArgumentError(
                f"prefix_kv holds {keys.dtype} keys and {values.dtype} values; the arena holds "
                f"{self.arena.dtype}"
            )
        device = self.arena.device
        return keys.to(device), values.to(device)

    def _load_prefix(self, request: Request) -> None:
        """Write ``request.prefix_kv`` into its new store's first pages (every layer), as if
        computed: ``request.computed`` counts them."""
        keys, values = request.prefix_kv
        count = keys.shape[1]
        store = request.cache
        store.reserve(count)
        slots = store.base_slots(0, count)  # [n]: layer 0's slots; layer l adds l * block_size
        key_cache, value_cache = store.key_value()
        rows = (-1, keys.shape[2], keys.shape[3])  # the arena as [S, H_kv, D]
        with torch.no_grad():
            for layer in range(keys.shape[0]):
                layer_slots = slots + layer * store.block_size
                key_cache.view(rows).index_copy_(0, layer_slots, keys[layer])
                value_cache.view(rows).index_copy_(0, layer_slots, values[layer])
        store.tokens = count
        request.computed = count

    def _copy_kv_out(self, request: Request) -> None:
        """``request.kept_kv``: its store's K/V for every token it computed, copied out of the
        arena (the inverse of ``_load_prefix``)."""
        store = request.cache
        slots = store.base_slots(0, store.tokens)  # [n]: layer 0's; layer l adds l * block_size
        key_cache, value_cache = store.key_value()
        heads, head_dim = self._probe.expected_kv_heads, self._probe.expected_head_dim
        rows = (-1, heads, head_dim)  # the arena as [S, H_kv, D]
        per_layer = [slots + layer * store.block_size for layer in range(len(self._layer_index))]
        with torch.no_grad():
            keys = torch.stack([key_cache.view(rows).index_select(0, s) for s in per_layer])
            values = torch.stack([value_cache.view(rows).index_select(0, s) for s in per_layer])
        request.kept_kv = (keys.cpu(), values.cpu())  # outside the arena: not device memory

    def cancel(self, request: Request) -> bool:
        """Stop ``request`` and return its pages; False if it had already finished."""
        if not isinstance(request, Request):
            raise InvalidArgumentError(
                f"request={request!r}; expected a handle that Engine.submit returned"
            )
        if request.done:
            return False
        if request in self._running:
            self._running.remove(request)
            self._drop_cache(request)
        elif request in self._waiting:
            self._waiting.remove(request)
            self._drop_cache(request)
        else:
            raise InvalidArgumentError(f"{request!r} was not submitted to this engine")
        self._finish(request, "cancelled")
        return True

    @property
    def waiting(self) -> tuple[Request, ...]:
        """Requests not yet admitted (or preempted), oldest first."""
        return tuple(self._waiting)

    @property
    def running(self) -> tuple[Request, ...]:
        """Requests admitted and not done, in admission order: each holds a cache, or its pages
        sit in the host swap tier (``request.swapped``)."""
        return tuple(self._running)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.has_work():
            self.step()

    def stream(self) -> Iterator[tuple[Request, list[int]]]:
        """Step until every request is done, yielding (request, its new tokens) as they come."""
        while self.has_work():
            yield from self.step()

    # ------------------------------------------------------------------ memory
    def admission_bytes(self, prompt_tokens: int) -> int:
        """Arena bytes a request must find free to start: its prompt and room for
        ``DECODE_HEADROOM_TOKENS`` more tokens (lossless, or Naive-Evict, whose blocks never shrink), or for an
        evicting cache its budget with decode slack plus one prefill chunk in flight; and its
        state pages (hybrids), as the layout charges them."""
        return self.layout.charged(self._admission_need(prompt_tokens))

    def lifetime_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """The most arena bytes a request can hold alone: every token for caches that keep all
        blocks; an evicting cache's prefill peak (as the layout charges them)."""
        return self.layout.charged(self._lifetime_need(prompt_tokens, max_new_tokens))

    def could_run_alone(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        """Whether a request of this size fits the arena (in the engine's layout) when it runs
        alone: what ``submit`` checks before queueing it."""
        needs = (
            self._admission_need(prompt_tokens),
            self._lifetime_need(prompt_tokens, max_new_tokens),
        )
        return all(self.layout.could_ever_fit(need) for need in needs)

    def _admission_need(self, prompt_tokens: int) -> Need:
        if self.spec.compresses_prompt:
            # The budget reservation: the compressed prompt's pages (every table at its budget
            # and one decode token) and one prefill chunk in flight, never the whole prompt.
            tables = self.geometry.tables
            blocks = self._probe.blocks_to_reserve(tables, prompt_tokens)
            kv = blocks * self.geometry.block_bytes
            if self.spec.headwise:  # its tables grow as it decodes: room for more tokens
                kv += self.geometry.bytes_for(DECODE_HEADROOM_TOKENS)
            return Need(kv, self.state_bytes)
        kv = self.geometry.bytes_for(prompt_tokens + DECODE_HEADROOM_TOKENS)
        return Need(kv, self.state_bytes)

    def _lifetime_need(self, prompt_tokens: int, max_new_tokens: int) -> Need:
        if self.spec.bounded:
            return self._admission_need(prompt_tokens)
        if self.spec.headwise:
            need = self._admission_need(prompt_tokens)
            return Need(need.kv + self.geometry.bytes_for(max_new_tokens), need.state)
        return Need(self.geometry.bytes_for(prompt_tokens + max_new_tokens), self.state_bytes)

    def _request_admission_need(self, request: Request) -> Need:
        """``_admission_need`` for what this request's cache must rebuild: after a preemption a
        cache that keeps every block (lossless, Naive-Evict) recomputes its outputs too, and a
        head-wise one replays them into its tables."""
        if self.spec.bounded:
            return self._admission_need(len(request.prompt_ids))
        if self.spec.headwise:
            need = self._admission_need(len(request.prompt_ids))
            return Need(need.kv + self.geometry.bytes_for(len(request.output_ids)), need.state)
        return self._admission_need(len(request.tokens))

    def _kept_need(self, request: Request) -> Need:
        """The arena bytes the engine keeps for a running request: its admission bytes until
        its prompt is in; then, for a cache that keeps every block, room for its tokens so far
        and ``DECODE_HEADROOM_TOKENS`` more (the admission bytes of its tokens so far), and for
        an evicting cache its tables at their budget with their decode slack (its admission
        bytes less the prefill chunk in flight, which it no longer needs)."""
        prompt = len(request.prompt_ids)
        need = self._request_admission_need(request)
        if self.spec.compresses_prompt and request.computed >= prompt:
            in_flight = min(prompt, self.prefill_chunk)
            chunk_blocks = self.geometry.tables * -(-in_flight // self.geometry.block_size)
            return Need(need.kv - chunk_blocks * self.geometry.block_bytes, need.state)
        return need

    def _held_need(self, request: Request) -> Need:
        if request.cache is None:
            return Need()
        stats = request.cache.stats()
        state = int(stats["bytes_used_state"])
        return Need(int(stats["bytes_used"]) - state, state)

    def _held(self) -> Need:
        """What every running request holds."""
        return sum((self._held_need(r) for r in self._running), Need())

    def _promised_need(self) -> Need:
        """What running requests may still take, beyond what they hold, before the engine
        would preempt one (``_kept_need``)."""
        promised = Need()
        for request in self._running:
            kept, held = self._kept_need(request), self._held_need(request)
            promised += Need(max(0, kept.kv - held.kv), max(0, kept.state - held.state))
        return promised

    def _step_need(self, work: Work) -> Need:
        """Upper bound of the arena bytes ``work`` adds in this step."""
        request = work.request
        if request.swapped is not None:  # its pages come back, then the work's tokens
            pages = -(-(request.computed + work.tokens) // self.spec.block_size)
            return Need(pages * request.swapped.page_bytes)
        if self.spec.compresses_prompt and request.computed < len(request.prompt_ids):
            # A chunk of an evicting prefill: each layer appends the chunk and evicts back to
            # its budget before the next layer appends, so the step peaks at the admission
            # bound (every table at its budget plus one layer's chunk in flight), not at a
            # chunk in every layer. What the request holds already counts against that bound.
            kept, held = self._kept_need(request), self._held_need(request)
            return Need(max(0, kept.kv - held.kv), max(0, kept.state - held.state))
        if isinstance(request.cache, StackedKV):
            return Need(request.cache.blocks_needed(work.tokens) * self.geometry.block_bytes)
        state = self.state_bytes if request.computed == 0 else 0  # taken at its first step
        blocks = 0
        for layer in request.cache.paged_layers:
            if layer.is_initialized:
                blocks += layer.batch.blocks_needed(work.tokens)
            else:  # its first step: one table per group, each takes every new token
                blocks += self.geometry.tables * -(-work.tokens // self.geometry.block_size)
        return Need(blocks * self.geometry.block_bytes, state)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one step; return (request, new token ids) for every request that got tokens."""
        self._step += 1
        self._admit()
        batch = self._choose_batch()
        if not batch:
            return []
        # Swapped requests' pages come back first: a swap-in that fails changes nothing (its
        # request stays swapped) and the ones before it are whole, so the error goes up as is.
        for work in batch:
            if work.request.swapped is not None:
                self._swap_in(work.request)
        try:
            started = time.perf_counter()
            logits = self._forward_each(batch) if self.hybrid else self._forward(batch)
            seconds = time.perf_counter() - started
        except BaseException as error:
            # Some layers may hold this step's K/V and others not: no cache of the step can be
            # continued. Each of its requests recomputes (its tokens are kept), and an error
            # the engine cannot absorb is raised with the engine consistent.
            self._recompute_all(batch)
            # The bound in _step_need makes running out here unexpected; with other requests
            # left to free pages, recomputing is the remedy. Anything else is the caller's.
            if isinstance(error, ArenaExhausted) and len(batch) > 1:
                return []
            raise
        # What the step cost, for adaptive chunking's fitted step costs.
        decodes = sum(work.kind == "decode" for work in batch)
        prefill = sum(work.tokens for work in batch if work.kind != "decode")
        self.step_times.observe(decodes, prefill, seconds)
        # Every row is sampled before any request changes: a sampling error (a caller's
        # Sampling, logits it cannot draw from) then leaves no request half-advanced. Each of the
        # step's requests recomputes, as after a failed forward pass, and the error goes up.
        try:
            tokens = [
                None
                if row is None or work.request.cache is None
                else work.request.sampling.next_token(row, len(work.request.output_ids))
                for work, row in zip(batch, logits, strict=True)
            ]
        except BaseException:
            self._recompute_all(batch)
            raise
        produced = []
        failure: BaseException | None = None
        for work, token in zip(batch, tokens, strict=True):
            request = work.request
            if request.cache is None:  # preempted during the step (hybrid: its own forward)
                continue
            request.computed += work.tokens
            request.last_scheduled_step = self._step
            if token is not None:
                request.output_ids.append(token)
                produced.append((request, [token]))
                try:
                    self._after_token(request, token)
                except BaseException as error:
                    # A finishing request's K/V copy (keep_kv) failed: it is finished and its
                    # pages are back (_finish_running). The rest of the step still commits, so
                    # no other request is left half-advanced; then the error goes up.
                    failure = failure if failure is not None else error
                    continue
            self._track_peak(request)
        if failure is not None:
            raise failure
        return produced

    def _recompute_all(self, batch: list[Work]) -> None:
        """After a step that failed part-way: preempt every request of ``batch`` still holding
        a cache, without swapping (its K/V may be half-written), so each recomputes later from
        the tokens it has."""
        for work in batch:
            if work.request.cache is not None:
                self._preempt(work.request, swap=False)

    def _admit(self) -> None:
        while self._waiting:
            request = self._waiting[0]
            need = self._request_admission_need(request) + self._promised_need()
            if self._running and not self.layout.fits(need, self._held()):
                return  # FIFO: nobody overtakes the oldest waiting request
            request.cache = self._new_cache()
            if self.spec.evicting and not self.hybrid:
                request.cache.expect_prompt(len(request.prompt_ids))  # a chunk per step
            request.computed = 0
            if request.prefix_kv is not None:
                try:
                    self._load_prefix(request)
                except BaseException as error:
                    # Its pages go back whatever the error. Out of pages (the free bytes were
                    # there, but not in pages it could take), it waits, still first in line,
                    # for a request to finish.
                    self._drop_cache(request)
                    if isinstance(error, ArenaExhausted) and self._running:
                        return
                    raise
            self._waiting.popleft()
            request.admitted_at_step = self._step
            self._running.append(request)

    def _new_cache(self) -> Any:
        if self._stacked:
            probe = self._probe
            return StackedKV(
                self.arena,
                layers=len(probe.paged_layers),
                block_size=self.spec.block_size,
                num_kv_heads=probe.expected_kv_heads,
                head_dim=probe.expected_head_dim,
            )
        return self.spec.build(self._config, self.arena, self.prefill_chunk)

    def _offer(self, request: Request) -> Work:
        tokens = request.tokens
        remaining = len(tokens) - request.computed
        prompt_left = len(request.prompt_ids) - request.computed
        if self.hybrid:
            # A recurrent layer continues its state only one token at a time: the whole prompt
            # (a lossless hybrid: prompt and outputs, recomputed) in one step, then one token
            # per step.
            if request.computed == 0:
                count = len(request.prompt_ids) if self.spec.evicting else remaining
                return Work(request, count, "prefill")
            return Work(request, 1, "decode")
        if self.spec.evicting:
            # The prompt a chunk per step (the cache fixed its budgets from the whole prompt:
            # expect_prompt), then one token per step: outputs replayed after a preemption, so
            # the cache makes the same evictions again, then decoding. Whole chunks only: the
            # cache evicts after each, so where a chunk ends decides what it keeps, and a solo
            # generate ends them at multiples of prefill_chunk.
            if prompt_left > 0:
                return Work(request, min(self.prefill_chunk, prompt_left), "prefill")
            return Work(request, 1, "decode")
        count = min(self.prefill_chunk, remaining)
        kind = "decode" if remaining == 1 and request.output_ids else "prefill"
        work = Work(request, count, kind, flexible=True)
        if request.swapped is not None:
            work.resident, work.fetch_bytes = False, request.swapped.nbytes
        return work

    def _choose_batch(self) -> list[Work]:
        """The step's work: running requests' offers in the rule's order within the token
        budget, whose pages fit the free bytes. While they do not, non-resident work after the
        first piece is left to wait if that is enough; else a resident request (``_victim``)
        gives its pages back (to the host swap tier, or to recompute) and the batch is chosen
        again.
        The first piece's own request is not pushed out for it unless it has computed nothing
        (admitted early: it goes back to the queue), so a step with requests running always has
        work (one request alone fits: ``submit`` checked)."""
        while True:
            offers = self._swap_ins_allowed([self._offer(request) for request in self._running])
            ordered = self.rule.order(offers, self._step)
            budget = self.max_batch_tokens
            if self.step_time_target is not None or self.tpot_target is not None:
                ordered, budget = self._adaptive_order(ordered)
            batch = fill_batch(ordered, budget)
            if self._batch_fits(batch):
                return batch
            resident_rest = batch[:1] + [work for work in batch[1:] if work.resident]
            if len(resident_rest) < len(batch) and self._batch_fits(resident_rest):
                return resident_rest
            first = batch[0].request
            victims = [
                request
                for request in self._running
                if request.cache is not None and (request is not first or not request.computed)
            ]
            if not victims:
                return batch[:1]
            if len(victims) == 1 and victims[0] is first and len(self._running) == 1:
                # Alone, and its first step does not fit: the rest of the arena is held outside
                # this engine (a shared arena), and no request of ours can free it. It goes
                # back to the queue, first, and the caller hears why instead of a step that
                # never runs anything.
                need = self.layout.charged(self._step_need(batch[0]))
                self._preempt(first)
                raise ArenaExhausted(
                    f"request {first.id} needs {need} arena bytes for its first step, but the "
                    f"arena has {self.arena.bytes_free} of {self.arena.capacity_bytes} bytes "
                    "free and this engine holds none of the rest (another user of the arena "
                    "does); it waits, first in line, for a step after that memory is freed"
                )
            self._preempt(self._victim(victims))

    def _adaptive_order(self, ordered: list[Work]) -> tuple[list[Work], int]:
        """A step under a time target: every decode token first (stall-free batching), then the
        rest in the rule's order, within the decodes plus the prefill tokens the fitted step
        costs allow. The first prefill piece's smallest cut is a block of a lossless prefill, or
        a whole evicting chunk or hybrid prompt.

        * ``step_time_target``: the step's time. The first prefill piece always fits, at least
          its smallest cut. Where the decodes leave no room for it under ``max_batch_tokens``,
          the step is the rule's order as without a target, so no prefill waits for every
          decode to finish.
        * ``tpot_target``: the time per output token of every request decoding in the step, at
          its next token and at the step's fitted cost (``chunking.tpot_slack``). Prefill and
          recompute work wait while the step's decodes cannot spare the time of the first
          piece's smallest cut (before the costs are first fitted: while they have none to
          spare), or while the decodes leave no room for it under ``max_batch_tokens``; with no
          decodes it is not limited.

        With both, a step with decodes keeps both and one without keeps the step's time."""
        decodes = [work for work in ordered if work.kind == "decode"]
        rest = [work for work in ordered if work.kind != "decode"]
        if not rest:
            return decodes, self.max_batch_tokens
        first = rest[0]
        floor = min(first.tokens, self.spec.block_size) if first.flexible else first.tokens
        seconds, must_progress = self.step_time_target, True
        if self.tpot_target is not None:
            slack = tpot_slack(
                self.tpot_target, [work.request.stats for work in decodes], time.perf_counter()
            )
            if slack is not None:
                seconds = slack if seconds is None else min(seconds, slack)
                must_progress = False
        if seconds is None:  # a TPOT target alone, and nothing decodes
            return ordered, self.max_batch_tokens
        if must_progress and len(decodes) + floor > self.max_batch_tokens:
            return ordered, self.max_batch_tokens
        prefill = self.step_times.prefill_budget(
            seconds, len(decodes), floor if must_progress else 0, self.max_batch_tokens
        )
        if prefill < floor or (not must_progress and seconds <= 0.0):
            return decodes, self.max_batch_tokens  # the decodes cannot spare it: prefill waits
        return decodes + rest, len(decodes) + prefill

    def _swap_ins_allowed(self, offers: list[Work]) -> list[Work]:
        """With a swap tier, ``offers`` less the swapped requests' work the rule would not
        bring back yet (``may_swap_in``); all of them if that would leave nothing to run."""
        may_swap_in = getattr(self.rule, "may_swap_in", None)
        if self.swap is None or may_swap_in is None or all(work.resident for work in offers):
            return offers
        outlook = self._outlook()
        kept = [work for work in offers if work.resident or may_swap_in(work, outlook, self._step)]
        return kept or offers

    def _outlook(self) -> Outlook:
        """The arena as the swap tier's rules see it: the pages the resident requests hold or
        could take (the free bytes), in the stacked store's pages."""
        resident = tuple(request for request in self._running if request.cache is not None)
        page_bytes = len(self._probe.paged_layers) * self.geometry.block_bytes
        available = self.arena.bytes_free + sum(self._held_need(r).kv for r in resident)
        return Outlook(
            capacity_pages=available // page_bytes,
            block_size=self.spec.block_size,
            prefill_chunk=self.prefill_chunk,
            resident=resident,
        )

    def _victim(self, candidates: list[Request]) -> Request:
        """Whom to preempt: the newest request (it loses the least work when recomputed), or
        with a swap tier the rule's choice where it makes one (``choose_victim``: a swapped
        request loses no work, so the rule may weigh the bytes instead)."""
        choose = getattr(self.rule, "choose_victim", None)
        if self.swap is not None and choose is not None:
            victim = choose(candidates, self._outlook())
            if not any(victim is candidate for candidate in candidates):
                raise InvalidArgumentError(
                    f"{self.rule!r}.choose_victim returned {victim!r}, which is not one of the "
                    f"requests it was offered ({[r.id for r in candidates]})"
                )
            return victim
        return max(candidates, key=lambda request: request.id)

    def _batch_fits(self, batch: list[Work]) -> bool:
        needed = sum((self._step_need(work) for work in batch), Need())
        return self.layout.fits(needed, self._held())

    def _preempt(self, request: Request, *, swap: bool = True) -> None:
        """Take ``request``'s pages from the arena. With a host swap tier that can hold them
        (and ``swap``), they are copied there and the request keeps running, not resident.
        Otherwise they are returned and the request is queued to recompute; one that had
        computed nothing is only sent back to the queue (it loses no work: not counted as a
        preemption)."""
        if request.computed:
            request.stats.preemptions += 1
            self.preemptions += 1
        if swap and self.swap is not None and request.cache is not None and request.computed:
            swapped = self.swap.swap_out(request.cache)
            if swapped is not None:
                request.cache, request.swapped = None, swapped
                return
        self._running.remove(request)
        self._drop_cache(request)
        # Running requests are all older than waiting ones (FIFO admission): it goes first.
        position = next(
            (i for i, waiting in enumerate(self._waiting) if waiting.id > request.id),
            len(self._waiting),
        )
        self._waiting.insert(position, request)

    def _swap_in(self, request: Request) -> None:
        """Copy a swapped request's pages back into a new store on the arena (the step's need
        counted them, so they fit)."""
        store = self._new_cache()
        self.swap.swap_in(request.swapped, store)  # all or nothing
        request.cache, request.swapped = store, None

    def _drop_cache(self, request: Request) -> None:
        if request.cache is not None:
            request.cache.release()
        if request.swapped is not None:
            self.swap.free(request.swapped)
        request.cache = None
        request.swapped = None
        request.computed = 0

    def _forward(self, batch: list[Work]) -> list[torch.Tensor | None]:
        """One forward pass over the batch's tokens packed into one row; each request's logits
        at its last token when that token is its newest (it then samples), else None."""
        device = self.arena.device
        ids, positions, segments, sample_at = [], [], [], []
        start = 0
        for work in batch:
            request = work.request
            first = request.computed
            ids += request.tokens[first : first + work.tokens]
            positions += range(first, first + work.tokens)
            end = start + work.tokens
            segments.append(_Segment(request.cache, start, end))
            samples = first + work.tokens == len(request.tokens)
            sample_at.append(end - 1 if samples else None)
            start = end
        keep = [index for index in sample_at if index is not None]
        step: Any = segments
        if self._stacked:
            # Pages first, for every request (all or none each: ArenaExhausted leaves a store
            # as it was), then the step's slots, once for all layers.
            for work in batch:
                work.request.cache.reserve(work.tokens)
            step = StepContext(
                [
                    StepRequest(s.cache, s.start, s.end, w.request.computed)
                    for s, w in zip(segments, batch, strict=True)
                ],
                self._layer_index,
            )
        inputs = {
            "input_ids": torch.tensor([ids], device=device),  # [1, T]: the step, packed
            "position_ids": torch.tensor([positions], device=device),  # [1, T]
            self._cache_kwarg: _StepCache(),
            "use_cache": True,
            "logits_to_keep": torch.tensor(keep or [0], device=device),
            SEGMENTS_KWARG: step,  # reaches serve_attention in every layer
        }
        if self.model.config._attn_implementation != SERVE_ATTENTION:
            self.model.set_attn_implementation(SERVE_ATTENTION)  # switched away since
        with torch.inference_mode():
            logits = self.model(**inputs).logits[0]  # [len(keep), vocab]
        if self._stacked:
            for work in batch:  # every layer stored its tokens
                work.request.cache.tokens += work.tokens
        rows: list[torch.Tensor | None] = []
        taken = 0
        for index in sample_at:
            rows.append(None if index is None else logits[taken])
            taken += index is not None
        return rows

    def _forward_each(self, batch: list[Work]) -> list[torch.Tensor | None]:
        """Hybrid models: prefill work one forward pass per request, through its own cache; then
        every decode token in one forward pass of a batch of one row per request, each row's
        states gathered from its cache's pages and written back after (``_forward_decodes``). A
        request whose pages run out is preempted (its row None) unless it is the only one
        running."""
        rows: list[torch.Tensor | None] = [None] * len(batch)
        decodes = [i for i, work in enumerate(batch) if self._decodes_in_a_batch(work)]
        for index, work in enumerate(batch):
            if index not in decodes:
                rows[index] = self._forward_alone(work)
        decoding = [i for i in decodes if batch[i].request.cache is not None]  # not preempted
        if len(decoding) == 1:
            rows[decoding[0]] = self._forward_alone(batch[decoding[0]])
        elif decoding:
            logits = self._forward_decodes([batch[i].request for i in decoding])
            for index, row in zip(decoding, logits, strict=True):
                # A replayed output (an evicting request recomputing after a preemption) is
                # not its newest token: its row is not sampled, as _forward_alone's.
                request = batch[index].request
                newest = request.computed + batch[index].tokens == len(request.tokens)
                rows[index] = row if newest else None
        return rows

    def _decodes_in_a_batch(self, work: Work) -> bool:
        """Whether ``work`` is one decode token of a request whose states exist (its prefill
        is done) on a model whose state layers the batched decode can gather."""
        return (
            self._batched_decode
            and work.tokens == 1
            and work.request.computed > 0
            and work.request.cache is not None
        )

    def _forward_alone(self, work: Work) -> torch.Tensor | None:
        """One request's work through its own cache (the kvstack attention)."""
        if self.model.config._attn_implementation != ATTENTION_NAME:
            self.model.set_attn_implementation(ATTENTION_NAME)
        device = self.arena.device
        request = work.request
        if request.cache is None:  # preempted earlier in this step to free pages
            return None
        first = request.computed
        inputs = {
            "input_ids": torch.tensor([request.tokens[first : first + work.tokens]], device=device),
            "position_ids": torch.arange(first, first + work.tokens, device=device)[None],
            self._cache_kwarg: request.cache,
            "use_cache": True,
            "logits_to_keep": 1,
        }
        try:
            with torch.inference_mode():
                logits = self.model(**inputs).logits[0, -1]  # [vocab]
        except ArenaExhausted:
            if len(self._running) == 1:
                raise
            # This request's cache may hold part of the step: it recomputes, and the newest
            # running request gives its pages back too, so the oldest progress.
            self._preempt(request, swap=False)
            newest = max(self._running, key=lambda r: r.id)
            if newest.id > request.id:
                self._preempt(newest)
            return None
        return logits if first + work.tokens == len(request.tokens) else None

    def _forward_decodes(self, requests: list[Request]) -> list[torch.Tensor]:
        """One decode token of each request in one forward pass: input [R, 1], row r request
        r's newest token at its own position. Attention goes through ``serve_attention`` (row r
        to request r's cache); each state layer is transformers' own ``LinearAttentionLayer``
        holding the requests' states stacked [R, ...], copied back into their pages after."""
        device = self.arena.device
        step = _StepCache()
        step.layers = DynamicCache(config=self.model.config).layers
        gathered = [index for index, layer in enumerate(step.layers) if is_state_layer(layer)]
        for index in gathered:
            _gather_states(step.layers[index], [r.cache.layers[index] for r in requests])
        inputs = {
            "input_ids": torch.tensor([[r.tokens[r.computed]] for r in requests], device=device),
            "position_ids": torch.tensor([[r.computed] for r in requests], device=device),
            self._cache_kwarg: step,
            "use_cache": True,
            "logits_to_keep": 1,
            SEGMENTS_KWARG: [_Segment(r.cache, 0, 1, row) for row, r in enumerate(requests)],
        }
        if self.model.config._attn_implementation != SERVE_ATTENTION:
            self.model.set_attn_implementation(SERVE_ATTENTION)
        with torch.inference_mode():
            logits = self.model(**inputs).logits[:, -1]  # [R, vocab]
            for index in gathered:
                _scatter_states(step.layers[index], [r.cache.layers[index] for r in requests])
        return list(logits)

    def _after_token(self, request: Request, token: int) -> None:
        stats = request.stats
        stats.tokens = len(request.output_ids)
        if stats.first_token_at is None:
            stats.first_token_at = time.perf_counter()
        if token in request.stop_ids:
            self._finish_running(request, "stop")
        elif len(request.output_ids) >= request.max_new_tokens:
            self._finish_running(request, "length")

    def _finish_running(self, request: Request, reason: str) -> None:
        self._track_peak(request)
        try:
            if request.keep_kv and request.cache is not None:
                self._copy_kv_out(request)
        finally:  # a copy that fails still finishes the request and frees its pages
            self._running.remove(request)
            self._drop_cache(request)
            self._finish(request, reason)

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.stats.finished_at = time.perf_counter()

    def _track_peak(self, request: Request) -> None:
        if request.cache is None:
            return
        stats = request.cache.stats()
        request.stats.peak_pages = max(request.stats.peak_pages, int(stats["blocks_allocated"]))
        request.stats.peak_bytes = max(request.stats.peak_bytes, int(stats["peak_bytes_used"]))
        self.state_bytes = max(self.state_bytes, int(stats["bytes_used_state"]))


def _state_bytes_of(config: Any, itemsize: int) -> int:
    """One request's state-page bytes from the config, or 0 when its state shapes are not known
    here (the engine then learns them from its first request)."""
    try:
        return hybrid_geometry(config, itemsize).state_bytes_per_sequence
    except InvalidArgumentError:
        return 0


_STATE_DICTS = ("conv_states", "recurrent_states")
_STATE_FLAGS = (
    "conv_kernel_size",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
)


def _gather_states(step_layer: Any, own: list[Any]) -> None:
    """Give transformers' ``step_layer`` the states of every request's layer ``own`` (one
    row each, in arena pages) stacked into [R, ...] tensors, and the first one's flags (every
    request here has decoded before: the same flags)."""
    first = own[0]
    for name in _STATE_DICTS:
        for state_idx, state in getattr(first, name).items():
            if state is not None:  # [1, ...] each -> [R, ...]
                getattr(step_layer, name)[state_idx] = torch.cat(
                    [getattr(layer, name)[state_idx] for layer in own]
                )
    for name in _STATE_FLAGS:
        getattr(step_layer, name).update(getattr(first, name))
    step_layer.dtype, step_layer.device = first.dtype, first.device


def _scatter_states(step_layer: Any, own: list[Any]) -> None:
    """Copy row r of ``step_layer``'s updated states back into request r's pages."""
    for name in _STATE_DICTS:
        for state_idx, state in getattr(step_layer, name).items():
            if state is not None:
                for row, layer in enumerate(own):
                    getattr(layer, name)[state_idx].copy_(state[row : row + 1])
