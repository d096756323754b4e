"""The tiers benchmark: SmolLM2 decoding with most of its KV on host and disk (``TieredCache``).

Workload: SmolLM2-135M-Instruct on CPU, float32, one torch thread (the prefetcher's worker
thread runs beside it: give the process two cores, or no fetch can overlap), sdpa attention
through ``"kvstack_tiers"`` (multi-segment attention where a run says
``merge_segments=True``), which also scores the pages of every tiered run here
(``track_attention=True`` on both sides of each ratio; ``DynamicCache`` gets sdpa alone); a
benchmark prompt of ``PROMPT_TOKENS`` tokens, then ``DECODE_TOKENS`` greedy decode steps. The KV the
sequence holds at the end is ``kv_bytes``; the tiered runs give the device tier a quarter of it,
the host tier a quarter, and put the rest on disk (a temporary directory: on this machine the
page files are served from the OS page cache, so a disk read is a file read plus the page's
CRC-32C check, not a device access). Prefill is untimed; each configuration's decode steps are
timed in rounds, interleaved with the others (``time_interleaved``), medians over rounds.

Pages are ``BLOCK_SIZE`` tokens (64: 96 KiB of K and V per layer page for SmolLM2); a page is
one file on disk and one fetch, so its size sets how much per-page work (a file open, a
checksum, a queue hand-off) each byte carries. The quarter on device includes each layer's
partly filled block (the *tail*, kept on device outside the store): the device tier's budget is
a quarter of the KV minus the most the tails hold during the run (``max_tail_tokens``: 32 tokens
per layer for 64-token pages, as decode takes the 1024-token prompt to 1056), and
``tiers.device_kv_fraction.device25`` reports what the device held at the end (tier bytes plus
tails ÷ the KV).

* ``tiers.decode_speed_ratio.device25``: decode tokens/s with a quarter of the KV on device
  (cost-aware demotion) ÷ the same ``TieredCache`` with every page on device (no transfers).
  Both sides run the same code (every layer gathers its pages each step, the cache's
  default); what differs is where the pages are read from. Target >= 0.8. ``..._page16`` and ``..._page128``: the same
  ratio with 16- and 128-token pages (each against all-on-device at its own page size).
* ``tiers.decode_speed_ratio.device25_fetch_when_read``: the quarter-on-device run with
  ``prefetch_workers=0`` (no worker: each page is fetched on the model's thread when its layer
  reads it, nothing overlaps) ÷ all on device. Against ``device25`` it prices the worker: on a
  machine whose second core is busy or a hyperthread of the first, the worker's fetches can
  slow the model's thread (the GIL the worker holds between its file reads, the core they
  share) by more than they hide.
* ``tiers.decode_speed_ratio.segments_over_gathered``: the quarter-on-device run with
  ``merge_segments=True`` (each layer's device-resident, fetched and recomputed pages attended
  as separate segments, merged by log-sum-exp: AsymCache's multi-segment attention) ÷ the same
  run gathering its pages in order for one sdpa call (the default). Same pages, tiers and
  scores; what differs is the attention: a ``paged_attention`` call per segment (the cpp
  backend's decode kernel, prefill through the compiled one; each segment copied into its pool
  layout) and a merge, against one sdpa call
  over one concatenation.
* ``tiers.overlap_fraction``: in the ``device25_cost`` run (the run of
  ``tiers.decode_speed_ratio.device25``: a quarter of the KV on device, a quarter on host, the
  rest on disk, cost-aware, ``BLOCK_SIZE``-token pages, one prefetch worker), the share of the
  decode steps' fetch time the model's thread did not wait for (the prefetcher fetches the
  next layer's pages on a worker thread). Target >= 0.9. No page is demoted during that
  run's decode: a page is stored only when a block fills, and the decode steps take the
  1024-token prompt to 1055 tokens, inside its 17th 64-token block, so nothing is stored and
  nothing makes room (fetches read host and disk pages into copies freed after use; a page
  moves up only into free room). ``bytes_demoted_in_decode`` in each run's record counts it;
  the 16-token sweep run, whose decode fills one more block per layer, does demote.
* ``tiers.bytes_per_token.{lru,cost,attention}`` and ``tiers.hit_rate.{...}``: bytes read from
  host and disk per decode token, and the share of page reads the device tier served. Every
  decode step reads every page (full attention, lossless), so the rules can only differ in which
  pages sit on the device, not in how many bytes come up: these are equal by construction, and
  reported to show it. ``attention`` is KVDrive's rule with SnapKV-style placement: after
  prefill the pages that the prompt's last ``OBSERVATION_WINDOW`` queries attended to most are
  on device, the next on host, the rest on disk (``TieredCache(policy="attention",
  placement="attention")``); ``lru`` and ``cost`` leave the newest pages on device.
* ``tiers.device_attention_share.{lru,cost,attention}``: what placement does change: the share
  of each decode step's attention that falls on keys on the device, the work a step could do
  before any fetched page arrives.
* ``tiers.resume_speedup``: time to the first token of a conversation's next turn, re-prefilling
  the whole conversation with ``DynamicCache`` ÷ resuming its saved pages from disk
  (``TieredCache.resume``, then prefill of the new turn only).
* ``tiers.tokens_equal_dynamic``: of the tiered runs, those whose tokens equal DynamicCache's.
* ``tiers.recompute.*``: lossless recompute (AsymCache) when the tiers hold only half the KV: a
  quarter on device, a quarter on host, no disk, ``TieredCache(recompute_with=model)``; the
  other half is dropped and computed again from its tokens at every step that reads it (one
  forward of the model over the span from the first dropped block to the last, on the pages
  before it). ``decode_speed_ratio.cost_vs_lru``: decode tokens/s with the cost-aware rule
  (reuse probability × what dropping the page adds to the recomputed span: nothing inside it,
  else the recompute of the tokens it extends it by; ``CostAware.rank_drops``) ÷ with LRU (the
  page read longest ago first). What each step costs is the span: dropping one page at a late
  position makes every step recompute every layer from the first dropped page to it. ``tokens_per_step.{cost,lru}``: tokens recomputed per decode step (the span);
  ``dropped_fraction``: pages dropped ÷ pages, at the end of the cost-aware run;
  ``tokens_equal_dynamic``: runs whose tokens equal DynamicCache's.
  ``OVERFLOW_DECODE_TOKENS`` decode steps after the same prompt, medians of the rounds.

* ``tiers.scheduler_bytes_ratio`` and ``tiers.engine.*``: the engine with a host swap tier
  (preempted requests' pages copied to the host and back instead of recomputed) under the
  page-aware, FIFO and round-robin batch rules (``bench/tiers_engine.py`` says how).

* ``tiers.ttft_ratio.cost_vs_lru`` and ``tiers.turns.*``: a multi-turn trace on the engine,
  conversations' K/V kept between turns in a ``TurnStore`` of a fixed host budget, evicted by
  LRU or the cost-aware rule (``bench/tiers_turns.py`` says how).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.suite import CACHE_CODE, Figure, Measured, figure_table, format_value, run_suite
from kvstack.bench.tiers_engine import measure_engine
from kvstack.bench.tiers_turns import measure_turns
from kvstack.bench.timing import time_interleaved
from kvstack.tiers.attention import OBSERVATION_WINDOW
from kvstack.transformers_compat import cache_keyword

NAME = "tiers"
DEPENDS_ON = (
    *CACHE_CODE,  # multi_segment_attention, the kvstack attention, the engine's caches
    "kvstack/tiers",
    "kvstack/transformers_compat.py",
    "kvstack/serve",  # the engine runs (bench/tiers_engine.py)
    "kvstack/workloads.py",
    "kvstack/data",
    "bench/tiers_engine.py",
    "bench/tiers_turns.py",
    "bench/serve.py",  # its trace and arena sizing
    "kvstack/models.py",
    "kvstack/arena.py",  # parse_bytes
    "reference/arena.py",
    "bench/tiers.py",
    "bench/timing.py",
    "bench/prompts.py",
    "bench/data",
)
MODEL_NAME = "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)"
PROMPT_TOKENS, DECODE_TOKENS, NEXT_TURN_TOKENS = 1024, 32, 32
QUICK_PROMPT_TOKENS, QUICK_DECODE_TOKENS, QUICK_NEXT_TURN_TOKENS = 96, 4, 8
DEVICE_SHARE, HOST_SHARE = 0.25, 0.25
REPEATS = 5
BLOCK_SIZE, QUICK_BLOCK_SIZE = 64, 8  # tokens per page
SWEEP_BLOCK_SIZES, QUICK_SWEEP_BLOCK_SIZES = (16, 128), (4, 16)
OVERFLOW_DECODE_TOKENS, QUICK_OVERFLOW_DECODE_TOKENS = 8, 2
OVERFLOW_RULES = ("cost", "lru")


def _prompt(tokenizer: Any, tokens: int) -> torch.Tensor:
    from kvstack.bench.prompts import build_prompts

    for prompt in build_prompts(tokenizer):
        if prompt.num_tokens >= tokens:
            return prompt.input_ids[:, :tokens]
    raise AssertionError(f"no benchmark prompt has {tokens} tokens")


def kv_bytes_of(model: Any, tokens: int) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * tokens * config.num_key_value_heads * head_dim * itemsize


def max_tail_tokens(first: int, last: int, block_size: int) -> int:
    """The most tokens a layer's partly filled block (its tail, kept on device outside the
    store) holds while the sequence grows from ``first`` to ``last`` tokens."""
    return max(tokens % block_size for tokens in range(first, last + 1))


def device_tier_budget(
    model: Any, kv_bytes: int, share: float, block_size: int, max_tail: int
) -> int:
    """The device tier's budget that keeps the device's KV within ``share`` of ``kv_bytes``:
    the share minus the most every layer's tail holds during the run (``max_tail`` tokens)."""
    tail_reserve = kv_bytes_of(model, max_tail)  # the tails' K and V in every layer
    budget = int(share * kv_bytes) - tail_reserve
    page = kv_bytes_of(model, block_size) // model.config.num_hidden_layers
    if budget < page:
        raise AssertionError(
            f"a {share} share of {kv_bytes} KV bytes leaves {budget} bytes for the device tier "
            f"after the tails' {tail_reserve}; a {block_size}-token page needs {page}"
        )
    return budget


