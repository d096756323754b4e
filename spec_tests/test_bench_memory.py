"""The memory benchmark's quick run on SmolLM2: every figure is there and finite, injection is
faster than prefill, accuracy is a fraction, and the README table renders from what it
measured."""

from __future__ import annotations

import math

import pytest

from kvstack.bench.memory import measure, readme_tables


@pytest.fixture(scope="module")
def quick_run():
    return measure(True, lambda message: None)


def test_the_quick_run_measures_every_figure(quick_run):
    figures = quick_run.figures
    assert set(figures) == {
        "memory.ttft_speedup.k2",
        "memory.ttft_speedup.k4",
        "memory.ttft_flatness",
        "memory.accuracy.prefill",
        "memory.accuracy.inject_w0",
        "memory.accuracy.inject_w5",
        "memory.accuracy.inject_w0_alone",
        "memory.accuracy_gap.inject_w5",
        "memory.throughput_ratio",
        "memory.ttft_speedup.k4.first4",
        "memory.ttft_speedup.k4.first8",
        "memory.accuracy.inject_w5_first4",
        "memory.accuracy.inject_w5_first8",
    } | ({"memory.vllm.ttft_speedup.k4"} if quick_run.workload["vllm"] is not None else set())
    assert all(math.isfinite(f.value) for f in figures.values())
    for side in ("prefill", "inject_w0", "inject_w5", "inject_w0_alone", "inject_w5_first4"):
        assert 0 <= figures[f"memory.accuracy.{side}"].value <= 1
    workload = quick_run.workload
    assert workload["questions"] == 6 and workload["facts"] == 24
    # More facts, longer prompts; every question got an answer on every side.
    assert workload["prompt_tokens"][4] > workload["prompt_tokens"][2]
    assert all(len(answers) == 6 for answers in workload["answers"].values())
    # The engine served 3 questions at once both ways; giving it the facts' K/V is faster.
    throughput = workload["throughput"]
    assert throughput["requests"] == 3 and throughput["k"] == 4
    assert figures["memory.throughput_ratio"].value > 1
    if workload["vllm"] is not None:  # vLLM's engine took the header and facts from the store
        assert all(cached > 0 for cached in workload["vllm"]["cached"])


def test_the_readme_table_renders_from_the_results(quick_run):
    results = {
        "figures": {name: f.record() for name, f in quick_run.figures.items()},
        "workload": quick_run.workload,
    }
    table = readme_tables(results)["memory"]
    assert "`memory.ttft_speedup.k4`" in table and "k=2:" in table
