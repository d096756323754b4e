"""Run by ``test_vllm_connector.py`` with the vLLM venv's python: the connector's scheduler side
on its own, with scheduler outputs of vLLM's shape. Prints one JSON line of results."""

from __future__ import annotations

import json
import sys
import tempfile
from types import SimpleNamespace


def main() -> None:
    import torch
    from transformers import LlamaForCausalLM

    from kvstack.facts import FactMemory
    from kvstack.vllm.connector import FactConnector, FactLoad, SavedFacts
    from spec_tests.tiny import tiny_llama_config

    class ByteTokenizer:  # one token per byte (spec_tests.test_facts' tokenizer)
        def __call__(self, text, add_special_tokens=False):
            return SimpleNamespace(input_ids=[b % 255 + 1 for b in text.encode()])

    def word_embedder(texts):
        return torch.ones(len(texts), 4)

    results: dict = {}
    # Prefix caching on: refused before anything is built.
    config = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True))
    try:
        FactConnector(config, None)
        results["prefix_caching"] = "accepted"
    except ValueError as error:
        results["prefix_caching"] = str(error)

    # A request preempted and resumed is listed among the cached requests with all its new
    # blocks: its facts are loaded into them.
    connector = FactConnector.__new__(FactConnector)
    connector._pending = {
        "resumed": FactLoad("resumed", "store", ["f0"], 0, 20),
        "waiting": FactLoad("waiting", "store", ["f1"], 0, 10),
    }
    output = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=["running", "resumed"],
            resumed_req_ids={"resumed"},
            new_block_ids=[([9],), ([4, 7],)],
        ),
    )
    meta = connector.build_connector_meta(output)
    results["resumed_loads"] = [(load.request_id, load.block_ids) for load in meta.loads]
    results["still_pending"] = sorted(connector._pending)

    # A store saved for another geometry is not loaded.
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=2)).eval()
    with tempfile.TemporaryDirectory() as path:
        memory = FactMemory(model, ByteTokenizer(), word_embedder, path)
        memory.add("Maya's dog is named Biscuit.")
        memory.save()
        store = SavedFacts(path)
        results["same_model"] = store.mismatch(model.config)
        results["other_model"] = store.mismatch(tiny_llama_config(num_hidden_layers=3))
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