def measure(quick: bool, log: Callable[[str], None]) -> Measured:
    from transformers import DynamicCache

    from kvstack.models import load_smollm2
    from kvstack.tiers import ATTENTION_NAME, TieredCache

    prompt_tokens = QUICK_PROMPT_TOKENS if quick else PROMPT_TOKENS
    decode_tokens = QUICK_DECODE_TOKENS if quick else DECODE_TOKENS
    next_turn_tokens = QUICK_NEXT_TURN_TOKENS if quick else NEXT_TURN_TOKENS
    repeats = 1 if quick else REPEATS
    block_size = QUICK_BLOCK_SIZE if quick else BLOCK_SIZE
    sweep = QUICK_SWEEP_BLOCK_SIZES if quick else SWEEP_BLOCK_SIZES
    model, tokenizer = load_smollm2(progress=False)
    # sdpa's attention (or, with merge_segments, attention by segments), which for a
    # TieredCache also scores the pages (kvstack.tiers.attention); DynamicCache gets sdpa alone.
    model.set_attn_implementation(ATTENTION_NAME)
    ids = _prompt(tokenizer, prompt_tokens)
    kv_bytes = kv_bytes_of(model, prompt_tokens + decode_tokens)
    scratch = tempfile.TemporaryDirectory(prefix="kvstack-tiers-")
    runs = 0

    def tiered(
        share: float | None,
        policy: str,
        pages: int = block_size,
        placement: str = "recency",
        merge_segments: bool = False,
        prefetch_workers: int = 1,
    ) -> TieredCache:
        nonlocal runs
        runs += 1
        if share is None:  # every page on device
            return TieredCache(
                model.config,
                device_budget=2 * kv_bytes,
                host_budget=0,
                policy=policy,
                track_attention=True,
                block_size=pages,
            )
        return TieredCache(
            model.config,
            device_budget=device_tier_budget(
                model,
                kv_bytes,
                share,
                pages,
                max_tail_tokens(prompt_tokens, prompt_tokens + decode_tokens, pages),
            ),
            host_budget=int(HOST_SHARE * kv_bytes),
            disk_path=Path(scratch.name) / f"run{runs}",
            disk_budget=2 * kv_bytes,
            policy=policy,
            placement=placement,
            track_attention=True,  # every tiered run: both sides of a ratio pay for the scores
            block_size=pages,
            merge_segments=merge_segments,
            prefetch_workers=prefetch_workers,
        )

    def prefill(cache: Any) -> dict[str, Any]:
        """The prompt through ``cache`` (untimed) and its first token; the state ``steps``
        continues from, with the tiered cache's counters zeroed so they count decode only."""
        with torch.inference_mode():
            logits = model(ids, **{cache_keyword(model): cache}, use_cache=True).logits
            tokens = [int(logits[0, -1].argmax())]
            if isinstance(cache, TieredCache):  # count the decode steps only
                cache.prefetcher.transfer_seconds = cache.prefetcher.stall_seconds = 0.0
                cache.prefetcher.bytes_fetched.clear()
                cache.store.hits.clear()
                cache.store.bytes_moved.clear()  # so the moves left are the decode's
            return {"cache": cache, "tokens": tokens}

    def steps(state: dict[str, Any]) -> None:
        cache, tokens = state["cache"], state["tokens"]
        with torch.inference_mode():
            for _ in range(decode_tokens - 1):
                step = torch.tensor([[tokens[-1]]])
                logits = model(step, **{cache_keyword(model): cache}, use_cache=True).logits
                tokens.append(int(logits[0, -1].argmax()))

    configurations = {
        "dynamic": lambda: DynamicCache(config=model.config),
        "all_device": lambda: tiered(None, "cost"),
        "device25_cost": lambda: tiered(DEVICE_SHARE, "cost"),
        "device25_lru": lambda: tiered(DEVICE_SHARE, "lru"),
        "device25_attention": lambda: tiered(DEVICE_SHARE, "attention", placement="attention"),
        "device25_cost_segments": lambda: tiered(DEVICE_SHARE, "cost", merge_segments=True),
        "device25_cost_fetch_when_read": lambda: tiered(DEVICE_SHARE, "cost", prefetch_workers=0),
    }
    for pages in sweep:
        configurations[f"all_device_page{pages}"] = lambda p=pages: tiered(None, "cost", p)
        configurations[f"device25_cost_page{pages}"] = lambda p=pages: tiered(
            DEVICE_SHARE, "cost", p
        )
    prepared: dict[str, dict[str, Any]] = {}

    def prepare(round_index: int | None) -> None:  # untimed: a fresh cache, prefilled
        for name, build in configurations.items():
            old = prepared.pop(name, None)
            if old is not None and isinstance(old["cache"], TieredCache):
                old["cache"].close()
            prepared[name] = prefill(build())

    log(
        f"{prompt_tokens}-token prompt, {decode_tokens} decode steps, KV {kv_bytes / 2**20:.1f} MiB"
    )
    finished: dict[str, list[dict[str, Any]]] = {name: [] for name in configurations}

    def timed(name: str) -> Callable[[], None]:
        def run() -> None:
            steps(prepared[name])
            finished[name].append(_summary(prepared[name]))

        return run

    timings = time_interleaved(
        {name: timed(name) for name in configurations}, repeats, warmup=0, on_round=prepare
    )
    speed = {
        name: (decode_tokens - 1) / statistics.median(seconds)
        for name, seconds in timings.seconds.items()
    }
    for name, value in speed.items():
        log(f"  {name}: {value:.1f} decode tokens/s")
    last = {name: runs_[-1] for name, runs_ in finished.items()}
    figures: dict[str, Figure] = {}
    figures["tiers.decode_speed_ratio.device25"] = Figure(
        speed["device25_cost"] / speed["all_device"],
        "ratio",
        "decode tokens/s, TieredCache with 25 % of the KV on device, 25 % host, the rest disk "
        "(cost-aware) ÷ the same cache with every page on device",
        (">=", 0.8),
    )
    for pages in sweep:
        figures[f"tiers.decode_speed_ratio.device25_page{pages}"] = Figure(
            speed[f"device25_cost_page{pages}"] / speed[f"all_device_page{pages}"],
            "ratio",
            f"the same ratio with {pages}-token pages (each side at that page size)",
        )
    figures["tiers.decode_speed_ratio.device25_fetch_when_read"] = Figure(
        speed["device25_cost_fetch_when_read"] / speed["all_device"],
        "ratio",
        "the quarter-on-device run without the prefetch worker (prefetch_workers=0: each page "
        "fetched on the model's thread when its layer reads it, no overlap) ÷ every page on "
        "device",
    )
    figures["tiers.decode_speed_ratio.segments_over_gathered"] = Figure(
        speed["device25_cost_segments"] / speed["device25_cost"],
        "ratio",
        "decode tokens/s of the quarter-on-device run with merge_segments=True (each layer's "
        "device, fetched and recomputed pages attended as segments, merged by log-sum-exp) ÷ the "
        "same run gathering its pages into one K/V for sdpa (the default)",
    )
    device_run = last["device25_cost"]
    figures["tiers.device_kv_fraction.device25"] = Figure(
        (device_run["bytes_used"]["device"] + device_run["tail_bytes"]) / kv_bytes,
        "fraction",
        "KV the device held at the end of the quarter-on-device run (device tier plus the "
        "layers' partly filled blocks) ÷ the KV",
    )
    figures["tiers.decode_speed_ratio.device25_over_dynamic"] = Figure(
        speed["device25_cost"] / speed["dynamic"],
        "ratio",
        "the same tiered run ÷ DynamicCache (contiguous K/V, no pages, and no attention scores "
        "for placement)",
    )
    # Blocks a layer fills during decode: each is stored as a page, which makes room by
    # demoting; with none, decode stores nothing and demotes nothing (each run's record
    # counts the bytes it demoted in decode: bytes_demoted_in_decode).
    decode_blocks = (prompt_tokens + decode_tokens - 1) // block_size - prompt_tokens // block_size
    during_decode = (
        f"its decode fills no block ({prompt_tokens} + {decode_tokens - 1} tokens in "
        f"{block_size}-token pages), so it stores no page and demotes none: the fetches are "
        "reads of host and disk pages into copies freed after use"
        if decode_blocks == 0
        else f"its decode fills {decode_blocks} block(s) per layer, each stored as a page that "
        "demotes pages one tier down to make room, on the model's thread"
    )
    figures["tiers.overlap_fraction"] = Figure(
        statistics.median(r["overlap_fraction"] for r in finished["device25_cost"]),
        "fraction",
        "share of the decode steps' fetch time the model's thread did not wait for, in the "
        "device25_cost run (the run of tiers.decode_speed_ratio.device25: a quarter of the KV "
        f"on device, a quarter on host, the rest on disk, cost-aware, {block_size}-token pages, "
        f"one prefetch worker; median of the rounds); {during_decode}",
        (">=", 0.9),
    )
    rules = {
        "lru": "lru demotion, newest pages on device after prefill",
        "cost": "cost-aware demotion, newest pages on device after prefill",
        "attention": "attention-aware demotion, pages placed by prefill attention scores",
    }
    for policy, rule in rules.items():
        summary = last[f"device25_{policy}"]
        figures[f"tiers.bytes_per_token.{policy}"] = Figure(
            summary["fetched_bytes"] / (decode_tokens - 1),
            "bytes",
            f"bytes read from host and disk per decode token ({rule})",
        )
        figures[f"tiers.hit_rate.{policy}"] = Figure(
            summary["device_hit_rate"],
            "fraction",
            f"page reads served by the device tier during decode ({rule})",
        )
        figures[f"tiers.device_attention_share.{policy}"] = Figure(
            summary["device_attention_share"],
            "fraction",
            "share of the decode steps' attention that fell on keys on the device (pages homed "
            f"there and the layers' partly filled blocks), mean over steps and layers ({rule})",
        )
    reference = last["dynamic"]["tokens"]
    tiered_runs = [r for name, rs in finished.items() if name != "dynamic" for r in rs]
    figures["tiers.tokens_equal_dynamic"] = Figure(
        sum(r["tokens"] == reference for r in tiered_runs) / len(tiered_runs),
        "fraction",
        "of the tiered decode runs whose tokens equal DynamicCache's",
        (">=", 1.0),
    )
    for state in prepared.values():
        if isinstance(state["cache"], TieredCache):
            state["cache"].close()

    overflow_steps = QUICK_OVERFLOW_DECODE_TOKENS if quick else OVERFLOW_DECODE_TOKENS
    log(f"recompute: the tiers hold half the KV, {overflow_steps} decode steps")
    overflow = _recompute_overflow(model, ids, overflow_steps, kv_bytes, repeats, block_size)
    overflow_speed = {
        policy: overflow_steps / statistics.median(seconds)
        for policy, seconds in overflow["seconds"].items()
    }
    for policy, value in overflow_speed.items():
        log(f"  recompute, {policy}: {value:.2f} decode tokens/s")
    figures["tiers.recompute.decode_speed_ratio.cost_vs_lru"] = Figure(
        overflow_speed["cost"] / overflow_speed["lru"],
        "ratio",
        "decode tokens/s, TieredCache(recompute_with=model) with a quarter of the KV on device, "
        "a quarter on host and the rest dropped and recomputed when read: cost-aware ÷ LRU "
        "(same cache otherwise)",
    )
    for policy in OVERFLOW_RULES:
        figures[f"tiers.recompute.tokens_per_step.{policy}"] = Figure(
            overflow["runs"][policy][-1]["recomputed_tokens"] / overflow_steps,
            "tokens",
            f"tokens recomputed per decode step in that run ({policy})",
        )
    cost_run = overflow["runs"]["cost"][-1]
    figures["tiers.recompute.dropped_fraction"] = Figure(
        cost_run["pages_dropped"] / (cost_run["pages"] + cost_run["pages_dropped"]),
        "fraction",
        "pages dropped from every tier ÷ pages, at the end of the cost-aware run",
    )
    overflow_runs = [r for runs_ in overflow["runs"].values() for r in runs_]
    figures["tiers.recompute.tokens_equal_dynamic"] = Figure(
        sum(r["tokens"] == reference[: len(r["tokens"])] for r in overflow_runs)
        / len(overflow_runs),
        "fraction",
        "of the recompute runs, those whose tokens equal DynamicCache's",
        (">=", 1.0),
    )

    log("resume: a saved conversation's next turn, against re-prefilling it")
    resume_seconds, reprefill_seconds, resume_equal = _resume(
        model,
        ids,
        decode_tokens,
        next_turn_tokens,
        kv_bytes,
        Path(scratch.name),
        repeats,
        block_size,
    )
    figures["tiers.resume_speedup"] = Figure(
        reprefill_seconds / resume_seconds,
        "ratio",
        "time to the next turn's first token: DynamicCache re-prefilling the whole conversation "
        "÷ TieredCache.resume from disk plus prefill of the new turn",
    )
    figures["tiers.resume_tokens_equal"] = Figure(
        float(resume_equal),
        "fraction",
        "the resumed turn's first token equals the re-prefilled one's",
        (">=", 1.0),
    )
    scratch.cleanup()
    # Last: the engine sets the model's attention to its own.
    engine_figures, engine_workload = measure_engine(model, tokenizer, quick, log)
    figures.update(engine_figures)
    turns_figures, turns_workload = measure_turns(model, tokenizer, quick, log)
    figures.update(turns_figures)
    workload = {
        "model": MODEL_NAME,
        "dtype": "float32",
        "device": "cpu",
        "attention": (
            "sdpa (kvstack_tiers: sdpa, and page scores for every TieredCache; "
            "multi_segment_attention on the kvstack attention's fastest backend for "
            "merge_segments=True)"
        ),
        "observation_window": OBSERVATION_WINDOW,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "next_turn_tokens": next_turn_tokens,
        "kv_bytes": kv_bytes,
        "device_share": DEVICE_SHARE,
        "host_share": HOST_SHARE,
        "block_size": block_size,
        "sweep_block_sizes": list(sweep),
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "cores_available": len(os.sched_getaffinity(0)),
        "decode_tokens_per_second": speed,
        "resume_seconds": resume_seconds,
        "reprefill_seconds": reprefill_seconds,
        "overflow_decode_tokens": overflow_steps,
        "overflow_decode_tokens_per_second": overflow_speed,
        "runs": {name: rs[-1] | {"tokens": None} for name, rs in finished.items()},
        "engine": engine_workload,
        "turns": turns_workload,
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack tiers benchmark: TieredCache with most of the KV on host and disk",
        sections=[],
    )


