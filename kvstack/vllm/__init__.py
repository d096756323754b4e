"""kvstack inside vLLM, through vLLM's own extension points (an optional extra: ``make
vllm-env`` builds a venv with the CPU build of vLLM and kvstack installed in it).

* ``kvstack.vllm.connector.FactConnector``: a ``KVConnectorBase_V1`` that loads a saved
  ``FactMemory``'s K/V into vLLM's paged cache at a request's positions, so vLLM skips their
  prefill. Select it with ``KVTransferConfig(kv_connector="FactConnector",
  kv_connector_module_path="kvstack.vllm.connector", kv_role="kv_both")``.

* ``transfer_params``: what a request names for it (the saved store and its facts);
  ``fact_engine``: a ``vllm.LLM`` with the connector selected; ``cpu_environment``: the
  environment the CPU build runs in.

``kvstack.vllm`` itself needs no vLLM; ``kvstack.vllm.connector`` does (vLLM imports it in its
engine and worker processes).
"""

from __future__ import annotations

import os
from typing import Any

from kvstack.errors import InvalidArgumentError

PARAMS_KEY = "kvstack_facts"  # in kv_transfer_params: {"store": path, "facts": [ids]}


def transfer_params(memory: Any, fact_ids: list[str]) -> dict[str, Any]:
    """A request's ``kv_transfer_params`` for a prompt of ``memory.prompt_ids(memory.prefix,
    fact_ids, ...)``; the memory must be saved (its ``path``, given to vLLM as an absolute
    path)."""
    if memory.path is None:
        raise InvalidArgumentError(
            "memory has no path; build it with FactMemory(path=...) and save() it first"
        )
    # Absolute: vLLM's engine core and workers read it in their own processes, whose working
    # directory need not be this one's.
    store = os.path.abspath(memory.path)
    return {PARAMS_KEY: {"store": store, "facts": list(fact_ids)}}


def fact_engine(model_dir: Any, **options: Any) -> Any:
    """A vLLM engine (CPU build, fp32, eager) with ``FactConnector`` selected and prefix caching
    off, which the connector needs; ``options`` override ``vllm.LLM``'s arguments."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    connector = KVTransferConfig(
        kv_connector="FactConnector",
        kv_connector_module_path="kvstack.vllm.connector",
        kv_role="kv_both",
    )
    defaults = dict(
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        block_size=32,
        enable_prefix_caching=False,
        kv_transfer_config=connector,
    )
    return LLM(model=str(model_dir), **(defaults | options))


def cpu_environment(threads_bind: str) -> dict[str, str]:
    """Environment for vLLM's CPU build: 1 GiB of KV cache (which also skips its check of the
    free RAM fraction) and ``threads_bind`` for its worker's threads ("0": core 0 only,
    "nobind": any core)."""
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": threads_bind}


__all__ = ["PARAMS_KEY", "cpu_environment", "fact_engine", "transfer_params"]
