"""The Hugging Face caches on a CUDA device (marked ``gpu``; skipped where there is none).

The same checks as the CPU HF tests, with the model, the pool, the token tables and the policy
state on the GPU: PagedCache gives DynamicCache's greedy tokens; TokenTableCache keeps its
budgets, gives Naive-Evict's tokens in fewer bytes, and its StreamingLLM is exact against a
full cache with the evicted positions masked out; and nothing lands back on the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from kvstack.hf import PagedCache, TokenTableCache
from spec_tests.test_hf_paged import FAMILIES, tiny_model
from spec_tests.test_hf_token_table_cache import POLICIES, prompt, tiny_llama

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]


@pytest.fixture(autouse=True)
def _exact_fp32():
    # TF32 matrix products would let the two sides round differently and flip near-ties.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        yield
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def generate(model, ids, cache, **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    return model.generate(ids, past_key_values=cache, do_sample=False, pad_token_id=0, **kwargs)


def assert_on_cuda(cache):
    for layer in cache.paged_layers if hasattr(cache, "paged_layers") else cache.layers:
        assert layer.pool.key.device.type == "cuda"
        assert layer.batch.alive.device.type == "cuda"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_paged_cache_on_cuda_gives_dynamic_cache_tokens(family):
    model = tiny_model(family).cuda()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (3, 25), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    mask[1, :3] = 0
    ids[mask == 0] = 0
    ids, mask = ids.cuda(), mask.cuda()
    model.set_attn_implementation("eager")
    expected = generate(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    model.set_attn_implementation("kvstack")
    cache = PagedCache(model.config, block_size=16)
    got = generate(model, ids, cache, attention_mask=mask)
    assert torch.equal(got, expected)
    assert_on_cuda(cache)


def test_paged_cache_on_cuda_beam_search():
    model = tiny_model("llama").cuda()
    ids = torch.randint(1, 256, (2, 18), generator=torch.Generator().manual_seed(4)).cuda()
    model.set_attn_implementation("eager")
    expected = generate(model, ids, DynamicCache(config=model.config), num_beams=3)
    model.set_attn_implementation("kvstack")
    assert torch.equal(generate(model, ids, PagedCache(model.config), num_beams=3), expected)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_token_table_cache_on_cuda_reclaims_and_keeps_budgets(name):
    model, ids = tiny_llama().cuda(), prompt(60, batch=2).cuda()
    caches = {
        reclaim: TokenTableCache(
            model.config, POLICIES[name](), budget=24, block_size=4, reclaim=reclaim
        )
        for reclaim in (True, False)
    }
    outputs = {reclaim: generate(model, ids, cache) for reclaim, cache in caches.items()}
    assert torch.equal(outputs[True], outputs[False])
    reclaimed, naive = caches[True].stats(), caches[False].stats()
    assert reclaimed["live_tokens_all_layers"] == naive["live_tokens_all_layers"]
    assert reclaimed["bytes_used_kv"] < naive["bytes_used_kv"]
    for layer in caches[True].paged_layers:
        for table in layer.tables:
            assert table.num_live <= 24
            table.check_invariants()
    assert_on_cuda(caches[True])


def test_streamingllm_on_cuda_equals_its_cpu_run():
    """StreamingLLM's victims do not depend on values, so the GPU run must keep exactly the
    CPU run's tokens; with TF32 off the generated tokens agree too on this tiny model."""
    from kvstack.policies import StreamingLLM

    runs = {}
    for device in ("cpu", "cuda"):
        model, ids = tiny_llama(layers=3).to(device), prompt(50).to(device)
        cache = TokenTableCache(model.config, StreamingLLM(sink_tokens=4), budget=16, block_size=4)
        tokens = generate(model, ids, cache)
        alive = [layer.batch.alive.cpu() for layer in cache.paged_layers]
        runs[device] = tokens.cpu(), alive
    assert torch.equal(runs["cuda"][0], runs["cpu"][0])
    for gpu, cpu in zip(runs["cuda"][1], runs["cpu"][1], strict=True):
        assert torch.equal(gpu, cpu)
