"""``FactConnector``: a saved ``FactMemory`` served inside vLLM through its KV-connector
interface (``KVConnectorBase_V1``), without modifying the engine (InferScale).

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    llm = LLM(model=DIR, enable_prefix_caching=False, kv_transfer_config=KVTransferConfig(
        kv_connector="FactConnector", kv_connector_module_path="kvstack.vllm.connector",
        kv_role="kv_both"))
    ids = memory.prompt_ids(memory.prefix, fact_ids, tail)     # header = the memory's prefix
    params = SamplingParams(max_tokens=20, extra_args={
        "kv_transfer_params": kvstack.vllm.transfer_params(memory, fact_ids)})
    llm.generate([{"prompt_token_ids": ids}], params)

A request names a saved store and the facts its prompt holds, in order, right after the store's
prefix (the header). The scheduler side checks the prompt's tokens against the store's (the
prefix's and each fact's), and reports that many tokens as computed (all but the prompt's
last: vLLM computes at least one), so vLLM skips their prefill. The worker side reads the
prefix's and facts' K/V from the store (keys kept at position 0), re-rotates the keys to the
tokens' positions with the model's RoPE (the registered ``rerotate_keys``), and writes them
into the request's blocks before the forward pass: the load is synchronous.

vLLM's CPU backend only, whose per-layer cache is [blocks, kv_heads, block_size, 2 * head_dim]:
per block and head, keys transposed ([head_dim, block_size]) then values ([block_size,
head_dim]). Prefix caching must be off (``enable_prefix_caching=False``; the connector refuses
to start otherwise): it would index the loaded blocks under the prompt's tokens and hand them
to any later prompt with those tokens. A request vLLM preempts and later resumes gets its
facts loaded again into its new blocks. A store saved for a model of another geometry (layers,
KV heads, head size, RoPE) is not loaded: the request is prefilled as usual, with a warning. A
load that fails on the worker (the store deleted or damaged after the scheduler matched it)
does not stop the worker: its blocks are reported through ``get_block_ids_with_load_errors``,
and vLLM's ``kv_load_failure_policy`` fails the request ("fail", the default) or recomputes its
tokens ("recompute"). So does a store saved again since the scheduler matched it: a load names
the serial of the save it matched (``FactLoad.serial``), and the worker loads K/V from that save
only, never from a later one whose facts may hold other tokens.

One worker only: the load writes every layer and KV head of the request's blocks, so tensor,
pipeline and context parallelism (which shard them across workers) are refused when the worker
registers its caches. Data parallelism is fine: each engine has its own connector.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstack.errors import InvalidArgumentError
from kvstack.facts import storage
from kvstack.facts.memory import rope_refusal, rotate_keys_by
from kvstack.facts.storage import StoreChanged
from kvstack.vllm import PARAMS_KEY

logger = logging.getLogger(__name__)


class SavedFacts:
    """One save of a fact store, read-only: the tokens and the K/V of its prefix and facts, and
    its ``serial``. The index is read at once; the tensors file only when K/V are first asked
    for (``tensors``): the scheduler, which matches tokens, never reads or checksums it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.index = storage.read_index(path)
        self.serial: int = self.index["serial"]
        self.token_ids = {f["id"]: list(f["token_ids"]) for f in self.index["facts"]}
        self.prefix_ids = list(self.index.get("prefix_ids", []))
        self._tensors: Any = None

    @property
    def tensors(self) -> Any:
        """This save's tensors file, opened (and checked) on first use; ``StoreChanged`` when a
        later save has replaced it."""
        if self._tensors is None:
            self._tensors = storage.open_tensors(self.path, self.index)
        return self._tensors

    def mismatch(self, hf_config: Any) -> str | None:
        """Why this store's K/V cannot serve a model of ``hf_config`` (None: they can). The
        weights themselves are not compared: the scheduler does not hold them."""
        from kvstack.facts.memory import rope_description

        config = hf_config.get_text_config(decoder=True)
        served = {
            "layers": config.num_hidden_layers,
            "kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "head_dim": getattr(config, "head_dim", None)
            or config.hidden_size // config.num_attention_heads,
            "rope": rope_description(config),
        }
        saved = {key: self.index["model"].get(key) for key in served}
        if saved != served:
            return f"the store was saved for {saved}; vLLM serves {served}"
        # (A store saved before FactMemory refused these RoPEs.)
        return rope_refusal(config)

    def covered_tokens(self, fact_ids: list[str], prompt: list[int]) -> int:
        """How many tokens at the start of ``prompt`` are the prefix and then these facts, in
        order, token for token; 0 when the prompt does not start that way."""
        expected = list(self.prefix_ids)
        for fact_id in fact_ids:
            if fact_id not in self.token_ids:
                return 0
            expected += self.token_ids[fact_id]
        return len(expected) if prompt[: len(expected)] == expected else 0

    def segments(self, fact_ids: list[str]) -> list[tuple[str, int]]:
        """(tensor name stem, tokens) of the prefix and each fact, in prompt order."""
        parts = [("prefix", len(self.prefix_ids))] if self.prefix_ids else []
        return parts + [(f, len(self.token_ids[f])) for f in fact_ids]

    def kv(self, fact_ids: list[str], start: int, end: int, rotary: Any):
        """Keys rotated at positions [start, end) and values, each [L, end - start, H_kv, D],
        of the prompt's covered tokens."""
        keys, values = [], []
        for stem, _ in self.segments(fact_ids):
            keys.append(self.tensors.get_tensor(f"{stem}.k"))  # [L, T, H_kv, D], at position 0
            values.append(self.tensors.get_tensor(f"{stem}.v"))
        keys = torch.cat(keys, dim=1)[:, start:end]
        values = torch.cat(values, dim=1)[:, start:end]
        return rotate_keys_by(keys, torch.arange(start, end), rotary), values


