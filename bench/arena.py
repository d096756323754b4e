"""The arena benchmark: the real bytes kvstack caches hold, and hybrid page layouts.

Real bytes (SmolLM2-135M-Instruct, CPU, float32, ``kvstack`` attention): one prompt of
``PROMPT_TOKENS`` tokens (the first tokens of a vToken benchmark prompt), ``NEW_TOKENS`` greedy
new tokens, batch 1, for ``DynamicCache`` and ``TokenTableCache`` with H2O and SnapKV at ratios
0.3 and 0.5, each on its own private arena (no ``arena=``). "Real bytes" are the bytes of every
tensor storage reachable from the cache object (``held_tensor_bytes``): for kvstack the arena
buffer plus the token tables and policy state; for DynamicCache its keys and values.

* ``arena.real_bytes_ratio.{policy}.{ratio}``: a cache's real bytes after ``generate`` ÷
  DynamicCache's (target ≤ ratio + 0.05);
* ``arena.peak_bytes_ratio.chunked.0.3``: peak real bytes of H2O at ratio 0.3 with
  ``prefill_chunk=256`` ÷ DynamicCache's peak (target ≤ 0.4). Our peak is the private arena's
  ``peak_bytes_reserved`` (both buffers counted while it grows or shrinks) plus the other
  tensors at the end; DynamicCache only grows, so its peak is its final size (its per-layer
  ``torch.cat`` copies are not counted: that favours DynamicCache);
* ``arena.fixed_arena_completes.chunked.0.3``: 1 when the same chunked cache completes on a
  fixed ``KVArena`` smaller than the prompt's full KV (``FIXED_ARENA_FRACTION`` of
  DynamicCache's bytes after prefill) and gives the same tokens as on its private arena.

Hybrid layouts (``bench/arena_hybrid.py``): waste and the most sequences that fit for vLLM's
padded unified pages, SGLang's fixed dual pools and kvstack's arena, on real hybrid configs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.suite import CACHE_CODE, Figure, Measured, figure_table, format_value, run_suite

NAME = "arena"
DEPENDS_ON = (
    *CACHE_CODE,
    "kvstack/arena.py",
    "kvstack/models.py",
    "kvstack/workloads.py",
    "kvstack/data",
    "bench/arena.py",
    "bench/arena_hybrid.py",
    "bench/prompts.py",
    "bench/data",
)
MODEL_NAME = "SmolLM2-135M-Instruct (kvstack.models.load_smollm2: dequantised Q4_1, fp32)"
PROMPT_TOKENS, NEW_TOKENS, PREFILL_CHUNK = 1200, 128, 256
QUICK_PROMPT_TOKENS, QUICK_NEW_TOKENS = 300, 8
POLICIES = ("h2o", "snapkv")
RATIOS = (0.3, 0.5)
CHUNKED_RATIO = 0.3
FIXED_ARENA_FRACTION = 0.45  # of DynamicCache's bytes: less than the prompt's full KV


def held_tensor_bytes(root: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` through attributes,
    lists, tuples, sets and dicts (a storage shared by several views counts once)."""
    seen_objects: set[int] = set()
    storages: dict[int, int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects:
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module) or isinstance(obj, (str, bytes, int, float)):
            continue
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values())


def _prompt(tokenizer: Any, tokens: int) -> torch.Tensor:
    from kvstack.bench.prompts import build_prompts

    for prompt in build_prompts(tokenizer):
        if prompt.num_tokens >= tokens:
            return prompt.input_ids[:, :tokens]
    raise AssertionError(f"no benchmark prompt has {tokens} tokens")


def _policy(name: str):
    from kvstack.policies import BY_NAME

    return BY_NAME[name]()


