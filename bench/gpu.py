"""GPU generate speed: DynamicCache vs PagedCache vs TokenTableCache(H2O, ratio 0.5).

    kvstack bench gpu --out DIR          (python -m kvstack.bench.gpu --out DIR)

The SmolLM2-135M architecture (30 layers, 9 query / 3 KV heads, head_dim 64) with random
weights: the speed of a step does not depend on the weights, and the GPU machine cannot reach
the model package. One 1280-token prompt, batch 1, 128 greedy new tokens (EOS suppressed), bf16.
Timed with ``kvstack.bench.timing.time_interleaved`` (a warm-up generate per cache, which
compiles, then interleaved rounds, CUDA-synchronised; medians). PagedCache never evicts, so it
must give DynamicCache's tokens: a mismatch stops the run. Needs a CUDA device.

Figures:

    gpu.paged_over_dynamic     tokens/s of PagedCache / DynamicCache (the same attention work)
    gpu.evicting_over_dynamic.h2o.0.5   tokens/s of TokenTableCache(H2O, 0.5) / DynamicCache
    gpu.tokens_per_s.{dynamic,paged,h2o}
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

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
PROMPT_TOKENS, NEW_TOKENS, REPEATS, QUICK_NEW_TOKENS = 1280, 128, 5, 8


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
    from transformers import DynamicCache, LlamaForCausalLM

    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
    from kvstack.hf import PagedCache, TokenTableCache
    from kvstack.policies import H2O

    warnings.simplefilter("ignore", FutureWarning)
    config = smollm2_architecture()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", getattr(torch, dtype)).eval()
    new_tokens = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    repeats = 1 if quick else REPEATS
    ids = torch.randint(
        3, config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    ).cuda()
    caches = {
        "dynamic": (lambda: DynamicCache(config=config), "sdpa"),
        "paged": (lambda: PagedCache(config), "kvstack"),
        "h2o": (lambda: TokenTableCache(config, H2O(), ratio=0.5), "kvstack"),
    }

    def generate(name: str) -> Callable[[], torch.Tensor]:
        make, attn = caches[name]

        def call() -> torch.Tensor:
            model.set_attn_implementation(attn)
            return model.generate(
                ids,
                past_key_values=make(),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

        return call

    log(f"{', '.join(caches)}: 1 warm-up generate each, then {repeats} interleaved rounds")
    timings = time_interleaved({name: generate(name) for name in caches}, repeats, warmup=1)
    dynamic_ids, paged_ids = timings.results["dynamic"], timings.results["paged"]
    if not torch.equal(dynamic_ids, paged_ids):
        first = int((dynamic_ids != paged_ids).nonzero()[0, 1]) - PROMPT_TOKENS
        raise KVStackError(
            f"PagedCache generated other tokens than DynamicCache (first difference at new "
            f"token {first}); it never evicts, so it must give exactly the same tokens"
        )
    tps = {name: new_tokens / timings.median(name) for name in caches}
    figures = {
        "gpu.paged_over_dynamic": Figure(
            tps["paged"] / tps["dynamic"],
            "ratio",
            "tokens/s of PagedCache / DynamicCache (sdpa): the same attention work",
        ),
        "gpu.evicting_over_dynamic.h2o.0.5": Figure(
            tps["h2o"] / tps["dynamic"],
            "ratio",
            "tokens/s of TokenTableCache(H2O, ratio 0.5) / DynamicCache (sdpa)",
        ),
        **{
            f"gpu.tokens_per_s.{name}": Figure(value, "tokens/s", f"{name}, median")
            for name, value in tps.items()
        },
    }
    workload = {
        "model": "SmolLM2-135M architecture, random weights",
        "dtype": dtype,
        "device": torch.cuda.get_device_name(),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "batch": 1,
        "repeats": repeats,
        "seconds": timings.seconds,
        "timer": "kvstack.bench.timing.time_interleaved, CUDA-synchronised, median",
    }
    sections = [
        "## Workload",
        "",
        f"{workload['model']}, {dtype}, {workload['device']}; prompt {PROMPT_TOKENS} tokens, "
        f"{new_tokens} greedy new tokens, batch 1, medians of {repeats} interleaved rounds. "
        "PagedCache gave exactly DynamicCache's tokens (checked).",
        "",
        "| cache | tokens/s |",
        "|---|---:|",
        *(f"| {name} | {format_value(value, 'tokens/s')} |" for name, value in tps.items()),
    ]
    return Measured(figures, workload, "kvstack GPU generate benchmark", sections)


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
    workload = (
        f"Workload: {w['model']}, {w['dtype']} on {w['device']}; prompt {w['prompt_tokens']} "
        f"tokens, {w['new_tokens']} greedy new tokens, batch 1, medians of {w['repeats']} "
        "interleaved rounds."
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
