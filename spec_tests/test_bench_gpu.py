"""The GPU generate benchmark says plainly when there is no CUDA device, and writes nothing."""

from __future__ import annotations

import pytest
import torch

from kvstack.bench import gpu
from kvstack.errors import KVStackError
from spec_tests.tiny import tiny_llama_config


def tiny_llama():
    """A two-layer GQA Llama: the GPU run's code paths on the CPU in seconds."""
    return tiny_llama_config()


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


def test_the_gpu_run_on_the_cpu_measures_every_figure_it_names():
    """The whole GPU run, on the CPU with a tiny model (numbers meaningless): every figure of
    issue 13's set is there and finite, each ratio is what its timings give, PagedCache's
    tokens were checked against DynamicCache's at every batch, and the graph figure is
    recorded as not measured instead of being estimated."""
    import math

    config = tiny_llama()
    measured = gpu.measure_on(
        torch.device("cpu"), True, lambda message: None, dtype="float32", config=config
    )
    figures = {name: figure.value for name, figure in measured.figures.items()}
    assert all(math.isfinite(value) and value > 0 for value in figures.values()), figures
    for batch in gpu.QUICK_BATCHES:
        for cache in ("dynamic", "paged", "h2o"):
            assert f"gpu.tokens_per_s.{cache}.b{batch}" in figures
        tokens = {c: figures[f"gpu.tokens_per_s.{c}.b{batch}"] for c in ("dynamic", "paged", "h2o")}
        assert figures[f"gpu.paged_over_dynamic.b{batch}"] == pytest.approx(
            tokens["paged"] / tokens["dynamic"]
        )
        assert figures[f"gpu.token_table_over_dynamic.h2o.0.5.b{batch}"] == pytest.approx(
            tokens["h2o"] / tokens["dynamic"]
        )
        assert measured.figures[f"gpu.paged_over_dynamic.b{batch}"].target == (">=", 0.95)
    decode = measured.workload["decode_attention"]
    assert decode["backend"] in ("cpp", "compiled", "reference")  # no CUDA kernels on a CPU
    assert figures["gpu.decode_attention.bandwidth_fraction"] == pytest.approx(
        decode["attention_gb_per_s"] / decode["copy_gb_per_s"]
    )
    # K and V of every slot plus the slots and positions, in the workload's dtype (fp32 here).
    h_kv, d = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    slots = gpu.QUICK_DECODE_BATCH * gpu.QUICK_DECODE_CONTEXT
    assert decode["bytes_read"] == 2 * slots * h_kv * d * 4 + 2 * slots * 8
    assert "gpu.graph_replay_speedup" not in figures
    assert "gpu.graph_replay_speedup" in measured.workload["not_measured"]


def test_a_paged_token_mismatch_stops_the_gpu_run(monkeypatch):
    """PagedCache never evicts: a token that differs from DynamicCache's stops the run."""
    from kvstack.bench import timing

    real = timing.time_interleaved

    def tampered(fns, repeats, warmup=1, **kwargs):
        timings = real(fns, repeats, warmup, **kwargs)
        timings.results["paged"] = timings.results["paged"].clone()
        timings.results["paged"][0, -1] += 1
        return timings

    monkeypatch.setattr(gpu, "time_interleaved", tampered)
    config = tiny_llama()
    with pytest.raises(KVStackError, match="PagedCache generated other tokens"):
        gpu._generate_timings(config, torch.device("cpu"), "float32", 1, 16, 2, 1)