def _summary(state: dict[str, Any]) -> dict[str, Any]:
    from kvstack.tiers import TIERS, TieredCache

    cache = state["cache"]
    summary: dict[str, Any] = {"tokens": list(state["tokens"])}
    if isinstance(cache, TieredCache):
        stats = cache.stats()
        reads = sum(stats["hits"].values())
        summary |= {
            "overlap_fraction": stats["overlap_fraction"],
            "fetched_bytes": sum(stats["fetched_bytes"].values()),
            "device_hit_rate": stats["hits"]["device"] / reads if reads else 1.0,
            "bytes_used": stats["bytes_used"],
            "peak_layer_page_bytes": stats["peak_layer_page_bytes"],
            "tail_bytes": stats["tail_bytes"],
            "disk_read_buffer_bytes": stats["disk_read_buffer_bytes"],
            "device_attention_share": stats["device_attention_share"],
            # Moves to a slower tier (demotions) during decode, from the store's counts of
            # bytes moved between tiers (zeroed after prefill).
            "bytes_demoted_in_decode": sum(
                nbytes
                for move, nbytes in stats["bytes_moved"].items()
                if TIERS.index(move.split("->")[0]) < TIERS.index(move.split("->")[1])
            ),
        }
    return summary


def _recompute_overflow(
    model: Any, ids: torch.Tensor, steps: int, kv_bytes: int, repeats: int, block_size: int
) -> dict[str, Any]:
    """Decode ``steps`` tokens after ``ids`` with tiers holding half the KV and lossless
    recompute, under each of ``OVERFLOW_RULES``, interleaved; each round starts from a fresh
    cache prefilled untimed. Returns the seconds of each rule's rounds and each round's
    tokens, recomputed tokens (decode only), and pages stored and dropped at its end."""
    from kvstack.tiers import TieredCache

    prepared: dict[str, dict[str, Any]] = {}

    def prepare(round_index: int | None) -> None:
        for policy in OVERFLOW_RULES:
            old = prepared.pop(policy, None)
            if old is not None:
                old["cache"].close()
            cache = TieredCache(
                model.config,
                device_budget=device_tier_budget(
                    model,
                    kv_bytes,
                    DEVICE_SHARE,
                    block_size,
                    max_tail_tokens(ids.shape[1], ids.shape[1] + steps, block_size),
                ),
                host_budget=int(HOST_SHARE * kv_bytes),
                policy=policy,
                block_size=block_size,
                recompute_with=model,
            )
            with torch.inference_mode():
                logits = model(ids, **{cache_keyword(model): cache}, use_cache=True).logits
            prepared[policy] = {
                "cache": cache,
                "tokens": [int(logits[0, -1].argmax())],
                "recomputed_at_prefill": cache.recomputed_tokens,
            }

    runs: dict[str, list[dict[str, Any]]] = {policy: [] for policy in OVERFLOW_RULES}

    def timed(policy: str) -> Callable[[], None]:
        def run() -> None:
            state = prepared[policy]
            cache, tokens = state["cache"], state["tokens"]
            with torch.inference_mode():
                for _ in range(steps):
                    step = torch.tensor([[tokens[-1]]])
                    logits = model(step, **{cache_keyword(model): cache}, use_cache=True).logits
                    tokens.append(int(logits[0, -1].argmax()))
            stats = cache.stats()
            runs[policy].append(
                {
                    "tokens": list(tokens),
                    "recomputed_tokens": stats["recomputed_tokens"]
                    - state["recomputed_at_prefill"],
                    "pages": stats["pages"],
                    "pages_dropped": stats["pages_dropped"],
                }
            )

        return run

    timings = time_interleaved(
        {policy: timed(policy) for policy in OVERFLOW_RULES}, repeats, warmup=0, on_round=prepare
    )
    for state in prepared.values():
        state["cache"].close()
    return {"seconds": timings.seconds, "runs": runs}


