"""GPU speed: generate through DynamicCache, PagedCache and TokenTableCache(H2O, ratio 0.5), and
the registered paged decode op against the device's copy bandwidth.

    kvstack bench gpu --out DIR          (python -m kvstack.bench.gpu --out DIR)

The SmolLM2-135M architecture (30 layers, 9 query / 3 KV heads, head_dim 64) with random
weights: the speed of a step does not depend on the weights, and the GPU machine cannot reach
the model package. Prompts of 1280 random tokens, 128 greedy new tokens (EOS suppressed), bf16,
at batch 1 and batch 16 (16 different prompts of the same length: no padding). Timed with
``kvstack.bench.timing.time_interleaved`` (a warm-up generate per cache, which compiles, then
interleaved rounds, CUDA-synchronised; medians). PagedCache never evicts, so it must give
DynamicCache's tokens: a mismatch stops the run. Needs a CUDA device.

Figures (issue 13's names):

    gpu.paged_over_dynamic.b{1,16}               tokens/s of PagedCache / DynamicCache (sdpa):
                                                 the same attention work              >= 0.95
    gpu.token_table_over_dynamic.h2o.0.5.b{1,16}  TokenTableCache(H2O, 0.5) / DynamicCache
                                                                                      >= 0.9
    gpu.tokens_per_s.{dynamic,paged,h2o}.b{1,16}
    gpu.decode_attention.bandwidth_fraction      one decode step of the registered
        ``paged_attention`` (the fastest backend on the device) over token tables of 32k
        shuffled slots, batch 8, SmolLM2's heads: bytes it must read (K and V of every
        visible slot, the slots and their positions) / its median time, over the device's
        copy bandwidth (bytes read and written by ``dst.copy_(src)`` of as many bytes / its
        median time), both timed with CUDA events                              >= 0.8
    gpu.decode_attention.gb_per_s, gpu.copy_gb_per_s

Not measured yet, and recorded so in the workload's ``not_measured``:
``gpu.graph_replay_speedup`` needs a decode step captured in a CUDA graph, which kvstack does not
have yet.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvstack.bench.suite import CACHE_CODE, Figure, Measured, figure_table, format_value, run_suite
from kvstack.bench.timing import time_interleaved
from kvstack.errors import KVStackError

NAME = "gpu"
DEPENDS_ON = (
    *CACHE_CODE,
    "bench/gpu.py",
    "bench/timing.py",
)
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 1280, 128, 5
BATCHES = (1, 16)
QUICK_PROMPT_TOKENS, QUICK_NEW_TOKENS, QUICK_BATCHES = 64, 8, (1, 2)
# The decode-attention bandwidth workload: issue 13's 32k tokens per sequence at batch 8.
DECODE_CONTEXT, DECODE_BATCH, DECODE_REPEATS = 32768, 8, 50
QUICK_DECODE_CONTEXT, QUICK_DECODE_BATCH, QUICK_DECODE_REPEATS = 512, 2, 3
BLOCK_SIZE = 16
TARGETS = {
    "paged_over_dynamic": (">=", 0.95),
    "token_table_over_dynamic": (">=", 0.9),
    "bandwidth_fraction": (">=", 0.8),
}
NOT_MEASURED = {
    "gpu.graph_replay_speedup": "kvstack has no decode step captured in a CUDA graph yet "
    "(issue 13, item 2)",
}


def smollm2_architecture():
    """SmolLM2-135M's configuration (random weights are built from it)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )


def measure(quick: bool, log: Callable[[str], None], dtype: str = "bfloat16") -> Measured:
    if not torch.cuda.is_available():
        raise KVStackError("kvstack bench gpu needs a CUDA device; none is visible here")
    return measure_on(torch.device("cuda"), quick, log, dtype=dtype)