def measure(quick: bool, log: Callable[[str], None]) -> Measured:
    from transformers import DynamicCache

    import kvstack.hf  # noqa: F401  (registers the "kvstack" attention)
    from kvstack.arena import KVArena
    from kvstack.bench.arena_hybrid import measure_hybrid
    from kvstack.hf import TokenTableCache
    from kvstack.models import greedy_generation_config, load_smollm2

    prompt_tokens = QUICK_PROMPT_TOKENS if quick else PROMPT_TOKENS
    new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    model, tokenizer = load_smollm2(progress=False)
    model.set_attn_implementation("kvstack")
    generation = greedy_generation_config(model, tokenizer, new_tokens, min_new_tokens=new_tokens)
    ids = _prompt(tokenizer, prompt_tokens)
    figures: dict[str, Figure] = {}
    rows: list[tuple[str, int, int]] = []  # (cache, real bytes, peak real bytes)

    def generate(cache: Any) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, past_key_values=cache, generation_config=generation)

    log(f"DynamicCache, {prompt_tokens}-token prompt, {new_tokens} new tokens")
    dynamic = DynamicCache(config=model.config)
    generate(dynamic)
    dynamic_bytes = held_tensor_bytes(dynamic)
    rows.append(("DynamicCache", dynamic_bytes, dynamic_bytes))

    def kvstack_bytes(cache: Any) -> tuple[int, int]:
        """(real bytes now, peak real bytes): the arena's peak plus the other tensors now."""
        real = held_tensor_bytes(cache)
        stats = cache.stats()
        return real, real - stats["bytes_reserved"] + stats["peak_bytes_reserved"]

    for policy in POLICIES:
        for ratio in RATIOS:
            log(f"TokenTableCache({policy}, ratio={ratio:g})")
            cache = TokenTableCache(model.config, policy=_policy(policy), ratio=ratio)
            generate(cache)
            real, peak = kvstack_bytes(cache)
            rows.append((f"TokenTableCache({policy}, {ratio:g})", real, peak))
            figures[f"arena.real_bytes_ratio.{policy}.{ratio:g}"] = Figure(
                real / dynamic_bytes,
                "ratio",
                f"real tensor bytes TokenTableCache({policy}, ratio={ratio:g}) holds after "
                "generate ÷ DynamicCache's (private arena, token tables and policy state "
                "included)",
                ("<=", ratio + 0.05),
            )

    log(f"chunked prefill: H2O at {CHUNKED_RATIO:g}, prefill_chunk={PREFILL_CHUNK}")
    chunked = TokenTableCache(
        model.config, policy=_policy("h2o"), ratio=CHUNKED_RATIO, prefill_chunk=PREFILL_CHUNK
    )
    chunked_tokens = generate(chunked)
    real, peak = kvstack_bytes(chunked)
    rows.append(
        (f"TokenTableCache(h2o, {CHUNKED_RATIO:g}, prefill_chunk={PREFILL_CHUNK})", real, peak)
    )
    figures[f"arena.peak_bytes_ratio.chunked.{CHUNKED_RATIO:g}"] = Figure(
        peak / dynamic_bytes,
        "ratio",
        f"peak real bytes of TokenTableCache(h2o, ratio={CHUNKED_RATIO:g}, prefill_chunk="
        f"{PREFILL_CHUNK}) ÷ DynamicCache's peak (its final size)",
        ("<=", 0.4),
    )

    # The prompt's full KV does not fit this arena; the chunked cache must still complete.
    prompt_kv_bytes = dynamic_bytes * prompt_tokens / (prompt_tokens + new_tokens)
    capacity = int(FIXED_ARENA_FRACTION * dynamic_bytes)
    log(f"fixed arena of {capacity} bytes (prompt KV {prompt_kv_bytes:.0f} bytes)")
    fixed = KVArena(capacity, dtype=torch.float32)
    on_fixed = TokenTableCache(
        model.config,
        policy=_policy("h2o"),
        ratio=CHUNKED_RATIO,
        prefill_chunk=PREFILL_CHUNK,
        arena=fixed,
    )
    completes = torch.equal(generate(on_fixed), chunked_tokens) and capacity < prompt_kv_bytes
    figures[f"arena.fixed_arena_completes.chunked.{CHUNKED_RATIO:g}"] = Figure(
        float(completes),
        "count",
        f"1 if the chunked cache completes on a fixed KVArena of {FIXED_ARENA_FRACTION:g} x "
        "DynamicCache's bytes (less than the prompt's full KV) with the same tokens",
        (">=", 1.0),
    )
    fixed_peak = fixed.stats()["peak_bytes_used"]
    on_fixed.release()

    log("hybrid layouts")
    hybrid_figures, hybrid_workload = measure_hybrid(quick)
    figures.update(hybrid_figures)
    log("hybrid trace through tiny hybrid models on one arena")
    equal, checked = _hybrid_tokens_equal(quick)
    figures["arena.hybrid.tokens_equal_dynamic"] = Figure(
        equal / checked,
        "fraction",
        f"of {checked} (model, request) pairs of a trace run through tiny random "
        f"{'/'.join(HYBRID_TOKEN_MODELS)} models with PagedCache, all caches on one fixed arena "
        "at once, whose greedy tokens equal DynamicCache's alone (the arena empty afterwards)",
        (">=", 1.0),
    )

    workload = {
        "model": MODEL_NAME,
        "dtype": "float32",
        "device": "cpu",
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "batch": 1,
        "block_size": 16,
        "policies": list(POLICIES),
        "ratios": list(RATIOS),
        "prefill_chunk": PREFILL_CHUNK,
        "fixed_arena_bytes": capacity,
        "fixed_arena_peak_bytes_used": fixed_peak,
        "prompt_kv_bytes": int(prompt_kv_bytes),
        "dynamic_bytes": dynamic_bytes,
        "real_bytes": {name: real for name, real, _ in rows},
        "peak_real_bytes": {name: peak for name, _, peak in rows},
        "hybrid": hybrid_workload,
    }
    return Measured(
        figures=figures,
        workload=workload,
        title="kvstack arena benchmark: real bytes under one budget",
        sections=_sections(rows, workload),
        plot=lambda path: _plot(rows, path),
    )


