"""The tiers benchmark's multi-turn runs: conversations' K/V kept between their turns in a
``TurnStore`` of a fixed host budget, evicted by LRU or by AsymCache's cost-aware rule
(``tiers.ttft_ratio.cost_vs_lru``, ``tiers.turns.*``).

Workload: SmolLM2-135M-Instruct on CPU, float32, one torch thread; the engine's attention on its
default backends, lossless ``CacheSpec()``. ``CONVERSATIONS`` conversations of 2 to
``MAX_TURNS`` turns each (drawn with ``TRACE_SEED``). A turn's new message and its output cap are
ShareGPT-like lengths (``kvstack.bench.serve.trace_requests``: messages up to ``MAX_MESSAGE``
tokens, outputs of ``MAX_NEW``), its prompt is the conversation so far plus the message. The
turns of all conversations are interleaved in a seeded random order and served one at a time,
so a turn's time to first token is its own prefill, not a queue. The store's host budget is
``HOST_FRACTION`` of the K/V that every conversation's whole history would hold at its end; the
engine's arena holds the longest turn alone; its step budget and prefill chunk are the engine
runs' (``bench/tiers_engine.py``).

Three ways to serve the same turns, one after another in each of ``REPEATS`` interleaved
rounds (fresh store and engine every run):

* ``reprefill``: no store; every turn computes its whole prompt.
* ``lru``: ``TurnStore`` with ``TailFirstLRU`` (the least recently used page first; of a
  conversation, its last page first, as vLLM's prefix cache frees blocks).
* ``cost``: ``TurnStore`` with ``CostAware`` (AsymCache: reuse probability × position-aware
  recompute cost), its two constants fitted on this machine before the runs: the seconds of a
  ``CALIBRATION_TOKENS``-token prefill chunk at context 0 and at ``CALIBRATION_CONTEXT``.

A turn's TTFT runs from before the store's lookup (reading pages, recomputing holes) to its
first token. Turns after a conversation's first are the ones a store can help; the figures are
means over them, medians over the rounds:

* ``tiers.ttft_ratio.cost_vs_lru``: mean TTFT with LRU ÷ with the cost-aware rule. Same
  engine, turns, store budget and page size; what differs is which pages the store drops.
  AsymCache reports 1.9-2.03x.
* ``tiers.turns.ttft_ratio.{lru,cost}_vs_reprefill``: mean TTFT re-prefilling ÷ with the store.
* ``tiers.turns.history_tokens_computed.{lru,cost,reprefill}``: tokens of the conversation so
  far computed again per later turn (holes the store recomputed, and what the engine computed:
  the tail the store left, the last partial page, the last output), from the first round (the
  runs are deterministic).
* ``tiers.turns.tokens_equal_reprefill``: the fraction of the store runs whose every turn made
  the tokens of re-prefilling it (lossless: target 1).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvstack.bench.suite import Figure
from kvstack.transformers_compat import cache_keyword

CONVERSATIONS, QUICK_CONVERSATIONS = 8, 3
MAX_TURNS, QUICK_MAX_TURNS = 5, 3
MAX_MESSAGE, QUICK_MAX_MESSAGE = 256, 40
MAX_NEW, QUICK_MAX_NEW = 16, 4
HOST_FRACTION = 0.3
BLOCK_SIZE = 16  # tokens per page: the engine's block size
TRACE_SEED = 0
REPEATS = 3  # rounds of the three sides: each round serves every turn three times
CALIBRATION_TOKENS, CALIBRATION_CONTEXT, QUICK_CALIBRATION_CONTEXT = 128, 1024, 64
SIDES = ("reprefill", "lru", "cost")


def draw_turns(
    tokenizer: Any, quick: bool
) -> tuple[list[tuple[str, list[int], int]], dict[str, int]]:
    """The interleaved turns, (conversation, new message ids, new tokens) in serving order, and
    each conversation's whole history in tokens (what the store budget is a fraction of)."""
    from kvstack.bench.serve import trace_requests

    rng = random.Random(TRACE_SEED)
    conversations = QUICK_CONVERSATIONS if quick else CONVERSATIONS
    counts = [rng.randint(2, QUICK_MAX_TURNS if quick else MAX_TURNS) for _ in range(conversations)]
    max_message = QUICK_MAX_MESSAGE if quick else MAX_MESSAGE
    max_new = QUICK_MAX_NEW if quick else MAX_NEW
    # ShareGPT's own lengths (its 2048-token contexts: no scaling), messages cut at max_message.
    messages, _ = trace_requests(tokenizer, sum(counts), 2048, max_new, quick=quick)
    # Every turn makes its whole output (the model's EOS is off): histories do not depend on
    # where a side's tokens would stop.
    messages = [(ids[:max_message], max_new) for ids, _ in messages]
    order = [f"c{index}" for index, count in enumerate(counts) for _ in range(count)]
    rng.shuffle(order)  # a conversation's turns stay in order: each takes its next message
    turns, history = [], {}
    for name, (ids, new) in zip(order, messages, strict=True):
        turns.append((name, ids, new))
        history[name] = history.get(name, 0) + len(ids) + new
    return turns, history


