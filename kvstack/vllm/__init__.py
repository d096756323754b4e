"""kvstack inside vLLM, through vLLM's own extension points (an optional extra: ``make
vllm-env`` builds a venv with the CPU build of vLLM and kvstack installed in it).

* ``kvstack.vllm.connector.FactConnector``: a ``KVConnectorBase_V1`` that loads a saved
  ``FactMemory``'s K/V into vLLM's paged cache at a request's positions, so vLLM skips their
  prefill. Select it with ``KVTransferConfig(kv_connector="FactConnector",
  kv_connector_module_path="kvstack.vllm.connector", kv_role="kv_both")``.

* ``transfer_params``: what a request names for it (the saved store and its facts).

``kvstack.vllm`` itself needs no vLLM; ``kvstack.vllm.connector`` does (vLLM imports it in its
engine and worker processes).
"""

from __future__ import annotations

from typing import Any

from kvstack.errors import InvalidArgumentError

PARAMS_KEY = "kvstack_facts"  # in kv_transfer_params: {"store": path, "facts": [ids]}


def transfer_params(memory: Any, fact_ids: list[str]) -> dict[str, Any]:
    """A request's ``kv_transfer_params`` for a prompt of ``memory.prompt_ids(memory.prefix,
    fact_ids, ...)``; the memory must be saved (its ``path``)."""
    if memory.path is None:
        raise InvalidArgumentError(
            "memory has no path; build it with FactMemory(path=...) and save() it first"
        )
    return {PARAMS_KEY: {"store": str(memory.path), "facts": list(fact_ids)}}


__all__ = ["PARAMS_KEY", "transfer_params"]
