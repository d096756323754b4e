"""The vToken benchmark: token eviction with and without reclamation, on the real model.

vToken's claim: when an eviction policy (H2O, Scissorhands, ...) drops tokens, a token table
plus repacking turns the freed slots into freed blocks, so a request *retains* fewer KV blocks
than Naive-Evict (the same victims, memory never reclaimed), at a negligible cost in time.
Measured in one run on SmolLM2-135M-Instruct (``kvstack.models``) over the chat prompts of
``bench/prompts.py`` (real passages that ship in ``bench/data/``), greedy, ``new_tokens`` new
tokens per request (EOS suppressed until then, so every request generates exactly that many),
fp32 on CPU. The block figures run each configuration over all prompts as one left-padded batch
(``batches``: lengths within ``new_tokens`` of each other, so padding leaves no trace in any
request's blocks); the timed figures run batch 1.

Figures, with targets:

    vtoken.blocks_over_ideal      worst over all reclaim runs of retained blocks /
        sum over tables of ceil(live / block_size)                 <= 1.05
        The figure that measures repacking: 1 means every table is packed tight.
    vtoken.retained_block_reduction.{policy}.{ratio}   mean over prompts of
        1 - blocks(reclaim) / blocks(Naive-Evict) at the end of generation (+ .min / .max).
        No target: every table ends at its budget b = ceil(r P) whatever it keeps, so this
        follows from the budget alone, about 1 - r P / (P + N) (P prompt, N new tokens);
        ``vtoken.retained_block_reduction.budget_formula.{ratio}`` is that formula's mean
        over the same prompts, reported beside it.
    vtoken.paged_over_dynamic     median over prompts of tokens/s of PagedCache (kvstack
        attention, no eviction: the same attention work) / tokens/s of DynamicCache (sdpa),
        which must give the same tokens                             >= 0.9
        What the token tables themselves cost.
    vtoken.evicting_over_dynamic.{policy}.{ratio}   the same for TokenTableCache(policy,
        ratio): half the attention work, plus eviction and repacking  (h2o: >= 0.9)
    vtoken.repack_time_fraction   sum over the timed H2O runs of the time spent repacking
        (deciding, planning and copying: stats()["repack_seconds"]) / their generate time
                                                                    <= 0.03   (+ .max)
    vtoken.paged_tokens_equal_dynamic   fraction of prompts on which PagedCache generated
        exactly DynamicCache's tokens                               >= 1
    vtoken.prefill_ratio.{snapkv,tova,streaming,h2o}   median over prompts of the wall time of
        a ``generate`` of ``PREFILL_NEW_TOKENS`` new tokens (so the prompt's prefill dominates)
        with TokenTableCache(policy, ratio 0.5) / the same with DynamicCache (sdpa), batch 1
                          (snapkv, tova, streaming: <= 1.1; h2o: <= 1.5)
        What prefill through kvstack's attention (with the attention weights the policies read)
        costs over SDPA's prefill.

Blocks are exact counts (``TokenTableCache.stats()["blocks_allocated"]``, all 30 layers).
Per-head policies (H2O, Scissorhands) keep one token table per KV head, so their blocks hold one
head's K/V and whole-row policies' (Random) hold all three; each reduction is a ratio within one
policy, so the unit cancels. Reclaim and Naive-Evict choose the same victims, so they must
generate the same tokens: every pair is compared and a mismatch stops the run.

Timing: ``kvstack.bench.timing.time_interleaved`` — one warm-up generate per configuration (a
short one, so torch.compile time is excluded), then one round per prompt in which every
configuration generates once, the order rotating from round to round; tokens/s is new tokens /
wall time of ``generate`` (prefill included). The prefill figures are a second interleaved
phase of the same kind (``_prefill_phase``), whose warm-up is on the first prompt only: a
prompt of another length that compiled again would be timed compiling.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.prompts import Prompt, build_prompts
from kvstack.bench.suite import (
    CACHE_CODE,
    Figure,
    Measured,
    figure_table,
    format_value,
    run_suite,
)
from kvstack.bench.timing import time_interleaved
from kvstack.errors import KVStackError
from kvstack.policies import (
    H2O,
    TOVA,
    EvictionPolicy,
    RandomEviction,
    Scissorhands,
    SnapKV,
    StreamingLLM,
)
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD

NAME = "vtoken"
DEPENDS_ON = (
    *CACHE_CODE,
    "kvstack/models.py",
    "bench/vtoken.py",
    "bench/prompts.py",
    "bench/timing.py",
    "bench/data",
)
MODEL_NAME = "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)"

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "h2o": lambda: H2O(),
    "scissorhands": lambda: Scissorhands(),
    "random": lambda: RandomEviction(seed=0),
}

SPEED_RATIO = 0.5  # the ratio every policy is timed at against DynamicCache
# The prefill figures: policies by the attention weights their prefill needs (SnapKV its
# observation window's queries, TOVA the last query, StreamingLLM none, H2O every query), each
# timed at SPEED_RATIO over a generate of a few tokens, so that the prompt's prefill dominates.
PREFILL_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "snapkv": lambda: SnapKV(),
    "tova": lambda: TOVA(),
    "streaming": lambda: StreamingLLM(),
    "h2o": lambda: H2O(),
}
PREFILL_NEW_TOKENS = 8
VTOKEN_REPORTED = (0.272, 0.723)  # vToken's range of retained-block reduction vs Naive-Evict


@dataclass(frozen=True)
class VTokenConfig:
    policies: tuple[str, ...]
    ratios: tuple[float, ...]  # budget per table = ceil(ratio * prompt tokens)
    new_tokens: int
    warmup_new_tokens: int  # the warm-up generate of each timed configuration
    quick: bool
    block_size: int = 16
    repack_threshold: float = DEFAULT_WASTE_THRESHOLD


FULL = VTokenConfig(
    policies=("h2o", "scissorhands", "random"),
    ratios=(0.3, 0.5, 0.7),
    new_tokens=128,
    warmup_new_tokens=16,
    quick=False,
)
# Two short prompts, eight new tokens, one ratio: runs the whole pipeline in about a minute.
QUICK = VTokenConfig(
    policies=("h2o", "scissorhands", "random"),
    ratios=(SPEED_RATIO,),
    new_tokens=8,
    warmup_new_tokens=4,
    quick=True,
)

TARGETS = {
    "vtoken.blocks_over_ideal": ("<=", 1.05),
    "vtoken.paged_over_dynamic": (">=", 0.9),
    f"vtoken.evicting_over_dynamic.h2o.{SPEED_RATIO:g}": (">=", 0.9),
    "vtoken.repack_time_fraction": ("<=", 0.03),
    "vtoken.paged_tokens_equal_dynamic": (">=", 1.0),
    "vtoken.prefill_ratio.snapkv": ("<=", 1.1),
    "vtoken.prefill_ratio.tova": ("<=", 1.1),
    "vtoken.prefill_ratio.streaming": ("<=", 1.1),
    "vtoken.prefill_ratio.h2o": ("<=", 1.5),
}


@dataclass
class Run:
    """One request (prompt) of one ``generate`` with one cache configuration, and what its
    cache held at the end. Requests of one batched ``generate`` share the ``generate_repack*``
    totals. ``seconds`` is set for the timed (batch-1) runs only."""

    prompt: str
    prompt_tokens: int
    cache: str  # "token_table", "paged" or "dynamic"
    policy: str | None
    ratio: float | None
    reclaim: bool | None
    new_tokens: int
    batch_size: int  # requests in the generate this one was part of
    seconds: float | None = None  # wall time of that generate, from time_interleaved
    blocks: int = 0  # blocks held by this request's token tables, all layers, at the end
    ideal_blocks: int = 0  # sum over those tables of ceil(live / block_size)
    live_tokens: float = 0.0  # token-equivalents over all layers (per-head tables: / heads)
    bytes: int = 0  # K and V bytes of the blocks held
    generate_repacks: int = 0
    generate_repack_seconds: float = 0.0
    timed: bool = False  # part of the interleaved speed comparison (batch 1)
    same_tokens_as_dynamic: bool | None = None  # timed PagedCache runs: checked

    @property
    def tokens_per_s(self) -> float:
        return self.batch_size * self.new_tokens / self.seconds


# --------------------------------------------------------------------------- one generate
def _left_pad(prompts: list[Prompt], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask [B, T_max], padded on the left (decoder-only generation)."""
    width = max(p.num_tokens for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, p in enumerate(prompts):
        ids[row, width - p.num_tokens :] = p.input_ids[0]
        mask[row, width - p.num_tokens :] = 1
    return ids, mask


def _generate(
    model: Any, prompts: list[Prompt], cache: Any, attn: str, new_tokens: int
) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens per prompt, as one batch;
    the new token ids [B, new_tokens]."""
    model.set_attn_implementation(attn)
    ids, mask = _left_pad(prompts, model.generation_config.pad_token_id)
    with warnings.catch_warnings():
        # transformers 5.24 renames past_key_values to cache= (FutureWarning); 5.17 knows only
        # the old name, so keep it and silence the notice.
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # suppress EOS: every request does the same work
            do_sample=False,
        )
    generated = out[:, ids.shape[1] :]  # [B, new_tokens]
    if generated.shape[1] != new_tokens:
        raise KVStackError(
            f"prompts {[p.name for p in prompts]}: generate returned {generated.shape[1]} new "
            f"tokens, expected {new_tokens}"
        )
    return generated


def batches(prompts: list[Prompt], new_tokens: int, max_batch: int = 8) -> list[list[Prompt]]:
    """Group prompts (by length) into batches whose lengths differ by at most ``new_tokens``.

    Why that bound: a batch is left-padded, and the padding is evicted at prefill with its
    slots released, in both modes. Appends fill released slots first, so once a request has
    generated as many tokens as it had padding, those slots are all refilled, and it ends
    holding exactly the blocks it would hold alone (Naive-Evict included, which never releases
    its own victims). A longer gap would leave Naive-Evict holding blocks for padding.
    """
    groups: list[list[Prompt]] = []
    for p in sorted(prompts, key=lambda p: p.num_tokens):
        group = groups[-1] if groups else None
        if (
            group is None
            or len(group) == max_batch
            or p.num_tokens - group[0].num_tokens > new_tokens
        ):
            groups.append([p])
        else:
            group.append(p)
    return groups


def token_table_generate(
    model: Any,
    prompts: list[Prompt],
    config: VTokenConfig,
    policy: str,
    ratio: float,
    reclaim: bool,
    new_tokens: int,
) -> tuple[torch.Tensor, list[Run]]:
    """One batched ``generate`` with a ``TokenTableCache``; (new ids [B, new], a Run per row).

    Checks what the figures rely on: the rows' blocks add up to ``stats()["blocks_allocated"]``,
    and every table ends holding exactly its budget, ceil(ratio x its own prompt length) (so
    padding neither counted towards a budget nor stayed live).
    """
    from kvstack.hf import TokenTableCache

    cache = TokenTableCache(
        model.config,
        POLICIES[policy](),
        ratio=ratio,
        block_size=config.block_size,
        repack_threshold=config.repack_threshold,
        reclaim=reclaim,
    )
    tokens = _generate(model, prompts, cache, "kvstack", new_tokens)
    stats = cache.stats()
    runs = []
    for row, p in enumerate(prompts):
        blocks = ideal = block_bytes = 0
        live = 0.0
        budget = cache.budget_for(p.num_tokens)
        for layer in cache.paged_layers:
            pool = layer.pool
            block_kv_bytes = (
                2 * pool.block_size * pool.num_kv_heads * pool.head_dim * pool.key.element_size()
            )
            mine = range(row * layer.groups, (row + 1) * layer.groups)  # tables are row-major
            for index in mine:
                table_live, table_blocks = (
                    layer.batch.num_live[index],
                    len(layer.batch.blocks[index]),
                )
                if table_live != budget:
                    raise KVStackError(
                        f"prompt {p.name!r}, {policy} at ratio {ratio:g}: a table of layer "
                        f"{layer.layer_idx} holds {table_live} live tokens, expected its "
                        f"budget {budget} = ceil({ratio:g} x {p.num_tokens})"
                    )
                blocks += table_blocks
                ideal += math.ceil(table_live / config.block_size)
                block_bytes += table_blocks * block_kv_bytes
            live += sum(layer.batch.num_live[index] for index in mine) / layer.groups
        runs.append(
            Run(
                prompt=p.name,
                prompt_tokens=p.num_tokens,
                cache="token_table",
                policy=policy,
                ratio=ratio,
                reclaim=reclaim,
                new_tokens=new_tokens,
                batch_size=len(prompts),
                blocks=blocks,
                ideal_blocks=ideal,
                live_tokens=live,
                bytes=block_bytes,
                generate_repacks=int(stats["repacks"]),
                generate_repack_seconds=float(stats["repack_seconds"]),
            )
        )
    if sum(run.blocks for run in runs) != stats["blocks_allocated"]:
        raise KVStackError(
            f"rows hold {sum(run.blocks for run in runs)} blocks in all, but stats() says "
            f"{stats['blocks_allocated']}"
        )
    return tokens, runs


def _check_same_tokens(
    prompts: list[Prompt], policy: str, ratio: float, reclaimed: torch.Tensor, naive: torch.Tensor
) -> None:
    if torch.equal(reclaimed, naive):
        return
    row, first = (int(i) for i in (reclaimed != naive).nonzero()[0])
    raise KVStackError(
        f"prompt {prompts[row].name!r}, {policy} at ratio {ratio:g}: reclaim=True and "
        f"Naive-Evict generated different tokens (first difference at new token {first}: "
        f"{int(reclaimed[row, first])} vs {int(naive[row, first])}); they evict the same "
        "victims, so reclamation must not change what the model reads"
    )


def _single_run(model: Any, prompt: Prompt, config: VTokenConfig, name: str, new_tokens: int):
    """One batch-1 generate of speed configuration ``name``: "dynamic", "paged" or a policy
    (at ``SPEED_RATIO``); (new ids [1, new_tokens], its Run without seconds)."""
    from transformers import DynamicCache

    from kvstack.hf import PagedCache

    if name in POLICIES:
        tokens, (run,) = token_table_generate(
            model, [prompt], config, name, SPEED_RATIO, True, new_tokens
        )
        return tokens, run
    if name == "dynamic":
        cache, attn = DynamicCache(config=model.config), "sdpa"
    else:
        cache, attn = PagedCache(model.config, block_size=config.block_size), "kvstack"
    tokens = _generate(model, [prompt], cache, attn, new_tokens)
    run = Run(prompt.name, prompt.num_tokens, name, None, None, None, new_tokens, 1)
    return tokens, run


def _speed_phase(
    model: Any, prompts: list[Prompt], config: VTokenConfig, log: Callable[[str], None]
) -> list[Run]:
    """Batch 1, every speed configuration once per prompt, interleaved (``time_interleaved``)."""
    names = ["dynamic", "paged", *config.policies]
    current: dict[str, Any] = {}
    produced: dict[str, list[tuple[torch.Tensor, Run]]] = {name: [] for name in names}

    def on_round(index: int | None) -> None:
        if index is None:  # warm-up: a short generate on the first prompt
            current.update(prompt=prompts[0], new_tokens=config.warmup_new_tokens, timed=False)
        else:
            current.update(prompt=prompts[index], new_tokens=config.new_tokens, timed=True)
            if index:
                log(f"speed {index}/{len(prompts)} done")

    def timed_generate(name: str) -> Callable[[], None]:
        def call() -> None:
            result = _single_run(model, current["prompt"], config, name, current["new_tokens"])
            if current["timed"]:
                produced[name].append(result)

        return call

    log(f"speed: {', '.join(names)}; one warm-up generate each, then one round per prompt")
    timings = time_interleaved(
        {name: timed_generate(name) for name in names},
        repeats=len(prompts),
        warmup=1,
        on_round=on_round,
    )
    runs = []
    for name in names:
        for (_, run), seconds in zip(produced[name], timings.seconds[name], strict=True):
            run.seconds, run.timed = seconds, True
            runs.append(run)
    # PagedCache never evicts: it must generate exactly DynamicCache's tokens (a figure with a
    # target, so a mismatch is reported rather than hidden or fatal after the whole run).
    for (dyn_tokens, _), (paged_tokens, paged_run) in zip(
        produced["dynamic"], produced["paged"], strict=True
    ):
        paged_run.same_tokens_as_dynamic = torch.equal(dyn_tokens, paged_tokens)
    return runs


def _prefill_phase(
    model: Any, prompts: list[Prompt], config: VTokenConfig, log: Callable[[str], None]
) -> dict[str, list[float]]:
    """Batch 1, ``PREFILL_NEW_TOKENS`` new tokens: DynamicCache (sdpa) and each of
    ``PREFILL_POLICIES`` at ``SPEED_RATIO``, interleaved, one round per prompt after one
    warm-up round on the first prompt. Returns each configuration's seconds per prompt."""
    from transformers import DynamicCache

    from kvstack.hf import TokenTableCache

    current: dict[str, Prompt] = {}

    def on_round(index: int | None) -> None:
        current["prompt"] = prompts[0 if index is None else index]

    def timed_generate(name: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            if name == "dynamic":
                cache, attn = DynamicCache(config=model.config), "sdpa"
            else:
                policy = PREFILL_POLICIES[name]()
                cache = TokenTableCache(
                    model.config, policy, ratio=SPEED_RATIO, block_size=config.block_size
                )
                attn = "kvstack"
            return _generate(model, [current["prompt"]], cache, attn, PREFILL_NEW_TOKENS)

        return call

    names = ["dynamic", *PREFILL_POLICIES]
    log(f"prefill: {', '.join(names)}, {PREFILL_NEW_TOKENS} new tokens; one round per prompt")
    timings = time_interleaved(
        {name: timed_generate(name) for name in names},
        repeats=len(prompts),
        warmup=1,
        on_round=on_round,
    )
    return timings.seconds


def _blocks_phase(
    model: Any, groups: list[list[Prompt]], config: VTokenConfig, log: Callable[[str], None]
) -> list[Run]:
    """Every policy x ratio, reclaim and Naive-Evict, every prompt (batched)."""
    runs: list[Run] = []
    cells = [(p, r) for p in config.policies for r in config.ratios]
    done, total = 0, len(cells) * len(groups)
    for policy, ratio in cells:
        for group in groups:
            reclaimed_tokens, reclaim_runs = token_table_generate(
                model, group, config, policy, ratio, True, config.new_tokens
            )
            naive_tokens, naive_runs = token_table_generate(
                model, group, config, policy, ratio, False, config.new_tokens
            )
            _check_same_tokens(group, policy, ratio, reclaimed_tokens, naive_tokens)
            runs += reclaim_runs + naive_runs
            done += 1
            reduction = 1 - sum(r.blocks for r in reclaim_runs) / sum(r.blocks for r in naive_runs)
            log(
                f"blocks {done}/{total} {policy} {ratio:g}, {len(group)} prompts: "
                f"{reduction:.1%} fewer blocks with reclaim, same tokens"
            )
    return runs


# --------------------------------------------------------------------------- the whole run
def measure(quick: bool, log: Callable[[str], None]) -> Measured:
    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
    from kvstack.models import load_smollm2

    config = QUICK if quick else FULL
    # fresh: this run switches the attention implementation between generates.
    model, tokenizer = load_smollm2(progress=True, fresh=True)
    prompts = build_prompts(tokenizer, quick=config.quick)
    groups = batches(prompts, config.new_tokens)
    log(
        f"{len(prompts)} prompts ({', '.join(str(p.num_tokens) for p in prompts)} tokens) in "
        f"{len(groups)} batch(es), {config.new_tokens} new tokens each; torch threads "
        f"{torch.get_num_threads()}"
    )
    runs = _speed_phase(model, prompts, config, log)
    prefill_seconds = _prefill_phase(model, prompts, config, log)
    runs += _blocks_phase(model, groups, config, log)
    figures = _figures(config, prompts, runs)
    figures.update(_prefill_figures(prompts, prefill_seconds))
    workload = {
        "model": MODEL_NAME,
        "dtype": "float32",
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "prompts": {p.name: p.num_tokens for p in prompts},
        "new_tokens": config.new_tokens,
        "batch": {"speed": 1, "blocks": [len(g) for g in groups]},
        "policies": list(config.policies),
        "ratios": list(config.ratios),
        "speed_ratio": SPEED_RATIO,
        "block_size": config.block_size,
        "repack_threshold": config.repack_threshold,
        "warmup_new_tokens": config.warmup_new_tokens,
        "timer": "kvstack.bench.timing.time_interleaved: 1 warm-up round, 1 round per prompt",
        "prefill": {
            "new_tokens": PREFILL_NEW_TOKENS,
            "ratio": SPEED_RATIO,
            "policies": list(PREFILL_POLICIES),
            "seconds": {
                name: dict(zip((p.name for p in prompts), seconds, strict=True))
                for name, seconds in prefill_seconds.items()
            },
        },
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack vToken benchmark: retained blocks with and without reclamation",
        sections=_sections(config, prompts, groups, runs, figures, prefill_seconds),
        plot=lambda path: _plot(config, prompts, runs, figures, path),
        extra_files={
            "runs.json": json.dumps([asdict(run) for run in runs], indent=1, sort_keys=True) + "\n"
        },
    )


def run_vtoken(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the vToken benchmark into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def _find(runs: list[Run], prompt: str, policy: str, ratio: float, reclaim: bool) -> Run:
    """The block-matrix run of this prompt and configuration (not the timed batch-1 one)."""
    for run in runs:
        key = (run.prompt, run.policy, run.ratio, run.reclaim)
        if not run.timed and key == (prompt, policy, ratio, reclaim):
            return run
    raise KeyError((prompt, policy, ratio, reclaim))


def _timed(runs: list[Run], prompt: str, cache: str) -> Run:
    """The timed batch-1 run of ``prompt`` with speed configuration ``cache``."""
    for run in runs:
        name = run.policy if run.cache == "token_table" else run.cache
        if run.timed and run.prompt == prompt and name == cache:
            return run
    raise KeyError((prompt, cache))


# --------------------------------------------------------------------------- figures
def _figures(config: VTokenConfig, prompts: list[Prompt], runs: list[Run]) -> dict[str, Figure]:
    figures: dict[str, Figure] = {}

    def add(name: str, value: float, unit: str, description: str) -> None:
        figures[name] = Figure(float(value), unit, description, TARGETS.get(name))

    n = config.new_tokens
    for ratio in config.ratios:
        add(
            f"vtoken.retained_block_reduction.budget_formula.{ratio:g}",
            statistics.fmean(1 - ratio * p.num_tokens / (p.num_tokens + n) for p in prompts),
            "percent",
            f"1 - r P / (P + N) at r = {ratio:g}, mean over prompts: what the budget alone "
            "predicts for the reduction below",
        )
    for policy in config.policies:
        for ratio in config.ratios:
            values = [
                1.0
                - _find(runs, p.name, policy, ratio, True).blocks
                / _find(runs, p.name, policy, ratio, False).blocks
                for p in prompts
            ]
            name = f"vtoken.retained_block_reduction.{policy}.{ratio:g}"
            what = (
                f"1 - blocks(reclaim) / blocks(Naive-Evict) at the end of generation, {policy} "
                f"at ratio {ratio:g}"
            )
            add(name, statistics.fmean(values), "percent", f"{what}, mean over prompts")
            add(f"{name}.min", min(values), "percent", f"{what}, lowest prompt")
            add(f"{name}.max", max(values), "percent", f"{what}, highest prompt")

    over_ideal = [run.blocks / run.ideal_blocks for run in runs if run.reclaim and run.ideal_blocks]
    what = "retained blocks / sum over tables of ceil(live / block_size), reclaim runs"
    add("vtoken.blocks_over_ideal", max(over_ideal), "ratio", f"{what}, worst")
    add("vtoken.blocks_over_ideal.mean", statistics.fmean(over_ideal), "ratio", f"{what}, mean")

    def ratio_over_dynamic(cache: str) -> float:
        return statistics.median(
            _timed(runs, p.name, cache).tokens_per_s / _timed(runs, p.name, "dynamic").tokens_per_s
            for p in prompts
        )

    add(
        "vtoken.paged_over_dynamic",
        ratio_over_dynamic("paged"),
        "ratio",
        "tokens/s of PagedCache (kvstack attention, no eviction) / DynamicCache (sdpa), "
        "median over prompts: the same attention work, so the cost of the token tables",
    )
    for policy in config.policies:
        add(
            f"vtoken.evicting_over_dynamic.{policy}.{SPEED_RATIO:g}",
            ratio_over_dynamic(policy),
            "ratio",
            f"tokens/s of TokenTableCache({policy}, ratio {SPEED_RATIO:g}) / DynamicCache "
            "(sdpa), median over prompts: less attention work, plus eviction and repacking",
        )
    for cache in ("dynamic", "paged", *config.policies):
        add(
            f"vtoken.tokens_per_s.{cache}",
            statistics.median(_timed(runs, p.name, cache).tokens_per_s for p in prompts),
            "tokens/s",
            f"{cache}, median over prompts",
        )
    paged = [_timed(runs, p.name, "paged") for p in prompts]
    add(
        "vtoken.paged_tokens_equal_dynamic",
        sum(bool(run.same_tokens_as_dynamic) for run in paged) / len(paged),
        "fraction",
        "prompts on which PagedCache generated exactly DynamicCache's greedy tokens",
    )

    timed = [_timed(runs, p.name, "h2o") for p in prompts if "h2o" in config.policies]
    if timed:  # batch 1: the generate's repack time is this request's
        add(
            "vtoken.repack_time_fraction",
            sum(r.generate_repack_seconds for r in timed) / sum(r.seconds for r in timed),
            "fraction",
            f"time deciding, planning and copying repacks / generate time, TokenTableCache(h2o, "
            f"{SPEED_RATIO:g}), summed over prompts",
        )
        add(
            "vtoken.repack_time_fraction.max",
            max(r.generate_repack_seconds / r.seconds for r in timed),
            "fraction",
            "the same, worst prompt",
        )
    return figures


def _prefill_figures(prompts: list[Prompt], seconds: dict[str, list[float]]) -> dict[str, Figure]:
    """``vtoken.prefill_ratio.*`` and ``vtoken.prefill_seconds.*`` from ``_prefill_phase``."""
    figures = {}
    what = (
        f"generate of {PREFILL_NEW_TOKENS} new tokens after the prompt (prefill dominates), batch 1"
    )
    for name in seconds:
        figures[f"vtoken.prefill_seconds.{name}"] = Figure(
            statistics.median(seconds[name]),
            "s",
            f"{what}, {'DynamicCache (sdpa)' if name == 'dynamic' else name}, median over prompts",
        )
    for name in PREFILL_POLICIES:
        key = f"vtoken.prefill_ratio.{name}"
        figures[key] = Figure(
            statistics.median(
                mine / dynamic
                for mine, dynamic in zip(seconds[name], seconds["dynamic"], strict=True)
            ),
            "ratio",
            f"wall time of a {what}, TokenTableCache({name}, ratio {SPEED_RATIO:g}) / "
            "DynamicCache (sdpa) in the same round, median over prompts",
            TARGETS[key],
        )
    return figures


# --------------------------------------------------------------------------- report
def _sections(
    config: VTokenConfig,
    prompts: list[Prompt],
    groups: list[list[Prompt]],
    runs: list[Run],
    figures: dict[str, Figure],
    prefill_seconds: dict[str, list[float]],
) -> list[str]:
    ratios = ", ".join(f"{r:g}" for r in config.ratios)
    matrix_generates = len(config.policies) * len(config.ratios) * 2 * len(groups)
    sizes = ", ".join(str(len(g)) for g in groups)
    low, high = VTOKEN_REPORTED
    value = {name: figure.value for name, figure in figures.items()}
    lines = [
        "## Workload",
        "",
        f"- Model: {MODEL_NAME}; 30 layers, 9 query heads, 3 KV heads, head_dim 64; CPU, "
        f"fp32, {torch.get_num_threads()} torch thread(s).",
        f"- Prompts: {len(prompts)} chat-templated requests (one user turn, generation prompt), "
        "each a passage from `bench/data/` with a task"
        + (" (quick: the first paragraph of each passage)" if config.quick else "")
        + ":",
        "",
        "| prompt | passage | tokens | task |",
        "|---|---|---:|---|",
    ]
    for p in prompts:
        lines.append(f"| {p.name} | `{p.passage}.txt` | {p.num_tokens} | {p.instruction} |")
    lines += [
        "",
        f"- Generation: greedy, exactly {config.new_tokens} new tokens per request "
        "(`min_new_tokens` = `max_new_tokens`, so EOS is suppressed until then).",
        f"- Caches: `TokenTableCache(policy, ratio=r, block_size={config.block_size}, "
        f"repack_threshold={config.repack_threshold:g}, reclaim=True)` (vToken: evict, release "
        "slots, repack when waste exceeds the threshold) vs `reclaim=False` (Naive-Evict: the "
        'same victims, slots never released); `attn_implementation="kvstack"`. Budget per '
        f"token table = ceil(r x prompt tokens), r in {{{ratios}}}.",
        "- Policies: `H2O()` (per KV head, recent window 50% of the budget), `Scissorhands()` "
        "(per KV head, history 32, recent 16), `RandomEviction(seed=0)` (one table per row).",
        f"- Block figures: {matrix_generates} batched generates (batches of {sizes} prompts, "
        "left-padded). Every reclaim generate produced exactly the tokens of its Naive-Evict "
        "generate, and every table ended holding exactly its budget (both checked).",
        f"- Speed: batch 1; DynamicCache (sdpa), PagedCache and each policy at ratio "
        f"{SPEED_RATIO:g}, one warm-up generate ({config.warmup_new_tokens} new tokens) each, "
        "then one interleaved round per prompt (`time_interleaved`).",
        "",
        "## Retained blocks: reclaim vs Naive-Evict",
        "",
        "Reduction = 1 - blocks(reclaim) / blocks(Naive-Evict) at the end of generation, per "
        "request; mean (min-max) over prompts. It follows from the budget: every table ends "
        "holding b = ceil(r P) live tokens whatever it kept, so the reduction is about "
        "1 - r P / (P + N) for every policy (the `formula` column), and the policies differ "
        f"only by block rounding. vToken reports {low:.1%}-{high:.1%}; that range is the same "
        "kind of quantity on its workloads, not a target. What measures repacking is "
        "`blocks_over_ideal` below.",
        "",
        "| policy | ratio | reduction: mean | min | max | formula | mean blocks, reclaim | "
        "mean blocks, Naive-Evict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for policy in config.policies:
        for ratio in config.ratios:
            name = f"vtoken.retained_block_reduction.{policy}.{ratio:g}"
            reclaim_blocks = statistics.fmean(
                _find(runs, p.name, policy, ratio, True).blocks for p in prompts
            )
            naive_blocks = statistics.fmean(
                _find(runs, p.name, policy, ratio, False).blocks for p in prompts
            )
            formula = value[f"vtoken.retained_block_reduction.budget_formula.{ratio:g}"]
            lines.append(
                f"| {policy} | {ratio:g} | {value[name]:.1%} | {value[name + '.min']:.1%} | "
                f"{value[name + '.max']:.1%} | {formula:.1%} | {reclaim_blocks:.0f} | "
                f"{naive_blocks:.0f} |"
            )
    lines += [
        "",
        "## Blocks over the ideal",
        "",
        "Retained blocks / sum over tables of ceil(live / block_size), per request, over all "
        f"reclaim requests: worst {value['vtoken.blocks_over_ideal']:.4f}, mean "
        f"{value['vtoken.blocks_over_ideal.mean']:.4f} (1 = every table repacked tight).",
        "",
        "## Speed against DynamicCache",
        "",
        "Tokens/s = new tokens / `generate` wall time (prefill included). `paged` does the "
        "same attention work as DynamicCache; each policy attends over half the tokens.",
        "",
        "| prompt | DynamicCache tok/s | paged / dynamic | same tokens | "
        + " | ".join(f"{p} / dynamic" for p in config.policies)
        + " | h2o repack / generate |",
        "|---|---:|---:|---|" + "---:|" * len(config.policies) + "---:|",
    ]
    for p in prompts:
        dyn = _timed(runs, p.name, "dynamic")
        paged = _timed(runs, p.name, "paged")
        cells = [
            f"{_timed(runs, p.name, policy).tokens_per_s / dyn.tokens_per_s:.3f}"
            for policy in config.policies
        ]
        h2o = _timed(runs, p.name, "h2o") if "h2o" in config.policies else None
        repack = f"{h2o.generate_repack_seconds / h2o.seconds:.4f}" if h2o else ""
        lines.append(
            f"| {p.name} | {dyn.tokens_per_s:.2f} | {paged.tokens_per_s / dyn.tokens_per_s:.3f} "
            f"| {'yes' if paged.same_tokens_as_dynamic else 'NO'} | {' | '.join(cells)} | "
            f"{repack} |"
        )
    lines += [
        "",
        "Medians over prompts: "
        + ", ".join(
            f"{cache} {value[f'vtoken.tokens_per_s.{cache}']:.2f} tok/s"
            for cache in ("dynamic", "paged", *config.policies)
        )
        + ". Every run (blocks, ideal blocks, live tokens, bytes, repacks, seconds) is in "
        "`runs.json`.",
        "",
        "## Prefill against DynamicCache",
        "",
        f"Seconds of a `generate` of {PREFILL_NEW_TOKENS} new tokens at batch 1 (the prompt's "
        f"prefill dominates); each policy at ratio {SPEED_RATIO:g}, its ratio to DynamicCache "
        "(sdpa) in the same interleaved round.",
        "",
        "| prompt | DynamicCache s | "
        + " | ".join(f"{name} / dynamic" for name in PREFILL_POLICIES)
        + " |",
        "|---|---:|" + "---:|" * len(PREFILL_POLICIES),
    ]
    for index, p in enumerate(prompts):
        dynamic = prefill_seconds["dynamic"][index]
        cells = [f"{prefill_seconds[name][index] / dynamic:.3f}" for name in PREFILL_POLICIES]
        lines.append(f"| {p.name} | {dynamic:.2f} | {' | '.join(cells)} |")
    return lines


def readme_tables(results: dict) -> dict[str, str]:
    """The README's vToken tables, from a results file."""
    f, w = results["figures"], results["workload"]
    ratios, policies = w["ratios"], w["policies"]
    speed = f"{w['speed_ratio']:g}"
    names = [
        "vtoken.blocks_over_ideal",
        "vtoken.repack_time_fraction",
        "vtoken.paged_over_dynamic",
        "vtoken.paged_tokens_equal_dynamic",
        *(f"vtoken.evicting_over_dynamic.{p}.{speed}" for p in policies),
        *(f"vtoken.prefill_ratio.{p}" for p in w["prefill"]["policies"]),
    ]

    def percent(name: str) -> str:
        return format_value(f[name]["value"], "percent")

    reduction = [
        "| retained blocks, reclaim vs Naive-Evict | "
        + " | ".join(f"r = {r:g}" for r in ratios)
        + " |",
        "|---|" + "---:|" * len(ratios),
        "| what the budget predicts, 1 − r·P/(P + N) | "
        + " | ".join(
            percent(f"vtoken.retained_block_reduction.budget_formula.{r:g}") for r in ratios
        )
        + " |",
    ]
    for policy in policies:
        cells = []
        for r in ratios:
            name = f"vtoken.retained_block_reduction.{policy}.{r:g}"
            cells.append(f"{percent(name)} ({percent(name + '.min')}–{percent(name + '.max')})")
        reduction.append(
            f"| `{policy}`, measured (range over prompts) | " + " | ".join(cells) + " |"
        )
    lengths = w["prompts"].values()
    tokens_per_s = ", ".join(
        f"{cache} {format_value(f[f'vtoken.tokens_per_s.{cache}']['value'], 'tokens/s')}"
        for cache in ("dynamic", "paged", *policies)
    )
    workload = (
        f"Workload: {w['model']}, {w['device'].upper()} with {w['torch_threads']} torch "
        f"thread(s); {len(w['prompts'])} prompts of {min(lengths)}–{max(lengths)} tokens, "
        f"{w['new_tokens']} greedy new tokens each, block size {w['block_size']}, repack "
        f"threshold {w['repack_threshold']:g}; speed at batch 1, policies at ratio {speed}, "
        f"median tokens/s: {tokens_per_s}. Prefill ratios: generate of "
        f"{w['prefill']['new_tokens']} new tokens at batch 1, each policy at ratio "
        f"{w['prefill']['ratio']:g} over DynamicCache (sdpa), median over the same prompts."
    )
    return {"vtoken": "\n\n".join([figure_table(results, names), "\n".join(reduction), workload])}


def _plot(
    config: VTokenConfig,
    prompts: list[Prompt],
    runs: list[Run],
    figures: dict[str, Figure],
    path: Path,
) -> None:
    # Figure + Agg canvas directly: no pyplot, so no global backend state is touched.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    bars, speed = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})

    width = 0.8 / len(config.policies)
    xs = range(len(config.ratios))
    for k, policy in enumerate(config.policies):
        names = [f"vtoken.retained_block_reduction.{policy}.{r:g}" for r in config.ratios]
        means = [100 * figures[n].value for n in names]
        errors = [
            [100 * (figures[n].value - figures[n + ".min"].value) for n in names],
            [100 * (figures[n + ".max"].value - figures[n].value) for n in names],
        ]
        offsets = [x + (k - (len(config.policies) - 1) / 2) * width for x in xs]
        bars.bar(offsets, means, width, yerr=errors, capsize=3, label=policy)
    low, high = VTOKEN_REPORTED
    bars.axhspan(100 * low, 100 * high, color="grey", alpha=0.15, zorder=0, label="vToken reports")
    bars.set_xticks(list(xs), [f"ratio {r:g}" for r in config.ratios])
    bars.set_ylabel("retained blocks: reduction vs Naive-Evict (%)")
    bars.set_title("Blocks at end of generation (mean, min-max over prompts)", fontsize=9)
    bars.legend(fontsize=8)
    bars.grid(True, axis="y", alpha=0.3)

    labels = [p.name for p in prompts]
    for cache in ("dynamic", "paged", *config.policies):
        speed.plot(
            labels,
            [_timed(runs, p.name, cache).tokens_per_s for p in prompts],
            marker="o",
            label=cache if cache in ("dynamic", "paged") else f"{cache} {SPEED_RATIO:g}",
        )
    speed.set_ylabel("new tokens / generate second")
    speed.set_title(f"Generate speed, {config.new_tokens} new tokens", fontsize=9)
    speed.tick_params(axis="x", labelrotation=60, labelsize=7)
    speed.set_ylim(bottom=0)
    speed.grid(True, alpha=0.3)
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
