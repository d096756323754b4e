"""``kvstack figures``: README tables rendered from results files, and a check that can fail.

The results here are built through the core suite's own code from a synthetic pytest-benchmark
JSON (known medians, so the ratios are known), not read from the committed files: the tests
hold whatever is committed.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvstack.bench import core, figures
from kvstack.bench.suite import REPO_ROOT, Figure, Measured, provenance

IMPLEMENTATIONS = {"reference": 10.0, "compiled": 1.0, "contiguous_sdpa": 2.0}  # ms


def _benchmark_json(cpp: bool = True) -> dict:
    """Known medians; ``cpp``: with the cpp backend's benchmarks (a machine with a compiler)."""
    benchmarks = []

    def add(op, path, implementation, context, ms, **more):
        info = {"op": op, "path": path, "implementation": implementation, "context": context}
        info.update(batch=8, num_query_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
        info.update(dtype="torch.float32", threads=1, **more)
        benchmarks.append(
            {
                "name": f"{op}-{path}-{implementation}-{context}",
                "extra_info": info,
                "stats": {"median": ms / 1e3, "rounds": 3},
            }
        )

    timed = {**IMPLEMENTATIONS, **({"cpp": 0.25} if cpp else {})}
    for context in (1024, 4096, 8192):
        for implementation, ms in timed.items():
            add("paged_attention", "paged", implementation, context, ms * context / 4096)
    for path in ("several_kv_heads", "one_kv_head"):
        for implementation, ms in timed.items():
            add("decode_attention", path, implementation, 4096, ms)
    for implementation, ms in timed.items():
        if implementation != "contiguous_sdpa":  # the ragged step has no SDPA twin
            add(
                "ragged_decode_attention",
                "headwise",
                implementation,
                1300,
                3 * ms,
                kept_tokens=[780, 390, 195],
                work_rows=3,
                workers=1,
            )
    for implementation, ms in (
        ("copy_slots", 4.0),
        ("compiled_copy_slots", 8.0),
        ("plain_copy", 2.0),
    ):
        add(
            "copy_slots",
            "repack",
            implementation,
            4096,
            ms,
            copy_slots_backend="cpp",
            moved_rows=100,
            bytes_moved=8e6,
        )
    return {"benchmarks": benchmarks}


def _results(commit: str) -> dict:
    measured, workload = core._figures(_benchmark_json(), quick=False)
    return {
        "suite": "core",
        "quick": False,
        "commit": commit,
        "dirty": False,
        "dirty_dependencies": [],
        "machine": {"cpu": "test CPU", "cores": 2, "torch_threads": 1, "gpu": None},
        "versions": {"python": "3", "torch": "2", "transformers": "5"},
        "command": "kvstack bench core --out DIR",
        "date": "2026-01-01T00:00:00Z",
        "wall_seconds": 60.0,
        "depends_on": list(core.DEPENDS_ON),
        "workload": workload,
        "figures": {name: f.record() for name, f in measured.items()},
    }


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(REPO_ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def _write(tmp_path, results: dict, readme_text: str):
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    (results_dir / "core.json").write_text(json.dumps(results))
    readme = tmp_path / "README.md"
    readme.write_text(readme_text)
    return readme, results_dir


README = "# x\n\nText.\n\n<!-- figures: core -->\n<!-- /figures -->\n\nMore text.\n"


def test_core_ratios_come_from_the_medians():
    measured, _ = core._figures(_benchmark_json(), quick=False)
    value = {name: f.value for name, f in measured.items()}
    assert value["paged_attention.compiled_over_reference"] == pytest.approx(10.0)
    assert value["paged_attention.compiled_over_contiguous_sdpa"] == pytest.approx(0.5)
    assert value["decode_attention.one_kv_head.compiled_over_reference"] == pytest.approx(10.0)
    assert value["repack.bandwidth_fraction"] == pytest.approx(0.5)  # half the plain copy's
    assert value["repack.copy_slots_gb_per_s"] == pytest.approx(8e6 / 1e9 / 4e-3)
    assert value["repack.compiled_bandwidth_fraction"] == pytest.approx(0.25)
    assert "cpp backend" in measured["repack.bandwidth_fraction"].description
    assert measured["repack.bandwidth_fraction"].met() is False  # target >= 0.7
    assert measured["paged_attention.compiled_over_reference"].met() is True  # >= 10
    assert value["paged_attention.cpp_over_compiled"] == pytest.approx(4.0)
    assert value["paged_attention.cpp_over_contiguous_sdpa"] == pytest.approx(0.125)
    assert value["decode_attention.one_kv_head.cpp_over_compiled"] == pytest.approx(4.0)
    assert value["ragged_decode_attention.cpp_over_compiled"] == pytest.approx(4.0)
    assert value["ragged_decode_attention.compiled_over_reference"] == pytest.approx(10.0)


def test_core_figures_leave_out_the_cpp_backend_where_it_did_not_build():
    measured, _ = core._figures(_benchmark_json(cpp=False), quick=False)
    assert not [name for name in measured if "cpp" in name]
    assert "ragged_decode_attention.compiled_over_reference" in measured


def test_render_fills_the_block_and_check_passes_on_a_current_readme(tmp_path):
    results = _results(_git("rev-parse", "HEAD"))
    readme, results_dir = _write(tmp_path, results, README)
    rendered, problems = figures.render(readme.read_text(), figures.load_results(results_dir))
    assert problems == []
    assert "| `paged_attention.compiled_over_reference` | 10 | >= 10 | met |" in rendered
    assert "| `repack.bandwidth_fraction` | 0.5 | >= 0.7 | missed |" in rendered
    assert rendered.startswith("# x\n\nText.\n") and rendered.endswith("More text.\n")
    readme.write_text(rendered)
    assert figures.render(rendered, figures.load_results(results_dir))[0] == rendered  # stable
    problems = figures.check(readme, results_dir)
    assert [p for p in problems if "differs" in p or "typed" in p] == []


def test_check_fails_when_a_readme_figure_is_edited(tmp_path):
    results = _results(_git("rev-parse", "HEAD"))
    readme, results_dir = _write(tmp_path, results, README)
    rendered, _ = figures.render(README, figures.load_results(results_dir))
    readme.write_text(rendered.replace("| 10 | >= 10 | met |", "| 12 | >= 10 | met |"))
    problems = figures.check(readme, results_dir)
    assert any("README block 'core' differs from bench/results/core.json" in p for p in problems)
    assert figures.main(True, readme, results_dir) == 1
    readme.write_text(rendered)
    assert figures.main(False, readme, results_dir) == 0  # regenerates


def test_check_fails_on_a_results_file_that_no_readme_block_shows(tmp_path):
    results = _results(_git("rev-parse", "HEAD"))
    readme, results_dir = _write(tmp_path, results, "# x\n\nNo blocks.\n")
    problems = figures.check(readme, results_dir)
    assert any("bench/results/core.json has no README block" in p for p in problems), problems
    readme.write_text(figures.render(README, figures.load_results(results_dir))[0])
    assert not any("has no README block" in p for p in figures.check(readme, results_dir))


def test_check_fails_on_a_figure_typed_outside_the_blocks(tmp_path):
    results = _results(_git("rev-parse", "HEAD"))
    readme, results_dir = _write(tmp_path, results, README + "\nDecode is 0.92x as fast.\n")
    readme.write_text(figures.render(readme.read_text(), figures.load_results(results_dir))[0])
    problems = figures.check(readme, results_dir)
    assert any("'0.92x' looks typed by hand" in p for p in problems), problems
    # Parameters in code are not figures.
    assert figures.typed_figures("Run `--ratio 0.5` with `repack_threshold=0.25`.\n") == []
    assert figures.typed_figures("It takes 38 ms per step.\n") != []


def test_results_measured_before_a_dependency_changed_are_stale():
    first = _git("rev-list", "--max-parents=0", "HEAD")
    results = _results(first)
    results["depends_on"] = ["README.md"]  # certainly changed since the first commit
    problems = figures.stale("core", results)
    assert any("is stale" in p and "README.md" in p for p in problems), problems


def test_results_at_head_with_unchanged_dependencies_are_not_stale():
    results = _results(_git("rev-parse", "HEAD"))
    dirty = _git("status", "--porcelain", "--", *core.DEPENDS_ON)
    if dirty:
        pytest.skip(f"uncommitted changes to the core suite's dependencies: {dirty.split()[:4]}")
    assert figures.stale("core", results) == []


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"commit": "0" * 40}, "is not in this repository"),
        ({"quick": True}, "is a --quick run"),
        ({"dirty_dependencies": ["compiled/attention.py"]}, "uncommitted changes to"),
    ],
)
def test_results_that_cannot_be_trusted_are_reported(change, expected):
    results = {**_results(_git("rev-parse", "HEAD")), **change}
    assert any(expected in p for p in figures.stale("core", results))


