"""PagedCache on the real model (SmolLM2-135M-Instruct): exactly DynamicCache's tokens.

A real model has real attention sinks and near-ties that random weights lack; greedy decoding of
a chat prompt over a few hundred tokens is the end-to-end check that paging, masking and the
kvstack attention change nothing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from kvstack.hf import PagedCache
from kvstack.models import load_smollm2

PROMPT = (
    "Summarise the following notes in three sentences, then list two open questions.\n\n"
    "The storage team moved the KV cache into fixed-size blocks so that memory is allocated "
    "on demand rather than reserved for the longest possible sequence. Token tables map each "
    "logical token to a physical slot, which lets an eviction policy drop individual tokens. "
    "Repacking then moves the surviving tokens into fewer blocks and returns the rest to the "
    "pool. Early measurements show fewer blocks retained per request, but the team has not "
    "yet measured the effect on answer quality for long documents, nor the time spent copying."
)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = load_smollm2(progress=False, fresh=True)  # fresh: we switch attention
    return model, tokenizer


def chat_ids(tokenizer, texts):
    rendered = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in texts
    ]
    return tokenizer(rendered, return_tensors="pt", padding=True)


def greedy(model, inputs, cache, attn, max_new_tokens=40):
    model.set_attn_implementation(attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return model.generate(
            **inputs, past_key_values=cache, max_new_tokens=max_new_tokens, do_sample=False
        )


@pytest.mark.parametrize("reference_attn", ["eager", "sdpa"])
def test_smollm2_greedy_tokens_equal_dynamic_cache(model_and_tokenizer, reference_attn):
    model, tokenizer = model_and_tokenizer
    inputs = chat_ids(tokenizer, [PROMPT])
    assert inputs["input_ids"].shape[1] > 100
    expected = greedy(model, inputs, DynamicCache(config=model.config), reference_attn)
    cache = PagedCache(model.config, block_size=16)
    got = greedy(model, inputs, cache, "kvstack")
    assert torch.equal(got, expected), tokenizer.decode(got[0, inputs["input_ids"].shape[1] :])
    stats = cache.stats()
    seen = stats["seen_tokens_per_sequence"]
    assert stats["live_tokens_per_layer"] == seen  # one row, nothing evicted
    assert stats["live_tokens_all_layers"] == 30 * seen  # 30 layers


def test_smollm2_batch_of_three_with_left_padding(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    texts = [PROMPT, "What is the capital of France?", PROMPT[:300]]
    inputs = chat_ids(tokenizer, texts)
    assert tokenizer.padding_side == "left" and not bool(inputs["attention_mask"].all())
    expected = greedy(model, inputs, DynamicCache(config=model.config), "eager", 24)
    got = greedy(model, inputs, PagedCache(model.config), "kvstack", 24)
    assert torch.equal(got, expected)