def serve_turns(
    model: Any, capacity: int, turns: list[tuple[str, list[int], int]], store: Any
) -> dict[str, Any]:
    """Serve ``turns`` one at a time on a fresh engine, through ``store`` (None: re-prefill).
    Returns each turn's TTFT, outputs, whether it was a conversation's first, and how many
    tokens of its conversation so far the engine computed again (the store's holes aside)."""
    from kvstack.bench.tiers_engine import lossless_engine

    arena, engine = lossless_engine(model, capacity)
    history: dict[str, list[int]] = {}
    ttft, outputs, later, computed_again = [], [], [], []
    for name, message, new in turns:
        ids = history.get(name, []) + message
        later.append(name in history)
        arrived = time.perf_counter()
        if store is None:
            handle = engine.submit(ids, new)
        else:
            handle = store.submit(engine, name, ids, new)
        engine.run()
        ttft.append(handle.stats.first_token_at - arrived)
        # Tokens of the conversation so far that the engine computes: all but those given.
        given = 0 if handle.prefix_kv is None else handle.prefix_kv[0].shape[1]
        computed_again.append(len(history.get(name, [])) - min(given, len(history.get(name, []))))
        if store is not None:
            store.save_turn(name, handle)
        history[name] = ids + handle.output_ids
        outputs.append(handle.output_ids)
    if arena.bytes_used:
        raise AssertionError("the turns ended with arena pages still held")
    return {"ttft": ttft, "outputs": outputs, "later": later, "computed_again": computed_again}


def calibrate_cost(model: Any, context: int, log: Callable[[str], None]) -> tuple[float, float]:
    """``CostAware``'s recompute constants on this machine: seconds per token and per token per
    earlier token, from the median time of a ``CALIBRATION_TOKENS``-token forward on a
    ``DynamicCache`` at context 0 and at ``context`` (sdpa: the store's hole recompute)."""
    from transformers import DynamicCache

    backbone = model.model
    cache_kwarg = cache_keyword(backbone)

    def chunk_seconds(at: int) -> float:
        ids = torch.randint(
            100, 1000, (1, at + CALIBRATION_TOKENS), generator=torch.Generator().manual_seed(0)
        )
        times = []
        for _ in range(3):
            cache = DynamicCache(config=model.config)
            with torch.no_grad():
                if at:
                    backbone(input_ids=ids[:, :at], use_cache=True, **{cache_kwarg: cache})
                began = time.perf_counter()
                backbone(input_ids=ids[:, at:], use_cache=True, **{cache_kwarg: cache})
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    attention = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        short, long = chunk_seconds(0), chunk_seconds(context)
    finally:
        model.set_attn_implementation(attention)
    tokens = CALIBRATION_TOKENS
    # seconds(chunk at p) = tokens * (a + b * (p + tokens / 2))
    per_context = max(0.0, (long - short) / (tokens * context))
    per_token = max(1e-9, short / tokens - per_context * tokens / 2)
    log(
        f"turns: cost model {per_token * 1e6:.1f} us per token + "
        f"{per_context * 1e9:.2f} ns per token per earlier token"
    )
    return per_token, per_context