HYBRID_TOKEN_MODELS = ("jamba", "bamba", "qwen3_next", "lfm2", "nemotron_h", "falcon_h1")
HYBRID_TRACE_REQUESTS, HYBRID_MAX_CONTEXT, HYBRID_MAX_NEW = 4, 96, 12


def _hybrid_tokens_equal(quick: bool) -> tuple[int, int]:
    """Run a trace's requests (lengths from the shipped distribution, scaled to a tiny model's
    context) through each tiny hybrid model: every request's PagedCache on one shared fixed
    arena, all alive together; count the requests whose tokens equal DynamicCache's alone."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from kvstack.arena import KVArena
    from kvstack.hf import PagedCache
    from kvstack.hf import attention as kv_attention
    from kvstack.models import tiny_hybrid_config
    from kvstack.workloads import draw_trace

    models = HYBRID_TOKEN_MODELS[:2] if quick else HYBRID_TOKEN_MODELS
    trace = draw_trace(HYBRID_TRACE_REQUESTS, seed=0, max_context=HYBRID_MAX_CONTEXT)
    equal = checked = 0
    kv_attention.set_backend("reference")  # tiny shapes: compiling each would cost more
    try:
        for name in models:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_hybrid_config(name)).eval()
            model.set_attn_implementation("kvstack")
            arena = KVArena("16MiB", dtype=torch.float32)
            caches = []
            for request in trace:
                gen = torch.Generator().manual_seed(request.request_id)
                ids = torch.randint(2, 120, (1, max(1, request.prompt_tokens)), generator=gen)
                new = max(1, min(request.output_tokens, HYBRID_MAX_NEW))
                kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False)
                with torch.inference_mode():
                    expected = model.generate(
                        ids, past_key_values=DynamicCache(config=model.config), **kwargs
                    )
                    cache = PagedCache(model.config, arena=arena)
                    out = model.generate(ids, past_key_values=cache, **kwargs)
                caches.append(cache)  # held until the whole trace ran: they share the arena
                equal += int(torch.equal(out, expected))
                checked += 1
            for cache in caches:
                cache.release()
            if arena.pages:
                raise AssertionError(f"{name}: the arena holds pages after every release")
    finally:
        kv_attention.set_backend(None)
    return equal, checked


def _sections(rows: list[tuple[str, int, int]], workload: dict) -> list[str]:
    lines = [
        "## Real bytes",
        "",
        f"SmolLM2, {workload['prompt_tokens']}-token prompt, {workload['new_tokens']} new "
        "tokens, fp32 on CPU; every tensor storage reachable from the cache.",
        "",
        "| cache | real bytes after generate | peak real bytes |",
        "|---|---:|---:|",
    ]
    for name, real, peak in rows:
        lines.append(f"| {name} | {real / 2**20:.1f} MiB | {peak / 2**20:.1f} MiB |")
    return lines


def _plot(rows: list[tuple[str, int, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [name for name, _, _ in rows]
    ax.barh(names, [real / 2**20 for _, real, _ in rows], label="after generate")
    ax.barh(names, [peak / 2**20 for _, _, peak in rows], alpha=0.35, label="peak")
    ax.set_xlabel("MiB of tensors the cache holds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_arena(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the arena benchmark into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def readme_tables(results: dict) -> dict[str, str]:
    """The README's arena table, from a results file."""
    w = results["workload"]
    # The headline figures; the per-model hybrid figures stay in the results file and report.
    models = set(w["hybrid"]["models"])
    names = [name for name in results["figures"] if name.rsplit(".", 1)[-1] not in models]
    workload = (
        f"Workload: {w['model']}, {w['dtype']} on {w['device']}; prompt {w['prompt_tokens']} "
        f"tokens, {w['new_tokens']} greedy new tokens, batch 1; DynamicCache holds "
        f"{format_value(w['dynamic_bytes'] / 2**20, 'MiB')} MiB. Hybrid layouts: "
        f"{', '.join(w['hybrid']['models'])}; {w['hybrid']['budget']}; "
        "max_sequences sums the three models, waste and ratios are the worst model."
    )
    return {"arena": figure_table(results, names) + "\n\n" + workload}


__all__ = ["DEPENDS_ON", "NAME", "held_tensor_bytes", "measure", "readme_tables", "run_arena"]
