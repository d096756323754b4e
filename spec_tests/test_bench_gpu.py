"""The GPU generate benchmark says plainly when there is no CUDA device, and writes nothing."""

from __future__ import annotations

import pytest
import torch

from kvstack.bench import gpu
from kvstack.errors import KVStackError


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the gpu test runs")
def test_gpu_bench_without_cuda_says_so_and_writes_nothing(tmp_path):
    from kvstack.bench.suite import RESULTS_DIR

    before = sorted(RESULTS_DIR.glob("*.json")) if RESULTS_DIR.exists() else []
    with pytest.raises(KVStackError, match="needs a CUDA device"):
        gpu.main(["--out", str(tmp_path / "gpu")])
    assert not (tmp_path / "gpu").exists()
    assert (sorted(RESULTS_DIR.glob("*.json")) if RESULTS_DIR.exists() else []) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_gpu_bench_quick_runs_and_paged_matches_dynamic(tmp_path):
    figures = gpu.run_gpu(tmp_path, quick=True)
    assert figures["gpu.paged_over_dynamic"] > 0
    assert (tmp_path / "results.json").exists()
