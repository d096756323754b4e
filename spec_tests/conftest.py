"""Shared test set-up: hypothesis profiles and device parametrisation.

Profiles (choose with ``--hypothesis-profile=NAME``; default ``ci`` when CI is set, else ``dev``):
  ci        bounded and deterministic (derandomized), sized to fit CI on 2 CPU cores;
  dev       more examples, random seeds;
  thorough  many examples, for a long local or nightly run.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

_common = dict(
    deadline=None,  # the first call of a compiled op compiles; timing is not what we test
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=60, **_common)
settings.register_profile("thorough", max_examples=500, **_common)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# Hypothesis draws many shapes; dynamo's default of 8 graphs per function would silently fall
# back to eager after that, and the "compiled" side of an equivalence test would not be compiled.
# Allow more graphs, and fail loudly rather than fall back.
torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.fail_on_recompile_limit_hit = True


@pytest.fixture(autouse=True, scope="module")
def _fresh_dynamo_per_module():
    """Each test module starts with dynamo's caches empty.

    The limit counts graphs per function over the whole process, and the suite compiles the
    kernels for dozens of unrelated model shapes and dtypes (64 graphs of ``_decode`` by the
    time ``test_hf_token_table_cache`` runs). Per module, the limit still fails any one
    workload that would fall back to eager, which is what it is here to catch."""
    torch._dynamo.reset()
    yield


def devices() -> list:
    """CPU always; CUDA (marked ``gpu``) where a device exists."""
    found = [pytest.param("cpu", id="cpu")]
    found.append(
        pytest.param(
            "cuda",
            id="cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
            ],
        )
    )
    return found


@pytest.fixture
def reference_attention():
    """Run the kvstack attention on the reference backend (the specification; no compile per
    new shape) with transformers' FutureWarnings silenced; the fastest backend afterwards."""
    import kvstack.hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        kvstack.hf.set_backend("reference")
        try:
            yield
        finally:
            kvstack.hf.set_backend(None)
