"""GPU generate speed: DynamicCache vs PagedCache vs TokenTableCache(H2O, ratio 0.5).

    python -m kvstack.bench.gpu_generate --out DIR [--dtype bfloat16]

The SmolLM2-135M architecture (30 layers, 9 query / 3 KV heads, head_dim 64) with random
weights: the speed of a step does not depend on the weights, and the GPU machine cannot reach
the model package. One 1280-token prompt, batch 1, 128 greedy new tokens (EOS suppressed); a
warm-up generate per cache (compiles), then ``--repeats`` interleaved timed runs; medians. Writes
``gpu_generate.json`` under DIR. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch

from kvstack.errors import KVStackError


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise KVStackError("kvstack.bench.gpu_generate needs a CUDA device; none is visible here")
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
    from kvstack.hf import PagedCache, TokenTableCache
    from kvstack.policies import H2O

    warnings.simplefilter("ignore", FutureWarning)
    config = LlamaConfig(
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
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", getattr(torch, args.dtype)).eval()
    prompt, new_tokens = 1280, 128
    ids = torch.randint(
        3, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.cuda()
    caches = {
        "dynamic": (lambda: DynamicCache(config=config), "sdpa"),
        "paged": (lambda: PagedCache(config), "kvstack"),
        "h2o": (lambda: TokenTableCache(config, H2O(), ratio=0.5), "kvstack"),
    }

    def generate(name: str) -> tuple[float, torch.Tensor]:
        make, attn = caches[name]
        model.set_attn_implementation(attn)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(
            ids,
            past_key_values=make(),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - start, out

    outputs = {name: generate(name)[1] for name in caches}  # warm-up (compiles)
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.repeats):
        for name in caches:
            seconds[name].append(generate(name)[0])
    result = {
        "workload": f"SmolLM2-135M architecture, random weights, {args.dtype}, prompt {prompt}, "
        f"{new_tokens} new tokens, batch 1",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "paged_same_tokens_as_dynamic": bool(torch.equal(outputs["paged"], outputs["dynamic"])),
        "seconds": seconds,
    }
    dynamic = statistics.median(seconds["dynamic"])
    for name in caches:
        result[f"{name}.tokens_per_s"] = new_tokens / statistics.median(seconds[name])
        result[f"{name}.speed_ratio"] = dynamic / statistics.median(seconds[name])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_generate.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