def test_provenance_names_commit_machine_and_versions():
    record = provenance(core.DEPENDS_ON)
    assert record["commit"] == _git("rev-parse", "HEAD")
    assert set(record["machine"]) >= {"cpu", "cores", "torch_threads", "gpu"}
    assert set(record["versions"]) == {"python", "torch", "transformers"}
    assert isinstance(record["dirty"], bool) and isinstance(record["dirty_dependencies"], list)


def test_a_nan_never_meets_its_target():
    assert Figure(float("nan"), "ratio", "x", (">=", 0.0)).met() is False
    assert Figure(1.0, "ratio", "x", None).met() is None


def test_a_strict_target_is_not_met_by_equality():
    assert Figure(0.9, "ratio", "x", ("<", 1.0)).met() is True
    assert Figure(1.0, "ratio", "x", ("<", 1.0)).met() is False
    assert Figure(1.0, "ratio", "x", ("<=", 1.0)).met() is True
    assert Figure(float("nan"), "ratio", "x", ("<", 1.0)).met() is False


def test_a_dependency_changed_during_a_run_is_recorded(tmp_path):
    from kvstack.bench.suite import run_suite

    probe = REPO_ROOT / "bench" / "_probe_changed_during_run.txt"  # untracked, not ignored

    def measure(quick, log):
        probe.write_text("changed while the suite ran\n")
        return Measured({"x": Figure(1.0, "ratio", "x")}, {}, "probe", [])

    try:
        run_suite(
            "core",
            measure,
            ["bench/_probe_changed_during_run.txt"],
            tmp_path,
            quick=True,
            command="probe",
            verbose=False,
            results_dir=None,
        )
    finally:
        probe.unlink(missing_ok=True)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["dirty_dependencies"] == ["bench/_probe_changed_during_run.txt"]
    assert any("uncommitted changes to" in p for p in figures.stale("core", results))