@dataclass
class FactLoad:
    """One request's load: its facts' tokens [start, end) into its blocks, from the save of
    ``store`` with ``serial`` (the one the scheduler matched the prompt against)."""

    request_id: str
    store: str
    serial: int
    facts: list[str]
    start: int
    end: int
    block_ids: list[int] = field(default_factory=list)


@dataclass
class FactConnectorMetadata(KVConnectorMetadata):
    loads: list[FactLoad] = field(default_factory=list)


def _cpu_cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [blocks, H, D, block_size], values [blocks, H, block_size, D]) of one layer's
    CPU-backend cache [blocks, H, block_size, 2 * D]."""
    blocks, heads, block_size, two_d = cache.shape
    halves = cache.view(blocks, heads, 2, block_size * two_d // 2)  # [blocks, H, K|V, bs * D]
    keys = halves[:, :, 0].view(blocks, heads, two_d // 2, block_size)  # keys transposed
    values = halves[:, :, 1].view(blocks, heads, block_size, two_d // 2)
    return keys, values


def _check_one_worker(parallel_config: Any) -> None:
    """Refuse a vLLM that shards the KV cache over workers: a load writes every layer and KV
    head of its blocks from one worker (tensor parallelism splits the heads, pipeline
    parallelism the layers, context parallelism the tokens)."""
    sizes = {
        name: getattr(parallel_config, name, 1)  # (older vLLMs lack the context ones)
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
        )
    }
    sharded = {name: size for name, size in sizes.items() if size != 1}
    if sharded:
        raise InvalidArgumentError(
            f"FactConnector got parallel_config with {sharded} (world size "
            f"{getattr(parallel_config, 'world_size', '?')}); expected 1 each: its loads write "
            "every layer and KV head of a request's blocks from one worker"
        )


def _layer_number(name: str) -> int:
    found = re.search(r"layers\.(\d+)\.", name)
    if found is None:
        raise ValueError(f"cannot tell the layer of KV cache {name!r}")
    return int(found.group(1))


class FactConnector(KVConnectorBase_V1):
    """See the module docstring."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
            raise ValueError(
                "FactConnector needs enable_prefix_caching=False (prefix caching would hand the "
                "loaded facts' blocks to other prompts with the same tokens); got True"
            )
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.hf_config = vllm_config.model_config.hf_config
        self._stores: dict[str, tuple[tuple[int, int], SavedFacts]] = {}  # path -> (stat, store)
        self._pending: dict[str, FactLoad] = {}  # scheduler: loads awaiting their blocks
        self._matched: dict[str, int] = {}  # scheduler: request -> serial its tokens matched
        self._caches: list[torch.Tensor] = []  # worker: the layers' caches, in layer order
        self._rotary: Any = None
        self._failed_blocks: set[int] = set()  # worker: blocks of loads that failed

    def _store(self, path: str) -> SavedFacts:
        """The store at ``path``, read again when its index changed (a later save). A save
        renames a new index into place: a new inode, whatever the clock's resolution."""
        stat = (Path(path) / storage.INDEX).stat()
        version = (stat.st_ino, stat.st_mtime_ns)
        cached = self._stores.get(path)
        if cached is None or cached[0] != version:
            self._stores[path] = (version, SavedFacts(path))
        return self._stores[path][1]

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if not params:
            return 0, False
        try:
            store = self._store(params["store"])
            mismatch = store.mismatch(self.hf_config)
            if mismatch is not None:
                raise ValueError(mismatch)
            covered = store.covered_tokens(list(params["facts"]), list(request.prompt_token_ids))
        except Exception as error:  # a missing, damaged or foreign store: prefill as usual
            logger.warning("kvstack facts for %s not loaded: %s", request.request_id, error)
            return 0, False
        if covered == 0:
            logger.warning(
                "kvstack facts for %s not loaded: the prompt does not start with the store's "
                "prefix and the named facts",
                request.request_id,
            )
        # vLLM computes at least the prompt's last token (it needs its logits).
        covered = min(covered, len(request.prompt_token_ids) - 1)
        # The save these tokens matched: the load must read this one (another save may hold
        # other tokens under the same fact ids). Kept per request: another request's match can
        # read a newer save of the same path before this one's blocks are allocated.
        self._matched[request.request_id] = store.serial
        return max(0, covered - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params[PARAMS_KEY]
        start = request.num_computed_tokens
        self._pending[request.request_id] = FactLoad(
            request.request_id,
            params["store"],
            self._matched.pop(request.request_id),
            list(params["facts"]),
            start,
            start + num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: Any) -> FactConnectorMetadata:
        meta = FactConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            load = self._pending.pop(new.req_id, None)
            if load is not None:
                load.block_ids = list(new.block_ids[0])
                meta.loads.append(load)
        # A request resumed after preemption lost its blocks; the scheduler matched its facts
        # again (update_state_after_alloc) and lists it among the cached requests, with all of
        # its new blocks.
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id not in cached.resumed_req_ids or request_id not in self._pending:
                continue
            load = self._pending.pop(request_id)
            load.block_ids = list(cached.new_block_ids[i][0])
            meta.loads.append(load)
        return meta

    def request_finished(self, request: Any, block_ids: list[int]):
        self._pending.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        _check_one_worker(self._vllm_config.parallel_config)
        by_layer = sorted(kv_caches.items(), key=lambda item: _layer_number(item[0]))
        self._caches = [cache for _, cache in by_layer]
        for cache in self._caches:
            if cache.device.type != "cpu" or cache.dim() != 4:
                raise NotImplementedError(
                    f"FactConnector writes vLLM's CPU cache layout [blocks, kv_heads, "
                    f"block_size, 2 * head_dim]; got {tuple(cache.shape)} on {cache.device}"
                )

    def _rotary_embedding(self) -> Any:
        if self._rotary is None:
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

            self._rotary = LlamaRotaryEmbedding(config=self.hf_config)
        return self._rotary

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for load in meta.loads:
            try:
                self._load(load)
            except Exception as error:  # a store deleted, damaged or replaced since scheduling
                # Raising here would stop vLLM's worker, and every request with it. vLLM's
                # contract is to report the blocks: its kv_load_failure_policy then fails this
                # request ("fail", the default) or recomputes the tokens ("recompute").
                logger.warning("kvstack facts for %s not loaded: %s", load.request_id, error)
                self._failed_blocks.update(self._blocks_of(load).tolist())

    def _blocks_of(self, load: FactLoad) -> torch.Tensor:
        """The block of each position [start, end) the load writes: [end - start]."""
        positions = torch.arange(load.start, load.end)
        return torch.tensor(load.block_ids, dtype=torch.long)[positions // self.block_size]

    def _load(self, load: FactLoad) -> None:
        """Write one request's facts into its blocks: everything is read and checked first, so
        a failure writes nothing."""
        store = self._store(load.store)
        if store.serial != load.serial:
            raise StoreChanged(
                f"the fact store {load.store!r} is at serial {store.serial} now; the scheduler "
                f"matched the prompt against serial {load.serial}, whose K/V are gone"
            )
        keys, values = store.kv(load.facts, load.start, load.end, self._rotary_embedding())
        if keys.shape[0] != len(self._caches):
            raise ValueError(
                f"the store holds {keys.shape[0]} layers; this model has {len(self._caches)}"
            )
        blocks = self._blocks_of(load)
        offsets = torch.arange(load.start, load.end) % self.block_size
        for layer, cache in enumerate(self._caches):
            cache_keys, cache_values = _cpu_cache_views(cache)
            cache_keys[blocks, :, :, offsets] = keys[layer].to(cache.dtype)  # [T, H, D]
            cache_values[blocks, :, offsets] = values[layer].to(cache.dtype)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of loads that failed since the last call (vLLM asks after each forward
        pass; a synchronous load's failures are reported in the pass that found them)."""
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loaded whole in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return  # facts are only loaded

    def wait_for_save(self) -> None:
        return


__all__ = ["FactConnector", "SavedFacts"]
