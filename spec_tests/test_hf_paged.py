"""PagedCache inside ``model.generate``: exactly the tokens of DynamicCache.

Random-weight tiny configs (fast, and random weights make near-ties rare but real: any mask or
position mistake changes tokens). The DynamicCache side runs eager and sdpa; our side runs the
``"kvstack"`` attention (reading K/V through token tables) and, for PagedCache alone, sdpa too
(the cache then hands transformers contiguous K/V).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GenerationMixin,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import kvstack.hf as kvstack_hf
from kvstack.errors import KVStackError
from kvstack.hf import PagedCache

# transformers 5.24 renamed generate's past_key_values= to cache= (the old name still works,
# deprecated). Detect the feature, not the version: on 5.17, model(..., cache=c) is silently ignored.
CACHE_KEYWORDS = ["past_key_values"]
if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters:
    CACHE_KEYWORDS.append("cache")


def test_runs_on_a_supported_transformers():
    # make test runs these files twice: on the newest 5.x (.venv) and on 5.17 (the oldest).
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    assert (5, 17) <= (major, minor) < (6, 0), transformers.__version__


TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


# family -> (config class, model class, extra config); windows of 8 tokens so that the sliding
# layers' masks matter within the test prompts.
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 8}),
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {"head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},  # sliding, global, ...
    ),
}


def tiny_model(family: str, attn: str = "eager"):
    torch.manual_seed(0)
    config_class, model_class, extra = FAMILIES[family]
    model = model_class(config_class(**TINY, **extra))
    model.set_attn_implementation(attn)
    return model.eval()


def generate(model, ids, cache, keyword="past_key_values", **kwargs):
    kwargs.setdefault("max_new_tokens", 24)
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("pad_token_id", 0)
    return model.generate(ids, **{keyword: cache}, **kwargs)


def reference_tokens(model, ids, reference_attn, **kwargs):
    model.set_attn_implementation(reference_attn)
    return generate(model, ids, DynamicCache(config=model.config), **kwargs)


@pytest.fixture(autouse=True)
def _quiet_deprecations():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


@pytest.mark.parametrize("keyword", CACHE_KEYWORDS)
@pytest.mark.parametrize("reference_attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_equal_dynamic_cache(family, reference_attn, keyword):
    model = tiny_model(family)
    ids = torch.randint(1, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    expected = reference_tokens(model, ids, reference_attn)
    model.set_attn_implementation("kvstack")
    cache = PagedCache(model.config, block_size=16)
    got = generate(model, ids, cache, keyword)
    assert torch.equal(got, expected)
    stats = cache.stats()
    seen = stats["seen_tokens_per_sequence"]
    assert seen == 40 + 24 - 1  # the last generated token is never fed back
    layers = TINY["num_hidden_layers"]
    assert stats["live_tokens_per_layer"] == seen  # one row, nothing evicted
    assert stats["live_tokens_all_layers"] == layers * seen
    assert stats["blocks_allocated"] == layers * -(-seen // 16)


@pytest.mark.parametrize("block_size", [1, 7, 16])
def test_paged_cache_under_sdpa_gives_the_same_tokens(block_size):
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    expected = reference_tokens(model, ids, "sdpa")
    model.set_attn_implementation("sdpa")
    assert torch.equal(
        generate(model, ids, PagedCache(model.config, block_size=block_size)), expected
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batch_with_left_padding(family):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 256, (3, 25), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # rows of 16, 22 and 25 real tokens
    mask[1, :3] = 0
    ids[mask == 0] = 0
    expected = reference_tokens(model, ids, "eager", attention_mask=mask)
    model.set_attn_implementation("kvstack")
    cache = PagedCache(model.config)
    got = generate(model, ids, cache, attention_mask=mask)
    assert torch.equal(got, expected)
    # Padding was evicted at prefill: each row keeps only its real tokens.
    live = [table.num_live for table in cache.layers[0].tables]
    seen = cache.get_seq_length()
    assert live == [seen - 9, seen - 3, seen]


def test_beam_search():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (2, 18), generator=torch.Generator().manual_seed(4))
    expected = reference_tokens(model, ids, "eager", num_beams=3, max_new_tokens=16)
    model.set_attn_implementation("kvstack")
    got = generate(model, ids, PagedCache(model.config), num_beams=3, max_new_tokens=16)
    assert torch.equal(got, expected)


def test_cache_reused_across_two_turns():
    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(5)
    turn1 = torch.randint(1, 256, (1, 20), generator=gen)
    user2 = torch.randint(1, 256, (1, 10), generator=gen)

    def conversation(attn, cache_factory):
        model.set_attn_implementation(attn)
        cache = cache_factory()
        first = generate(model, turn1, cache, max_new_tokens=12)
        second = generate(model, torch.cat([first, user2], dim=1), cache, max_new_tokens=12)
        return first, second

    expected = conversation("eager", lambda: DynamicCache(config=model.config))
    got = conversation("kvstack", lambda: PagedCache(model.config))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_from_pretrained_with_kvstack_attention_and_switching(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="kvstack").eval()
    assert loaded.config._attn_implementation == "kvstack"
    ids = torch.randint(1, 256, (1, 16), generator=torch.Generator().manual_seed(6))
    expected = reference_tokens(model, ids, "eager")
    assert torch.equal(generate(loaded, ids, PagedCache(loaded.config)), expected)
    # Without any cache the kvstack attention computes plain causal attention.
    assert torch.equal(
        loaded.generate(ids, max_new_tokens=24, do_sample=False, use_cache=False), expected
    )


def test_kvstack_attention_reference_backend_gives_the_same_tokens():
    model = tiny_model("llama")
    ids = torch.randint(1, 256, (1, 20), generator=torch.Generator().manual_seed(7))
    expected = reference_tokens(model, ids, "eager", max_new_tokens=8)
    model.set_attn_implementation("kvstack")
    kvstack_hf.set_backend("reference")
    try:
        got = generate(model, ids, PagedCache(model.config), max_new_tokens=8)
    finally:
        kvstack_hf.set_backend(None)
    assert torch.equal(got, expected)


def test_encoder_decoder_config_is_refused():
    config = transformers.T5Config(
        num_layers=1, d_model=16, d_kv=4, num_heads=2, d_ff=32, vocab_size=32
    )
    with pytest.raises(KVStackError, match="encoder-decoder"):
        PagedCache(config)


def test_sliding_layers_get_their_window():
    cache = PagedCache(tiny_model("gemma3").config)
    assert [layer.window for layer in cache.layers] == [8, None, 8]
    assert cache.is_sliding == [True, False, True]
