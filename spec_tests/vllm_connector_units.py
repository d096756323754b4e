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
    from kvstack.vllm import transfer_params
    from kvstack.vllm.connector import FactConnector, FactConnectorMetadata, FactLoad, SavedFacts
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
        "resumed": FactLoad("resumed", "store", 0, ["f0"], 0, 20),
        "waiting": FactLoad("waiting", "store", 0, ["f1"], 0, 10),
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

        # The worker side: a load whose store is gone since scheduling does not raise (that
        # would stop vLLM's worker); its blocks are reported once, and the other load is
        # written. Caches in vLLM's CPU layout [blocks, H_kv, block_size, 2 * D].
        worker = FactConnector.__new__(FactConnector)
        worker.block_size, worker.hf_config, worker._rotary = 4, model.config, None
        worker._stores, worker._failed_blocks = {}, set()
        heads = model.config.num_key_value_heads
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        (fact_id,) = memory.facts
        tokens = len(memory.facts[fact_id].token_ids)
        used = -(-tokens // 4)  # blocks of 4 tokens each load writes
        worker._caches = [torch.zeros(2 * used + 1, heads, 4, 2 * head_dim) for _ in range(2)]
        good = FactLoad("good", path, 0, [fact_id], 0, tokens, block_ids=list(range(used)))
        gone_blocks = list(range(used + 1, 2 * used + 1))
        gone = FactLoad("gone", f"{path}/gone", 0, [fact_id], 0, tokens, block_ids=gone_blocks)
        worker.bind_connector_metadata(FactConnectorMetadata(loads=[gone, good]))
        worker.start_load_kv(None)
        results["failed_blocks"] = sorted(worker.get_block_ids_with_load_errors())
        results["failed_again"] = sorted(worker.get_block_ids_with_load_errors())
        results["gone_blocks"] = gone_blocks
        written = [bool(c[:used].abs().sum(dim=(1, 2, 3)).gt(0).all()) for c in worker._caches]
        untouched = [bool(c[used:].eq(0).all()) for c in worker._caches]
        results["good_written"] = all(written) and all(untouched)

        # A load names the save the scheduler matched: saved again before the worker loads it,
        # the store's K/V are refused (reported by their blocks, nothing written), while a load
        # matched against the new save is written.
        scheduler = FactConnector.__new__(FactConnector)
        scheduler.hf_config, scheduler._stores = model.config, {}
        scheduler._pending, scheduler._matched = {}, {}
        request = SimpleNamespace(
            request_id="pinned",
            kv_transfer_params=transfer_params(memory, [fact_id]),
            prompt_token_ids=memory.prompt_ids(memory.prefix, [fact_id], "Who?"),
            num_computed_tokens=0,
        )
        matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
        memory.add("Tom bakes bread in Lisbon.")
        memory.save()  # serial 1, between the match and the allocation
        scheduler.update_state_after_alloc(request, None, matched)
        pinned = scheduler._pending["pinned"]
        results["pinned_serial"], results["serial_now"] = pinned.serial, SavedFacts(path).serial
        for cache in worker._caches:
            cache.zero_()
        pinned.block_ids = list(range(used))
        current = FactLoad("current", path, 1, [fact_id], 0, tokens, list(range(used, 2 * used)))
        worker.bind_connector_metadata(FactConnectorMetadata(loads=[pinned, current]))
        worker.start_load_kv(None)
        results["stale_failed_blocks"] = sorted(worker.get_block_ids_with_load_errors())
        results["stale_blocks"] = pinned.block_ids
        results["stale_untouched"] = all(bool(c[:used].eq(0).all()) for c in worker._caches)
        results["current_written"] = all(
            bool(c[used : 2 * used].abs().sum(dim=(1, 2, 3)).gt(0).all()) for c in worker._caches
        )

    # Tensor, pipeline or context parallelism: refused when the worker registers its caches.
    def parallel(**sizes):
        base = dict(tensor_parallel_size=1, pipeline_parallel_size=1, world_size=1)
        return SimpleNamespace(parallel_config=SimpleNamespace(**(base | sizes)))

    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 2, 4, 32) for i in (1, 0)}
    for name, sizes in {
        "one_worker": {},
        "tensor_parallel": dict(tensor_parallel_size=2, world_size=2),
        "pipeline_parallel": dict(pipeline_parallel_size=2, world_size=2),
        "decode_context_parallel": dict(decode_context_parallel_size=2),
    }.items():
        worker = FactConnector.__new__(FactConnector)
        worker._vllm_config, worker._caches = parallel(**sizes), []
        try:
            worker.register_kv_caches(caches)
            results[name] = len(worker._caches)
        except ValueError as error:
            results[name] = f"{type(error).__name__}: {error}"
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
