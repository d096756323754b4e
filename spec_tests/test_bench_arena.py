"""The arena benchmark's memory measure: every tensor storage a cache keeps alive, once."""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvstack.bench.arena import held_tensor_bytes, readme_tables
from kvstack.hf import PagedCache
from spec_tests.tiny import tiny_llama_config


def test_held_tensor_bytes_counts_each_storage_once_through_containers():
    base = torch.zeros(100)  # 400 bytes
    holder = type("Holder", (), {})()
    holder.views = [base[:10], base[50:]]  # two views of one storage
    holder.nested = {"a": (torch.zeros(3, dtype=torch.float64),), "b": {"c": [base]}}
    holder.module = torch.nn.Linear(4, 4)  # weights are the model's, not the cache's
    holder.loop = holder
    assert held_tensor_bytes(holder) == 400 + 24


def test_a_cache_holds_its_arena_and_dynamic_cache_its_keys_and_values():
    torch.manual_seed(0)
    config = tiny_llama_config()
    model = LlamaForCausalLM(config).eval()
    model.set_attn_implementation("kvstack")
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    dynamic, paged = DynamicCache(config=config), PagedCache(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for cache in (dynamic, paged):
            model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    kv = sum(layer.keys.untyped_storage().nbytes() * 2 for layer in dynamic.layers)
    assert held_tensor_bytes(dynamic) == kv
    arena = paged.arena.buffer.untyped_storage().nbytes()
    tables = sum(
        layer.batch._slots.untyped_storage().nbytes()
        + layer.batch._alive.untyped_storage().nbytes()
        for layer in paged.paged_layers
    )
    assert arena <= held_tensor_bytes(paged) <= arena + tables + 4096  # + small index tensors


def test_the_readme_table_keeps_the_headline_figures():
    figure = {"value": 1.0, "unit": "ratio", "description": "", "target": None, "met": None}
    results = {
        "figures": {
            "arena.real_bytes_ratio.h2o.0.3": figure,
            "arena.hybrid.waste.kvstack": figure,
            "arena.hybrid.waste.kvstack.jamba_1_5_mini": figure,
        },
        "workload": {
            "model": "m",
            "dtype": "float32",
            "device": "cpu",
            "prompt_tokens": 1,
            "new_tokens": 1,
            "dynamic_bytes": 2**20,
            "hybrid": {"models": {"jamba_1_5_mini": {}}, "budget": "b"},
        },
    }
    table = readme_tables(results)["arena"]
    assert "arena.real_bytes_ratio.h2o.0.3" in table and "arena.hybrid.waste.kvstack`" in table
    assert "jamba_1_5_mini`" not in table