@pytest.mark.parametrize("gpu, stale", [(None, False), ("NVIDIA H200", True)])
def test_cuda_sources_stale_only_results_measured_with_a_gpu(gpu, stale):
    # An untracked CUDA source under a dependency: a CPU run never compiled or ran it.
    probe = REPO_ROOT / "cuda_kernels" / "_probe_stale.cu"
    results = _results(_git("rev-parse", "HEAD"))
    results["depends_on"] = ["cuda_kernels/_probe_stale.cu"]
    results["machine"] = {**results["machine"], "gpu": gpu}
    probe.write_text("// a kernel changed after the run\n")
    try:
        problems = figures.stale("core", results)
    finally:
        probe.unlink()
    assert any("_probe_stale.cu" in p for p in problems) is stale, problems


def test_a_cpu_source_stales_results_measured_without_a_gpu():
    probe = REPO_ROOT / "cuda_kernels" / "_probe_stale.cpp"  # a CPU C++ kernel runs on CPUs
    results = _results(_git("rev-parse", "HEAD"))
    results["depends_on"] = ["cuda_kernels/_probe_stale.cpp"]
    probe.write_text("// a CPU kernel changed after the run\n")
    try:
        problems = figures.stale("core", results)
    finally:
        probe.unlink()
    assert any("_probe_stale.cpp" in p for p in problems), problems


def test_a_cuda_source_changed_during_a_cpu_run_does_not_stale_it():
    results = _results(_git("rev-parse", "HEAD"))
    results["dirty_dependencies"] = ["cuda_kernels/paged_attention.cu"]
    assert not any("uncommitted changes" in p for p in figures.stale("core", results))
    results["machine"] = {**results["machine"], "gpu": "NVIDIA H200"}
    assert any("uncommitted changes" in p for p in figures.stale("core", results))


def test_both_make_bench_targets_run_every_cpu_suite_once():
    """``make bench`` (one after another) and ``make bench-lanes`` (two lanes, then the rest
    alone) each run every suite that runs without a GPU, once."""
    import re

    from kvstack.bench.suite import SUITES

    makefile = (REPO_ROOT / "Makefile").read_text()
    sequential = makefile.split("\nbench: install\n", 1)[1].split("\n\n", 1)[0]
    cpu_suites = sorted(set(SUITES) - {"gpu"})
    assert sorted(re.findall(r"kvstack bench (\w+) --out", sequential)) == cpu_suites
    lanes = []
    for name in ("BENCH_LANE_A", "BENCH_LANE_B", "BENCH_ALONE"):
        lanes += re.search(rf"^{name} := (.*)$", makefile, re.M).group(1).split()
    assert sorted(lanes) == cpu_suites


def test_a_percent_figures_target_reads_in_percent_like_its_value():
    from kvstack.bench.suite import figure_table

    results = {
        "figures": {
            "share": {"value": 0.071, "unit": "percent", "met": False,
                      "target": {"comparison": "<=", "value": 0.02}},
            "ratio": {"value": 1.5, "unit": "ratio", "met": True,
                      "target": {"comparison": ">=", "value": 1.2}},
        }
    }  # fmt: skip
    rows = figure_table(results, ["share", "ratio"]).splitlines()
    assert rows[2] == "| `share` | 7.1% | <= 2.0% | missed |"
    assert rows[3] == "| `ratio` | 1.5 | >= 1.2 | met |"