def measure_on(
    device: torch.device,
    quick: bool,
    log: Callable[[str], None],
    *,
    dtype: str = "bfloat16",
    config: Any = None,
) -> Measured:
    """The whole run on ``device`` (``measure`` insists on CUDA; tests run it on the CPU with
    a tiny ``config``, where the numbers mean nothing)."""
    config = smollm2_architecture() if config is None else config
    figures: dict[str, Figure] = {}
    tps: dict[int, dict[str, float]] = {}
    batches = QUICK_BATCHES if quick else BATCHES
    new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    prompt_tokens = QUICK_PROMPT_TOKENS if quick else PROMPT_TOKENS
    repeats = 1 if quick else REPEATS
    seconds = {}
    for batch in batches:
        log(f"generate, batch {batch}: dynamic, paged, h2o; 1 warm-up, then {repeats} rounds")
        timings = _generate_timings(
            config, device, dtype, batch, prompt_tokens, new_tokens, repeats
        )
        seconds[f"b{batch}"] = timings.seconds
        tps[batch] = {name: batch * new_tokens / timings.median(name) for name in timings.seconds}
        for name, value in tps[batch].items():
            figures[f"gpu.tokens_per_s.{name}.b{batch}"] = Figure(
                value, "tokens/s", f"{name}, batch {batch}, median"
            )
        figures[f"gpu.paged_over_dynamic.b{batch}"] = Figure(
            tps[batch]["paged"] / tps[batch]["dynamic"],
            "ratio",
            f"tokens/s of PagedCache / DynamicCache (sdpa), batch {batch}: the same attention work",
            TARGETS["paged_over_dynamic"],
        )
        figures[f"gpu.token_table_over_dynamic.h2o.0.5.b{batch}"] = Figure(
            tps[batch]["h2o"] / tps[batch]["dynamic"],
            "ratio",
            f"tokens/s of TokenTableCache(H2O, ratio 0.5) / DynamicCache (sdpa), batch {batch}",
            TARGETS["token_table_over_dynamic"],
        )
    context = QUICK_DECODE_CONTEXT if quick else DECODE_CONTEXT
    decode_batch = QUICK_DECODE_BATCH if quick else DECODE_BATCH
    decode_repeats = QUICK_DECODE_REPEATS if quick else DECODE_REPEATS
    log(f"decode attention: {decode_batch} x {context} slots, {decode_repeats} timed calls")
    decode = decode_bandwidth(
        config, device, getattr(torch, dtype), context, decode_batch, decode_repeats
    )
    figures["gpu.decode_attention.bandwidth_fraction"] = Figure(
        decode["attention_gb_per_s"] / decode["copy_gb_per_s"],
        "fraction",
        f"bytes the registered paged decode reads / its time ({decode_batch} x {context} "
        "shuffled slots), over the copy bandwidth of dst.copy_(src) of as many bytes",
        TARGETS["bandwidth_fraction"],
    )
    figures["gpu.decode_attention.gb_per_s"] = Figure(
        decode["attention_gb_per_s"], "GB/s", "bytes read / median time, paged decode"
    )
    figures["gpu.copy_gb_per_s"] = Figure(
        decode["copy_gb_per_s"], "GB/s", "bytes read and written / median time, dst.copy_(src)"
    )
    workload = {
        "model": "SmolLM2-135M architecture, random weights",
        "dtype": dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "batches": list(batches),
        "repeats": repeats,
        "seconds": seconds,
        "timer": "kvstack.bench.timing.time_interleaved, CUDA-synchronised, median",
        "decode_attention": decode,
        "not_measured": NOT_MEASURED,
    }
    sections = [
        "## Workload",
        "",
        f"{workload['model']}, {dtype}, {workload['device']}; prompts of {prompt_tokens} "
        f"tokens, {new_tokens} greedy new tokens, batches {', '.join(map(str, batches))}, "
        f"medians of {repeats} interleaved rounds. PagedCache gave exactly DynamicCache's "
        "tokens at every batch (checked).",
        "",
        "| batch | cache | tokens/s |",
        "|---:|---|---:|",
        *(
            f"| {batch} | {name} | {format_value(value, 'tokens/s')} |"
            for batch, row in tps.items()
            for name, value in row.items()
        ),
        "",
        f"Decode attention: `{decode['backend']}` backend, {decode_batch} x {context} slots, "
        f"{decode['bytes_read'] / 1e6:.1f} MB read in {decode['attention_ms']:.3f} ms; copy of "
        f"{decode['copy_bytes'] / 1e6:.1f} MB (read and written) in {decode['copy_ms']:.3f} ms.",
        "",
        "Not measured: "
        + "; ".join(f"`{name}` ({why})" for name, why in NOT_MEASURED.items())
        + ".",
    ]
    return Measured(figures, workload, "kvstack GPU benchmark", sections)


def _generate_timings(
    config: Any,
    device: torch.device,
    dtype: str,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    repeats: int,
):
    """Interleaved timings of ``generate`` with each cache at ``batch`` (``Timings``); stops
    the run when PagedCache's tokens differ from DynamicCache's."""
    from transformers import DynamicCache, LlamaForCausalLM

    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
    from kvstack.hf import PagedCache, TokenTableCache
    from kvstack.policies import H2O

    warnings.simplefilter("ignore", FutureWarning)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device, getattr(torch, dtype)).eval()
    ids = torch.randint(
        3,
        config.vocab_size,
        (batch, prompt_tokens),
        generator=torch.Generator().manual_seed(batch),
    ).to(device)
    caches = {
        "dynamic": (lambda: DynamicCache(config=config), "sdpa"),
        "paged": (lambda: PagedCache(config), "kvstack"),
        "h2o": (lambda: TokenTableCache(config, H2O(), ratio=0.5), "kvstack"),
    }

    def generate(name: str) -> Callable[[], torch.Tensor]:
        make, attn = caches[name]

        def call() -> torch.Tensor:
            model.set_attn_implementation(attn)
            with torch.inference_mode():
                return model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    past_key_values=make(),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )

        return call

    timings = time_interleaved({name: generate(name) for name in caches}, repeats, warmup=1)
    dynamic_ids, paged_ids = timings.results["dynamic"], timings.results["paged"]
    if not torch.equal(dynamic_ids, paged_ids):
        row, column = (int(i) for i in (dynamic_ids != paged_ids).nonzero()[0])
        raise KVStackError(
            f"batch {batch}: PagedCache generated other tokens than DynamicCache (row {row}, "
            f"first difference at new token {column - prompt_tokens}); it never evicts, so it "
            "must give exactly the same tokens"
        )
    return timings


