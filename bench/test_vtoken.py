"""pytest-benchmark of one decode-heavy generate on the real model (``pytest bench/``; not in CI).

The workload of ``kvstack bench vtoken``'s speed figure, made decode-heavy: one short chat prompt
(the first paragraph of ``bench/data/llm_serving.txt`` with its task, ~170 tokens) and 128 greedy
new tokens (EOS suppressed), batch 1, fp32, SmolLM2-135M-Instruct. DynamicCache (sdpa) is the
baseline; TokenTableCache(H2O, ratio 0.5) with reclamation and as Naive-Evict are timed against
it (tests run in file order: baseline first). Each round builds a fresh cache; warm-up rounds
compile. Every benchmark records its workload in ``extra_info`` and, for the token-table caches,
the ratio of tokens/s to the baseline and the cache's block counts.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvstack.hf  # noqa: F401  (registers attn_implementation="kvstack")
from kvstack.bench.prompts import build_prompts
from kvstack.bench.vtoken import FULL, MODEL_NAME, _generate
from kvstack.hf import TokenTableCache
from kvstack.models import load_smollm2
from kvstack.policies import H2O

NEW_TOKENS = 128
RATIO = 0.5
ROUNDS = 3

_medians_s: dict[str, float] = {}  # name -> median seconds, for ratios within this session


@pytest.fixture(scope="module")
def model_and_prompt():
    model, tokenizer = load_smollm2(progress=False, fresh=True)  # fresh: we switch attention
    prompt = next(p for p in build_prompts(tokenizer, quick=True) if p.passage == "llm_serving")
    return model, prompt


def _info(prompt, cache: str) -> dict:
    return {
        "workload": "greedy generate, decode-heavy",
        "model": MODEL_NAME,
        "prompt": prompt.name,
        "prompt_tokens": prompt.num_tokens,
        "new_tokens": NEW_TOKENS,
        "batch": 1,
        "dtype": "float32",
        "cache": cache,
        "threads": torch.get_num_threads(),
    }


def _record(benchmark, name: str) -> float | None:
    if benchmark.stats is None:  # --benchmark-disable
        return None
    _medians_s[name] = benchmark.stats.stats.median
    return _medians_s[name]


def test_generate_dynamic_cache(benchmark, model_and_prompt):
    model, prompt = model_and_prompt
    benchmark.extra_info.update(_info(prompt, "DynamicCache (sdpa)"))

    def setup():
        return (model, [prompt], DynamicCache(config=model.config), "sdpa", NEW_TOKENS), {}

    benchmark.pedantic(_generate, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    _record(benchmark, "dynamic")


@pytest.mark.parametrize("reclaim", [True, False], ids=["reclaim", "naive_evict"])
def test_generate_token_table_h2o(benchmark, model_and_prompt, reclaim):
    model, prompt = model_and_prompt
    name = f"TokenTableCache(H2O(), ratio={RATIO}, reclaim={reclaim})"
    benchmark.extra_info.update(_info(prompt, name), policy="h2o", ratio=RATIO, reclaim=reclaim)
    caches: list[TokenTableCache] = []

    def setup():
        cache = TokenTableCache(
            model.config, H2O(), ratio=RATIO, block_size=FULL.block_size, reclaim=reclaim
        )
        caches.append(cache)
        return (model, [prompt], cache, "kvstack", NEW_TOKENS), {}

    benchmark.pedantic(_generate, setup=setup, rounds=ROUNDS, warmup_rounds=1)
    stats = caches[-1].stats()
    benchmark.extra_info.update(
        blocks_allocated=stats["blocks_allocated"],
        repacks=stats["repacks"],
        repack_seconds=stats["repack_seconds"],
    )
    median = _record(benchmark, name)
    if median is not None and "dynamic" in _medians_s:
        # tokens/s ratio = t_dynamic / t_token_table
        benchmark.extra_info["speed_ratio_vs_dynamic"] = _medians_s["dynamic"] / median
        benchmark.extra_info["repack_time_fraction"] = stats["repack_seconds"] / median
