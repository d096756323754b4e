"""PagedCache on hybrid Mamba/linear-attention + attention models (random tiny configs).

The state layers (``linear_attention``, ``conv``; transformers' own ``LinearAttentionLayer``)
stay exactly as the model expects; each plain attention layer is paged. Greedy tokens must equal
those of transformers' own ``DynamicCache(config=...)``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache

from kvstack.hf import PagedCache, PagedLayer, TokenTableCache
from kvstack.policies import H2O

BASE = dict(
    initializer_range=0.2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=127,
)
MAMBA = dict(
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=16,
)


def hybrid_config(name: str):
    if name == "jamba":
        return transformers.JambaConfig(
            **BASE,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        )
    if name == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **BASE,
            num_hidden_layers=4,
            head_dim=16,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
    if name == "lfm2":
        return transformers.Lfm2Config(
            **BASE, num_hidden_layers=4, full_attn_idxs=[1, 3], block_auto_adjust_ff_dim=False
        )
    if name == "bamba":
        return transformers.BambaConfig(
            **BASE, **MAMBA, num_hidden_layers=4, attn_layer_indices=[1, 3]
        )
    raise KeyError(name)


@pytest.mark.parametrize("name", ["jamba", "qwen3_next", "lfm2", "bamba"])
def test_hybrid_greedy_tokens_equal_transformers_cache(name):
    config = hybrid_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.randint(2, 120, (1, 20), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(
            ids, max_new_tokens=12, do_sample=False, past_key_values=DynamicCache(config=config)
        )
        model.set_attn_implementation("kvstack")
        cache = PagedCache(model.config)
        got = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert torch.equal(got, expected)
    transformers_layers = DynamicCache(config=config).layers
    for ours, theirs in zip(cache.layers, transformers_layers, strict=True):
        if isinstance(ours, PagedLayer):
            assert type(theirs).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer")
        else:  # state layers are transformers' own, untouched
            assert type(ours) is type(theirs)
    assert (
        len(cache.paged_layers) == 2 and cache.stats()["blocks_allocated"] == 2 * 2
    )  # 31 tokens, 16/block


@pytest.mark.parametrize("name", ["jamba", "lfm2"])
def test_hybrid_token_table_cache_evicts_attention_layers_only(name):
    config = hybrid_config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="kvstack").eval()
    ids = torch.randint(2, 120, (1, 30), generator=torch.Generator().manual_seed(2))
    outputs, caches = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for reclaim in (True, False):
            caches[reclaim] = TokenTableCache(
                model.config, H2O(), budget=12, block_size=4, reclaim=reclaim
            )
            outputs[reclaim] = model.generate(
                ids, max_new_tokens=10, do_sample=False, past_key_values=caches[reclaim]
            )
    assert torch.equal(outputs[True], outputs[False])
    for layer in caches[True].paged_layers:
        assert all(table.num_live == 12 for table in layer.tables)
    assert caches[True].stats()["bytes"] < caches[False].stats()["bytes"]
    state_layers = [layer for layer in caches[True].layers if not isinstance(layer, PagedLayer)]
    assert state_layers and all(
        type(layer).__name__ == "LinearAttentionLayer" for layer in state_layers
    )