def decode_bandwidth(
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    context: int,
    batch: int,
    repeats: int,
) -> dict[str, Any]:
    """One decode step of the registered ``paged_attention`` (fastest backend here) over
    ``batch`` token tables of ``context`` shuffled slots each, with the model's heads, against a
    plain copy of as many bytes: medians of ``repeats`` timed calls after two untimed ones. The
    output is checked against the reference backend first."""
    from kvstack import ops

    h_q, h_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // h_q
    generator = torch.Generator().manual_seed(0)
    blocks = batch * context // BLOCK_SIZE
    key_cache = torch.randn(blocks, BLOCK_SIZE, h_kv, head_dim, generator=generator).to(
        device, dtype
    )  # [num_blocks, block_size, H_kv, D]
    value_cache = torch.randn(key_cache.shape, generator=generator).to(device, dtype)
    # Each table's tokens in whole blocks scattered over the pool (shuffled), in token order.
    order = torch.randperm(blocks, generator=generator).view(batch, context // BLOCK_SIZE)
    slots = (order[:, :, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).reshape(batch, context)
    slots = slots.to(device)  # [B, T]
    key_positions = torch.arange(context, device=device).expand(batch, context).contiguous()
    query_positions = torch.full((batch, 1), context, device=device)
    query = torch.randn(batch, 1, h_q, head_dim, generator=generator).to(device, dtype)
    args = (query, key_cache, value_cache, slots, key_positions, query_positions)

    attention = ops.get("paged_attention", device=device)  # the fastest for these tensors
    backend = next(
        name
        for name, fn in ops.operations()["paged_attention"].implementations.items()
        if fn is attention
    )
    out = attention(*args).out
    expected = ops.get("paged_attention", "reference")(*args).out
    if not torch.allclose(out.float(), expected.float(), atol=2e-2, rtol=2e-2):
        raise KVStackError(
            f"paged_attention ({backend}) differs from the reference by "
            f"{(out.float() - expected.float()).abs().max().item():.3g} on the bandwidth workload"
        )
    element = key_cache.element_size()
    bytes_read = 2 * batch * context * h_kv * head_dim * element + 2 * slots.numel() * 8
    source = torch.empty(bytes_read, dtype=torch.uint8, device=device)
    destination = torch.empty_like(source)
    attention_ms = _median_ms(lambda: attention(*args, check=False), device, repeats)
    copy_ms = _median_ms(lambda: destination.copy_(source), device, repeats)
    return {
        "backend": backend,
        "context": context,
        "batch": batch,
        "block_size": BLOCK_SIZE,
        "bytes_read": bytes_read,
        "copy_bytes": 2 * bytes_read,  # read and written
        "attention_ms": attention_ms,
        "copy_ms": copy_ms,
        "attention_gb_per_s": bytes_read / attention_ms / 1e6,
        "copy_gb_per_s": 2 * bytes_read / copy_ms / 1e6,
    }


def _median_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after two untimed ones: CUDA events
    around each call on a GPU, ``perf_counter`` elsewhere."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    median = statistics.median(times)
    if not math.isfinite(median) or median <= 0:
        raise KVStackError(f"a timed call took {median} ms; expected a positive time")
    return median


def run_gpu(
    out_dir: str | Path, quick: bool = False, *, command: str | None = None, verbose: bool = False
) -> dict[str, float]:
    """Run the GPU generate benchmark into ``out_dir`` (``bench/suite.py`` says what is written)."""
    return run_suite(
        NAME, measure, DEPENDS_ON, out_dir, quick=quick, command=command, verbose=verbose
    )


def readme_tables(results: dict) -> dict[str, str]:
    """The README's GPU table, from a results file."""
    w = results["workload"]
    d = w["decode_attention"]
    workload = (
        f"Workload: {w['model']}, {w['dtype']} on {w['device']}; prompts of "
        f"{w['prompt_tokens']} tokens, {w['new_tokens']} greedy new tokens, batches "
        f"{', '.join(map(str, w['batches']))}, medians of {w['repeats']} interleaved rounds; "
        f"decode attention ({d['backend']}) over {d['batch']} x {d['context']} shuffled slots. "
        "Not measured: " + ", ".join(f"`{name}`" for name in w["not_measured"]) + "."
    )
    return {"gpu": figure_table(results, list(results["figures"])) + "\n\n" + workload}


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    return run_gpu(args.out, args.quick, verbose=True)


if __name__ == "__main__":
    main()
