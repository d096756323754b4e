"""Run by ``test_vllm_connector.py`` with the vLLM venv's python: a fact memory saved by
kvstack, then the same prompt through vLLM twice, prefilled and with the facts loaded by
``FactConnector``. Prints one JSON line with what the test checks."""

from __future__ import annotations

import json
import os
import sys


def main(workdir: str) -> None:
    import torch
    from vllm import SamplingParams

    from kvstack.facts import FactMemory
    from kvstack.models import load_smollm2, smollm2_cache_dir
    from kvstack.vllm import fact_engine, transfer_params

    model, tokenizer = load_smollm2(progress=False)
    header = "<|im_start|>system\nAnswer from the notes.<|im_end|>\n<|im_start|>user\nNotes:\n"
    facts = [
        "Maya's dog is named Biscuit.",
        "Tom works as a baker in Lisbon.",
        "Maya plays the cello on Sundays.",
    ]
    tail = "Question: What does Tom do for a living?<|im_end|>\n<|im_start|>assistant\n"

    def embed(texts):
        return torch.ones(len(texts), 4)

    results: dict = {}
    memories = {
        # Every fact encoded after the header and the facts before it: the K/V a prefill of
        # the assembled prompt computes, so vLLM's tokens must not change.
        "whole_context": FactMemory(
            model, tokenizer, embed, os.path.join(workdir, "whole"), context_turns=10, prefix=header
        ),
        # Each fact after the header alone: other K/V, loaded all the same.
        "header_only": FactMemory(
            model, tokenizer, embed, os.path.join(workdir, "alone"), prefix=header
        ),
    }
    for memory in memories.values():
        for i, fact in enumerate(facts):
            memory.add(fact, context=facts[:i])
        memory.save()
    fact_ids = list(memories["whole_context"].facts)
    ids = memories["whole_context"].prompt_ids(header, fact_ids, tail)
    results["prompt_tokens"] = len(ids)
    results["covered"] = len(ids) - len(tokenizer(tail, add_special_tokens=False).input_ids)

    llm = fact_engine(smollm2_cache_dir(), max_model_len=1024)

    def generate(params):
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=12,
            logprobs=1,
            extra_args=None if params is None else {"kv_transfer_params": params},
        )
        out = llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
        tokens = list(out.outputs[0].token_ids)
        # The log-probability of each generated token: sensitive to every K/V it attended to.
        logprobs = [
            step[token].logprob for step, token in zip(out.outputs[0].logprobs, tokens, strict=True)
        ]
        return {"tokens": tokens, "logprobs": logprobs, "cached": out.num_cached_tokens}

    results["prefilled"] = generate(None)
    for name, memory in memories.items():
        results[name] = generate(transfer_params(memory, fact_ids))
    # A request naming facts its prompt does not hold, in another order: nothing is loaded.
    results["mismatch"] = generate(transfer_params(memories["whole_context"], fact_ids[::-1]))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
