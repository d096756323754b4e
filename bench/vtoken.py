"""The vToken benchmark: token eviction with and without reclamation, on the real model.

vToken's claim: when an eviction policy (H2O, Scissorhands, ...) drops tokens, a token table
plus repacking turns the freed slots into freed blocks, so a request *retains* 27.2-72.3% fewer
KV blocks than Naive-Evict (the same victims, memory never reclaimed), at a negligible cost in
time. Measured in one run (``run_vtoken``) on SmolLM2-135M-Instruct (``kvstack.models``) over
the chat prompts of ``bench/prompts.py`` (real passages that ship in ``bench/data/``), greedy,
``new_tokens`` new tokens per request (EOS suppressed until then, so every request generates
exactly that many), fp32 on CPU. The block figures run each configuration over all prompts as
one left-padded batch (``batches``: lengths within ``new_tokens`` of each other, so padding
leaves no trace in any request's blocks); the timed figures run batch 1.

Figures (flat name -> float, written to ``figures.json``), with targets:

    vtoken.retained_block_reduction.{policy}.{ratio}   mean over prompts of
        1 - blocks(reclaim) / blocks(Naive-Evict) at the end of generation   (vToken: 0.272-0.723)
        (+ ``.min`` / ``.max`` over prompts)
    vtoken.blocks_over_ideal        worst over all reclaim runs of retained blocks /
        sum over tables of ceil(live / block_size)                            <= 1.05
        (+ ``.mean``)
    vtoken.generate_speed_ratio     median over prompts of tokens/s of TokenTableCache(H2O,
        ratio 0.5) / tokens/s of DynamicCache (sdpa), interleaved per prompt  >= 0.9
    vtoken.repack_time_fraction     sum of stats()["repack_seconds"] / sum of generate wall time
        over the H2O ratio-0.5 runs                                           <= 0.03
        (+ ``.max`` over prompts)

Blocks are exact counts (``TokenTableCache.stats()["blocks_allocated"]``, all 30 layers). Per-head
policies (H2O, Scissorhands) keep one token table per KV head, so their blocks hold one head's
K/V and whole-row policies' (Random) hold all three; each reduction is a ratio within one policy,
so the unit cancels. Reclaim and Naive-Evict choose the same victims, so they must generate the
same tokens: every pair is compared and a mismatch stops the run.

Tokens/s is new tokens / wall time of ``generate`` (prefill included), one warm-up ``generate``
per configuration first so torch.compile time is excluded; the two configurations alternate
which goes first from prompt to prompt, so load from other processes hits each alike.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.prompts import Prompt, build_prompts
from kvstack.bench.reporting import cpu_name, meets_target
from kvstack.errors import InvalidArgumentError, KVStackError
from kvstack.policies import H2O, EvictionPolicy, RandomEviction, Scissorhands
from kvstack.reference.repack import DEFAULT_WASTE_THRESHOLD

MODEL_NAME = "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)"

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "h2o": lambda: H2O(),
    "scissorhands": lambda: Scissorhands(),
    "random": lambda: RandomEviction(seed=0),
}

SPEED_POLICY, SPEED_RATIO = "h2o", 0.5  # the configuration timed against DynamicCache

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
# Two short prompts, eight new tokens, one ratio: runs the whole pipeline in well under a minute.
QUICK = VTokenConfig(
    policies=("h2o", "scissorhands", "random"),
    ratios=(SPEED_RATIO,),
    new_tokens=8,
    warmup_new_tokens=4,
    quick=True,
)

# figure -> (comparison, target)
TARGETS = {
    "vtoken.blocks_over_ideal": ("<=", 1.05),
    "vtoken.generate_speed_ratio": (">=", 0.9),
    "vtoken.repack_time_fraction": ("<=", 0.03),
}


@dataclass
class Run:
    """One request (prompt) of one ``generate`` with one cache configuration, and what its
    cache held at the end. Requests of one batched ``generate`` share ``seconds`` and the
    ``generate_repack*`` totals."""

    prompt: str
    prompt_tokens: int
    cache: str  # "token_table" or "dynamic"
    policy: str | None
    ratio: float | None
    reclaim: bool | None
    new_tokens: int
    batch_size: int  # requests in the generate this one was part of
    seconds: float  # wall time of that generate
    blocks: int = 0  # blocks held by this request's token tables, all layers, at the end
    ideal_blocks: int = 0  # sum over those tables of ceil(live / block_size)
    live_tokens: float = 0.0  # token-equivalents over all layers (per-head tables: / heads)
    bytes: int = 0  # K and V bytes of the blocks held
    generate_repacks: int = 0
    generate_repack_seconds: float = 0.0
    timed: bool = False  # part of the interleaved speed comparison (batch 1)

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
) -> tuple[torch.Tensor, float]:
    """Greedy ``generate`` of exactly ``new_tokens`` tokens per prompt, as one batch;
    (new token ids [B, new_tokens], wall seconds)."""
    model.set_attn_implementation(attn)
    ids, mask = _left_pad(prompts, model.generation_config.pad_token_id)
    with warnings.catch_warnings():
        # transformers 5.24 renames past_key_values to cache= (FutureWarning); 5.17 knows only
        # the old name, so keep it and silence the notice.
        warnings.simplefilter("ignore", FutureWarning)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,  # suppress EOS: every request does the same work
            do_sample=False,
        )
        seconds = time.perf_counter() - start
    generated = out[:, ids.shape[1] :]  # [B, new_tokens]
    if generated.shape[1] != new_tokens:
        raise KVStackError(
            f"prompts {[p.name for p in prompts]}: generate returned {generated.shape[1]} new "
            f"tokens, expected {new_tokens}"
        )
    return generated, seconds


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
    tokens, seconds = _generate(model, prompts, cache, "kvstack", new_tokens)
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
                seconds=seconds,
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


def _dynamic_run(model: Any, prompt: Prompt, new_tokens: int) -> Run:
    from transformers import DynamicCache

    _, seconds = _generate(model, [prompt], DynamicCache(config=model.config), "sdpa", new_tokens)
    return Run(
        prompt=prompt.name,
        prompt_tokens=prompt.num_tokens,
        cache="dynamic",
        policy=None,
        ratio=None,
        reclaim=None,
        new_tokens=new_tokens,
        batch_size=1,
        seconds=seconds,
    )


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


# --------------------------------------------------------------------------- the whole run
def run_vtoken(
    out_dir: str | Path,
    quick: bool = False,
    *,
    command: str | None = None,
    verbose: bool = False,
) -> dict[str, float]:
    """Run the vToken workload, write ``figures.json``, ``report.md``, ``runs.json`` and
    ``vtoken.png`` under ``out_dir``, and return the figures.

    ``quick`` uses ``QUICK`` (two short prompts, eight new tokens, ratio 0.5) to exercise the
    pipeline; its numbers mean little. ``command`` is recorded in the report as what produced
    it (default: the equivalent ``kvstack bench vtoken`` command). ``verbose`` logs progress to
    stderr.
    """
    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
    from kvstack.models import load_smollm2

    started = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise InvalidArgumentError(f"out_dir must be a directory, got existing file {str(out)!r}")
    config = QUICK if quick else FULL
    if command is None:
        command = f"kvstack bench vtoken --out {out}" + (" --quick" if quick else "")

    def log(message: str) -> None:
        if verbose:
            elapsed = time.perf_counter() - started
            print(f"[kvstack bench vtoken {elapsed:6.0f}s] {message}", file=sys.stderr, flush=True)

    # fresh: this run switches the attention implementation between generates.
    model, tokenizer = load_smollm2(progress=verbose, fresh=True)
    prompts = build_prompts(tokenizer, quick=config.quick)
    groups = batches(prompts, config.new_tokens)
    log(
        f"{len(prompts)} prompts ({', '.join(str(p.num_tokens) for p in prompts)} tokens) in "
        f"{len(groups)} batch(es), {config.new_tokens} new tokens each; torch threads "
        f"{torch.get_num_threads()}"
    )

    # 1. Speed, batch 1: a warm-up generate per configuration, then the two interleaved per
    #    prompt, alternating which goes first.
    log(f"warm-up: DynamicCache and {SPEED_POLICY} {SPEED_RATIO:g} on {prompts[0].name!r}")
    _dynamic_run(model, prompts[0], config.warmup_new_tokens)
    token_table_generate(
        model, prompts[:1], config, SPEED_POLICY, SPEED_RATIO, True, config.warmup_new_tokens
    )
    runs: list[Run] = []
    for i, prompt in enumerate(prompts):
        pair: list[Run] = []
        for which in ("dynamic", "token_table") if i % 2 == 0 else ("token_table", "dynamic"):
            if which == "dynamic":
                pair.append(_dynamic_run(model, prompt, config.new_tokens))
            else:
                _, (run,) = token_table_generate(
                    model, [prompt], config, SPEED_POLICY, SPEED_RATIO, True, config.new_tokens
                )
                pair.append(run)
        for run in pair:
            run.timed = True
        runs += pair
        dyn, kv = sorted(pair, key=lambda r: r.cache)
        log(
            f"speed {i + 1}/{len(prompts)} {prompt.name}: DynamicCache {dyn.tokens_per_s:.2f} "
            f"tok/s, TokenTableCache {kv.tokens_per_s:.2f} tok/s"
        )

    # 2. Blocks: every policy x ratio, reclaim and Naive-Evict, every prompt (batched).
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
                f"{reduction:.1%} fewer blocks with reclaim, same tokens "
                f"({reclaim_runs[0].seconds + naive_runs[0].seconds:.0f}s)"
            )

    figures = _figures(config, prompts, runs)
    wall_seconds = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(figures, indent=2, sort_keys=True) + "\n")
    (out / "runs.json").write_text(
        json.dumps([asdict(run) for run in runs], indent=1, sort_keys=True) + "\n"
    )
    _plot(config, prompts, runs, figures, out / "vtoken.png")
    (out / "report.md").write_text(
        _report(config, prompts, groups, runs, figures, command, wall_seconds)
    )
    log(f"done in {wall_seconds:.0f}s")
    return figures


def _find(runs: list[Run], prompt: str, policy: str, ratio: float, reclaim: bool) -> Run:
    """The block-matrix run of this prompt and configuration (not the timed batch-1 one)."""
    for run in runs:
        key = (run.prompt, run.policy, run.ratio, run.reclaim)
        if not run.timed and key == (prompt, policy, ratio, reclaim):
            return run
    raise KeyError((prompt, policy, ratio, reclaim))


def _reductions(
    prompts: list[Prompt], runs: list[Run], policy: str, ratio: float
) -> dict[str, float]:
    """Per prompt: 1 - blocks(reclaim) / blocks(Naive-Evict)."""
    return {
        p.name: 1.0
        - _find(runs, p.name, policy, ratio, True).blocks
        / _find(runs, p.name, policy, ratio, False).blocks
        for p in prompts
    }


def _speed_pairs(prompts: list[Prompt], runs: list[Run]) -> dict[str, tuple[Run, Run]]:
    """Per prompt: (DynamicCache run, TokenTableCache run) of the timed comparison."""
    pairs = {}
    for p in prompts:
        timed = {run.cache: run for run in runs if run.timed and run.prompt == p.name}
        pairs[p.name] = (timed["dynamic"], timed["token_table"])
    return pairs


# --------------------------------------------------------------------------- figures
def _figures(config: VTokenConfig, prompts: list[Prompt], runs: list[Run]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for policy in config.policies:
        for ratio in config.ratios:
            values = list(_reductions(prompts, runs, policy, ratio).values())
            name = f"vtoken.retained_block_reduction.{policy}.{ratio:g}"
            figures[name] = statistics.fmean(values)
            figures[f"{name}.min"] = min(values)
            figures[f"{name}.max"] = max(values)

    over_ideal = [run.blocks / run.ideal_blocks for run in runs if run.reclaim and run.ideal_blocks]
    figures["vtoken.blocks_over_ideal"] = max(over_ideal)
    figures["vtoken.blocks_over_ideal.mean"] = statistics.fmean(over_ideal)

    pairs = _speed_pairs(prompts, runs).values()
    figures["vtoken.generate_speed_ratio"] = statistics.median(
        kv.tokens_per_s / dyn.tokens_per_s for dyn, kv in pairs
    )
    figures["vtoken.tokens_per_s.dynamic_cache"] = statistics.median(
        dyn.tokens_per_s for dyn, _ in pairs
    )
    figures["vtoken.tokens_per_s.token_table_cache"] = statistics.median(
        kv.tokens_per_s for _, kv in pairs
    )

    timed = [kv for _, kv in pairs]  # batch 1: the generate's repack time is this request's
    figures["vtoken.repack_time_fraction"] = sum(r.generate_repack_seconds for r in timed) / sum(
        r.seconds for r in timed
    )
    figures["vtoken.repack_time_fraction.max"] = max(
        r.generate_repack_seconds / r.seconds for r in timed
    )
    return {name: float(value) for name, value in figures.items()}


def passes(name: str, value: float) -> bool:
    return meets_target(TARGETS, name, value)


def _report(
    config: VTokenConfig,
    prompts: list[Prompt],
    groups: list[list[Prompt]],
    runs: list[Run],
    figures: dict[str, float],
    command: str,
    wall_seconds: float,
) -> str:
    import transformers

    ratios = ", ".join(f"{r:g}" for r in config.ratios)
    matrix_generates = len(config.policies) * len(config.ratios) * 2 * len(groups)
    sizes = ", ".join(str(len(g)) for g in groups)
    reclaim_rows = [run for run in runs if run.reclaim]
    pairs = _speed_pairs(prompts, runs)
    low, high = VTOKEN_REPORTED
    lines = [
        "# kvstack vToken benchmark: retained blocks with and without reclamation",
        "",
        f"Produced by `{command}` on {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC "
        f"in {wall_seconds / 60:.1f} min (model load included).",
        "",
        "## Workload",
        "",
        f"- Machine: {cpu_name()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, torch threads: {torch.get_num_threads()}, Python "
        f"{platform.python_version()}; CPU, fp32, timed with `time.perf_counter`.",
        f"- Model: {MODEL_NAME}; 30 layers, 9 query heads, 3 KV heads, head_dim 64.",
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
        "slots, repack when waste exceeds the threshold) vs `reclaim=False` (Naive-Evict: the same "
        'victims, slots never released); `attn_implementation="kvstack"`. Budget per token '
        f"table = ceil(r x prompt tokens), r in {{{ratios}}}; prefill attends over the whole "
        "prompt, then evicts to the budget; each decode step evicts one token.",
        "- Policies: `H2O()` (per KV head, recent window 50% of the budget), `Scissorhands()` "
        "(per KV head, history 32, recent 16), `RandomEviction(seed=0)` (one table per row).",
        f"- Block figures: {len(config.policies)} policies x {len(config.ratios)} ratios x 2 "
        f"modes x {len(prompts)} prompts, run as {matrix_generates} batched TokenTableCache "
        f"generates (batches of {sizes} prompts, left-padded; prompts in a batch differ by at "
        f"most {config.new_tokens} tokens, so the padding slots, released at prefill, are "
        "refilled by the new tokens and every request ends holding the blocks it would hold "
        "alone). Each request's blocks are those of its own token tables. Every reclaim "
        "generate produced exactly the tokens of its Naive-Evict generate, and every table ended "
        "holding exactly its budget (both checked).",
        f"- Speed and repack-time figures: batch 1, {len(prompts)} DynamicCache and "
        f"{len(prompts)} TokenTableCache({SPEED_POLICY}, ratio {SPEED_RATIO:g}) generates, "
        "interleaved, after one warm-up generate "
        f"({config.warmup_new_tokens} new tokens) per configuration.",
        "",
        "## Targets",
        "",
        "| figure | measured | target | result |",
        "|---|---:|---:|---|",
    ]
    for name, (comparison, target) in TARGETS.items():
        value = figures[name]
        result = "pass" if passes(name, value) else "FAIL"
        lines.append(f"| `{name}` | {value:.3g} | {comparison} {target:g} | {result} |")
    cell_means = [
        figures[f"vtoken.retained_block_reduction.{p}.{r:g}"]
        for p in config.policies
        for r in config.ratios
    ]
    lines += [
        "",
        "## Retained blocks: reclaim vs Naive-Evict",
        "",
        "Reduction = 1 - blocks(reclaim) / blocks(Naive-Evict) at the end of generation, per "
        "request; mean (min-max) over prompts. Blocks are summed over all 30 layers and tables "
        "(per-head policies: 1-head blocks).",
        "",
        "| policy | ratio | reduction: mean | min | max | mean blocks, reclaim | "
        "mean blocks, Naive-Evict |",
        "|---|---:|---:|---:|---:|---:|---:|",
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
            lines.append(
                f"| {policy} | {ratio:g} | {figures[name]:.1%} | {figures[name + '.min']:.1%} | "
                f"{figures[name + '.max']:.1%} | {reclaim_blocks:.0f} | {naive_blocks:.0f} |"
            )
    lines += [
        "",
        f"Policy x ratio means span {min(cell_means):.1%}-{max(cell_means):.1%}; vToken reports "
        f"{low:.1%}-{high:.1%}. Every table ends holding exactly its budget b = ceil(r x P) "
        "live tokens whatever the policy chose, so reclaim holds about ceil(b / 16) blocks per "
        "table and Naive-Evict ceil((P + N) / 16) (P prompt, N new tokens): the reduction is "
        "about 1 - r x P / (P + N) for every policy, and the policies differ only by block "
        "rounding.",
        "",
        "![retained-block reduction and decode speed](vtoken.png)",
        "",
        "## Blocks over the ideal",
        "",
        "Retained blocks / sum over tables of ceil(live / block_size), per request, over all "
        f"{len(reclaim_rows)} reclaim requests (block figures and timed runs): worst "
        f"{figures['vtoken.blocks_over_ideal']:.4f}, mean "
        f"{figures['vtoken.blocks_over_ideal.mean']:.4f} (1 = every table repacked tight).",
        "",
        "## Speed: TokenTableCache(H2O, ratio 0.5) vs DynamicCache",
        "",
        "Tokens/s = new tokens / `generate` wall time (prefill included); the two alternate "
        "which runs first from prompt to prompt. DynamicCache runs under "
        '`attn_implementation="sdpa"`.',
        "",
        "| prompt | DynamicCache tok/s | TokenTableCache tok/s | ratio | repack s | "
        "repack / generate |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (dyn, kv) in pairs.items():
        lines.append(
            f"| {name} | {dyn.tokens_per_s:.2f} | {kv.tokens_per_s:.2f} | "
            f"{kv.tokens_per_s / dyn.tokens_per_s:.3f} | {kv.generate_repack_seconds:.3f} | "
            f"{kv.generate_repack_seconds / kv.seconds:.4f} |"
        )
    lines += [
        "",
        f"Median ratio {figures['vtoken.generate_speed_ratio']:.3f} (median tok/s: DynamicCache "
        f"{figures['vtoken.tokens_per_s.dynamic_cache']:.2f}, TokenTableCache "
        f"{figures['vtoken.tokens_per_s.token_table_cache']:.2f}). Repack time fraction "
        f"{figures['vtoken.repack_time_fraction']:.4f} overall (sum / sum), worst prompt "
        f"{figures['vtoken.repack_time_fraction.max']:.4f}.",
        "",
        "Memory figures are exact counts. Absolute CPU times on a shared machine are not "
        "comparable between runs; the speed ratio is against a baseline measured in this run, "
        "interleaved. Every figure is in `figures.json`; every run (blocks, ideal blocks, live "
        "tokens, bytes, repacks, seconds) in `runs.json`.",
        "",
    ]
    return "\n".join(lines)


def _plot(
    config: VTokenConfig,
    prompts: list[Prompt],
    runs: list[Run],
    figures: dict[str, float],
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
        means = [100 * figures[n] for n in names]
        errors = [
            [100 * (figures[n] - figures[n + ".min"]) for n in names],
            [100 * (figures[n + ".max"] - figures[n]) for n in names],
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

    pairs = _speed_pairs(prompts, runs)
    labels = list(pairs)
    speed.plot(labels, [d.tokens_per_s for d, _ in pairs.values()], marker="o", label="Dynamic")
    speed.plot(
        labels,
        [kv.tokens_per_s for _, kv in pairs.values()],
        marker="s",
        label=f"TokenTable {SPEED_POLICY} {SPEED_RATIO:g}",
    )
    speed.set_ylabel("new tokens / generate second")
    speed.set_title(f"Generate speed, {config.new_tokens} new tokens", fontsize=9)
    speed.tick_params(axis="x", labelrotation=60, labelsize=7)
    speed.set_ylim(bottom=0)
    speed.grid(True, alpha=0.3)
    speed.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