def measure_turns(
    model: Any, tokenizer: Any, quick: bool, log: Callable[[str], None]
) -> tuple[dict[str, Figure], dict[str, Any]]:
    """The figures and the workload record of the multi-turn runs (see the module doc)."""
    import kvstack.serve  # noqa: F401  (registers the engine's attention)
    from kvstack.bench.serve import largest_request_bytes
    from kvstack.serve import CacheSpec
    from kvstack.tiers import CostAware, TailFirstLRU, TurnStore

    turns, history = draw_turns(tokenizer, quick)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # K and V of every layer, in the dtype the model's K/V are (the store's pages are).
    itemsize = next(model.parameters()).dtype.itemsize
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * itemsize
    whole_kv = per_token * sum(history.values())
    host_bytes = int(HOST_FRACTION * whole_kv)
    longest = max(history.values())
    capacity = largest_request_bytes(model, CacheSpec(), [(list(range(longest)), 1)])
    per_token_s, per_context_s = calibrate_cost(
        model, QUICK_CALIBRATION_CONTEXT if quick else CALIBRATION_CONTEXT, log
    )

    def store_for(side: str) -> Any:
        if side == "reprefill":
            return None
        rule = (
            TailFirstLRU()
            if side == "lru"
            else CostAware(
                seconds_per_token=per_token_s, seconds_per_token_per_context=per_context_s
            )
        )
        return TurnStore(model, host_bytes=host_bytes, block_size=BLOCK_SIZE, rule=rule)

    # Untimed warm-up: the first calls compile the engine's attention for each shape.
    serve_turns(model, capacity, turns[: min(6, len(turns))], store_for("lru"))

    repeats = 1 if quick else REPEATS
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    stores: dict[str, Any] = {}
    for round_index in range(repeats):
        # Each round starts with the next side: none is always first, or always after another.
        for side in SIDES[round_index % len(SIDES) :] + SIDES[: round_index % len(SIDES)]:
            log(f"turns: round {round_index + 1}/{repeats}, {side}, {len(turns)} turns")
            store = store_for(side)
            runs[side].append(serve_turns(model, capacity, turns, store))
            if round_index == 0 and store is not None:
                stores[side] = store

    def mean_later_ttft(run: dict[str, Any]) -> float:
        return statistics.mean(
            t for t, later in zip(run["ttft"], run["later"], strict=True) if later
        )

    ttft = {side: statistics.median(mean_later_ttft(r) for r in runs[side]) for side in SIDES}
    later_turns = sum(runs["reprefill"][0]["later"])
    # The engine's share (first round: the runs are deterministic) plus the store's holes.
    computed_again = {
        side: (
            sum(runs[side][0]["computed_again"])
            + (stores[side].stats.recomputed_tokens if side in stores else 0)
        )
        / later_turns
        for side in SIDES
    }
    reference = runs["reprefill"][0]["outputs"]
    store_runs = [r for side in ("lru", "cost") for r in runs[side]]
    equal = sum(r["outputs"] == reference for r in store_runs) / len(store_runs)

    what = (
        f"mean time to first token of a conversation's later turns, {len(turns)} turns of "
        f"{len(history)} conversations served one at a time, TurnStore of "
        f"{HOST_FRACTION:g} x their whole K/V"
    )
    figures = {
        "tiers.ttft_ratio.cost_vs_lru": Figure(
            ttft["lru"] / ttft["cost"],
            "ratio",
            f"{what}: TailFirstLRU ÷ CostAware (fitted); same engine, turns and budget",
            (">=", 1.9),
        ),
        "tiers.turns.tokens_equal_reprefill": Figure(
            equal,
            "fraction",
            "store runs whose every turn made the tokens of re-prefilling its whole prompt",
            (">=", 1.0),
        ),
    }
    for side in ("lru", "cost"):
        figures[f"tiers.turns.ttft_ratio.{side}_vs_reprefill"] = Figure(
            ttft["reprefill"] / ttft[side],
            "ratio",
            f"{what}: re-prefilling every prompt ÷ the store with {side}",
        )
    for side in SIDES:
        figures[f"tiers.turns.history_tokens_computed.{side}"] = Figure(
            computed_again[side],
            "tokens",
            "tokens of the conversation so far computed again per later turn"
            + (
                ""
                if side == "reprefill"
                else " (holes the store recomputed + what the engine computed)"
            ),
        )
    workload = {
        "conversations": len(history),
        "turns": len(turns),
        "later_turns": later_turns,
        "history_tokens": history,
        "max_message_tokens": QUICK_MAX_MESSAGE if quick else MAX_MESSAGE,
        "new_tokens": QUICK_MAX_NEW if quick else MAX_NEW,
        "host_fraction": HOST_FRACTION,
        "host_bytes": host_bytes,
        "whole_kv_bytes": whole_kv,
        "arena_bytes": capacity,
        "block_size": BLOCK_SIZE,
        "repeats": repeats,
        "cost_model": {
            "seconds_per_token": per_token_s,
            "seconds_per_token_per_context": per_context_s,
        },
        "mean_later_ttft_seconds": ttft,
        "mean_later_ttft_seconds_of_repeats": {
            side: [mean_later_ttft(r) for r in runs[side]] for side in SIDES
        },
        "store_stats": {
            side: vars(store.stats) | {"drops": store.store.drops} for side, store in stores.items()
        },
    }
    return figures, workload