def _resume(
    model: Any,
    ids: torch.Tensor,
    decode_tokens: int,
    next_turn_tokens: int,
    kv_bytes: int,
    scratch: Path,
    repeats: int,
    block_size: int,
) -> tuple[float, float, bool]:
    """(median seconds to the next turn's first token resuming, the same re-prefilling, whether
    the two first tokens agree)."""
    from transformers import DynamicCache

    from kvstack.tiers import TieredCache

    budgets = dict(
        device_budget=device_tier_budget(
            model,
            kv_bytes,
            DEVICE_SHARE,
            block_size,
            max_tail_tokens(
                ids.shape[1], ids.shape[1] + decode_tokens + next_turn_tokens, block_size
            ),
        ),
        host_budget=int(HOST_SHARE * kv_bytes),
        disk_budget=4 * kv_bytes,
        policy="cost",
        block_size=block_size,
    )
    saved = scratch / "conversation"
    with torch.inference_mode():
        first = TieredCache(model.config, disk_path=saved, **budgets)
        conversation = model.generate(
            ids,
            **{cache_keyword(model): first},
            max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens,
            do_sample=False,
        )
        first.save(conversation)
        first.close()
    turn = torch.randint(1, 1000, (1, next_turn_tokens), generator=torch.Generator().manual_seed(0))
    whole = torch.cat([conversation, turn], dim=1)
    first_tokens: dict[str, int] = {}

    def resume() -> None:
        cache = TieredCache.resume(model.config, disk_path=saved, token_ids=whole, **budgets)
        seen = cache.get_seq_length()
        with torch.inference_mode():
            logits = model(whole[:, seen:], **{cache_keyword(model): cache}, use_cache=True).logits
        first_tokens["resume"] = int(logits[0, -1].argmax())
        cache.close()

    def reprefill() -> None:
        with torch.inference_mode():
            logits = model(
                whole, **{cache_keyword(model): DynamicCache(config=model.config)}
            ).logits
        first_tokens["reprefill"] = int(logits[0, -1].argmax())

    timings = time_interleaved({"resume": resume, "reprefill": reprefill}, repeats, warmup=1)
    return (
        statistics.median(timings.seconds["resume"]),
        statistics.median(timings.seconds["reprefill"]),
        first_tokens["resume"] == first_tokens["reprefill"],
    )


