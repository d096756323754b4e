"""The tiny model most tests build: a two-layer GQA Llama that runs in seconds on a CPU."""

from __future__ import annotations

from typing import Any

TINY_LLAMA: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,  # 2 query heads per KV head: every test exercises GQA
    num_key_value_heads=2,
    vocab_size=256,
)


def tiny_llama_config(**overrides: Any):
    """A ``LlamaConfig`` of ``TINY_LLAMA`` with ``overrides`` on top."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_LLAMA, **overrides})


def tiny_serving_llama(**overrides: Any):
    """The tiny Llama the serving tests run: seeded weights (seed 0), eval mode, and no EOS id,
    since the engine ends a request only at the stop ids it is given (so ``generate`` does too)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    model.generation_config.eos_token_id = None
    return model


def tiny_tiers_llama():
    """The tiny Llama the tiers tests run: three layers (a page of one layer is fetched while
    another computes), seeded weights (seed 0), eval mode, padding id 0."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3)).eval()
    model.generation_config.pad_token_id = 0
    return model


def tiny_kvstack_llama(**overrides: Any):
    """The tiny Llama the Hugging Face cache tests run: a 1024-token context, seeded weights
    (seed 0), eval mode, on the kvstack attention."""
    import torch
    from transformers import LlamaForCausalLM

    import kvstack.hf  # noqa: F401  (registers the "kvstack" attention)

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        tiny_llama_config(**{"max_position_embeddings": 1024, **overrides})
    ).eval()
    model.set_attn_implementation("kvstack")
    return model


def random_prompt(length: int, batch: int = 1, seed: int = 1):
    """[batch, length] token ids in [1, 256), from ``seed``."""
    import torch

    return torch.randint(1, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def greedy(model, ids, cache, max_new_tokens: int, **kwargs: Any):
    """Greedy ``generate`` of ``max_new_tokens`` through ``cache`` (padding id 0)."""
    return model.generate(
        ids,
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **kwargs,
    )
