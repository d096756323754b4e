"""kvstack inside vLLM, through vLLM's own extension points (an optional extra: ``make
vllm-env`` builds a venv with the CPU build of vLLM and kvstack installed in it).

* ``kvstack.vllm.connector.FactConnector``: a ``KVConnectorBase_V1`` that loads a saved
  ``FactMemory``'s K/V into vLLM's paged cache at a request's positions, so vLLM skips their
  prefill. Select it with ``KVTransferConfig(kv_connector="FactConnector",
  kv_connector_module_path="kvstack.vllm.connector", kv_role="kv_both")``.

Nothing here is imported by ``import kvstack``; importing ``kvstack.vllm.connector`` needs vLLM.
"""