def run_tiers(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the tiers benchmark into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def readme_tables(results: dict) -> dict[str, str]:
    """The README's tiers table, from a results file."""
    w = results["workload"]
    names = sorted(results["figures"])
    speeds = w["decode_tokens_per_second"]
    workload = (
        f"Workload: {w['model']}, {w['dtype']} on {w['device']} ({w['attention']}); a "
        f"{w['prompt_tokens']}-token prompt, then {w['decode_tokens']} greedy decode steps; KV "
        f"{format_value(w['kv_bytes'] / 2**20, 'MiB')} MiB at the end, "
        f"{format_value(w['device_share'], 'fraction')} of it on device and "
        f"{format_value(w['host_share'], 'fraction')} on host in the tiered runs, the rest on "
        f"disk; pages of {w['block_size']} tokens (the sweep: "
        + ", ".join(str(b) for b in w.get("sweep_block_sizes", []))
        + f"); medians of {w['repeats']} interleaved rounds. Decode tokens/s: "
        + ", ".join(f"{name} {format_value(v, 'tok/s')}" for name, v in speeds.items())
        + f". Next turn: {w['next_turn_tokens']} tokens."
    )
    read_buffers = w.get("runs", {}).get("device25_cost", {}).get("disk_read_buffer_bytes")
    if read_buffers is not None:
        workload += (
            " The disk tier's read buffers, host memory outside the tier budgets, held "
            f"{format_value(read_buffers / 2**20, 'MiB')} MiB at the end of the device25 run."
        )
    if "overflow_decode_tokens" in w:
        workload += (
            f" Recompute runs: the same prompt, {w['overflow_decode_tokens']} decode steps, a "
            f"quarter of the KV on device and a quarter on host, the rest dropped and recomputed; "
            "decode tokens/s: "
            + ", ".join(
                f"{name} {format_value(v, 'tok/s')}"
                for name, v in w["overflow_decode_tokens_per_second"].items()
            )
            + "."
        )
    if "engine" in w:
        e = w["engine"]
        speeds = e["tokens_per_second"]
        workload += (
            f" Engine runs: {e['requests']} ShareGPT-like requests (prompts "
            f"{min(e['prompt_tokens'])}-{max(e['prompt_tokens'])} tokens, outputs "
            f"{min(e['output_tokens'])}-{max(e['output_tokens'])}) arriving at "
            f"{format_value(e['arrival_rate_per_step'], 'ratio')} per step, lossless, on an arena "
            f"of {format_value(e['arena_bytes'] / 2**20, 'MiB')} MiB "
            f"({format_value(e['arena_fraction'], 'fraction')} of their KV at its longest) with a "
            f"host tier of {format_value(e['host_tier_bytes'] / 2**20, 'MiB')} MiB; output "
            f"tokens/s swapping {format_value(speeds['swap'], 'tok/s')}, recomputing "
            f"{format_value(speeds['recompute'], 'tok/s')}, recomputing with adaptive chunking "
            f"to a {format_value(e['step_time_target_s'] * 1e3, 'ms')} ms step "
            f"{format_value(speeds['adaptive'], 'tok/s')} (every request at once; medians of "
            f"{e['repeats']} interleaved rounds)."
        )
    if "turns" in w:
        t = w["turns"]
        ttft = t["mean_later_ttft_seconds"]
        workload += (
            f" Multi-turn runs: {t['conversations']} conversations, {t['turns']} turns served "
            f"one at a time in a seeded interleaving (messages up to {t['max_message_tokens']} "
            f"tokens, {t['new_tokens']} new tokens each), a TurnStore of "
            f"{format_value(t['host_bytes'] / 2**20, 'MiB')} MiB "
            f"({format_value(t['host_fraction'], 'fraction')} of the K/V of every whole "
            f"conversation), pages of {t['block_size']} tokens; mean TTFT of later turns "
            + ", ".join(f"{side} {format_value(v * 1e3, 'ms')} ms" for side, v in ttft.items())
            + f" (medians of {t['repeats']} interleaved rounds); the cost model fitted here: "
            f"{format_value(t['cost_model']['seconds_per_token'] * 1e6, 'us')} us per token + "
            f"{format_value(t['cost_model']['seconds_per_token_per_context'] * 1e9, 'ns')} ns "
            "per token per earlier token."
        )
    return {"tiers": figure_table(results, names) + "\n\n" + workload}


__all__ = ["DEPENDS_ON", "NAME", "measure", "readme_tables", "run_tiers"]
