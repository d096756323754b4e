"""The ``kvstack`` command: ``bench core --quick`` writes its whole report; ``ops`` lists the registry.

Fast: the quick benchmark uses tiny sizes, and runs once for the module.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from kvstack import ops
from kvstack.cli import main
from kvstack.errors import InvalidArgumentError

HEADLINE_FIGURES = (
    "paged_attention.compiled_over_reference",
    "paged_attention.compiled_over_contiguous_sdpa",
    "decode_attention.several_kv_heads.compiled_over_contiguous_sdpa",
    "decode_attention.one_kv_head.compiled_over_contiguous_sdpa",
    "repack.bandwidth_fraction",
)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Run ``kvstack bench core --quick --out DIR`` once; return (DIR, what it printed)."""
    out = tmp_path_factory.mktemp("bench_core")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # capsys is function-scoped; this fixture is not
        status = main(["bench", "core", "--quick", "--out", str(out)])
    assert status == 0
    return out, printed.getvalue()


def test_bench_core_quick_writes_results_with_headline_names_from_pytest_benchmark(quick_run):
    out, _ = quick_run
    results = json.loads((out / "results.json").read_text())
    assert results["suite"] == "core" and results["quick"] is True
    figures = {name: f["value"] for name, f in results["figures"].items()}
    for name in HEADLINE_FIGURES:
        assert name in figures, f"{name} missing from results.json: {sorted(figures)}"
        assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures[name])
        assert results["figures"][name]["target"] is not None, name
    # Quick contexts are 64 and 128; the headline figures are the 128 ones.
    assert figures["paged_attention.compiled_over_reference"] == pytest.approx(
        figures["paged_attention.compiled_over_reference.ctx128"]
    )
    # The ratios are pytest-benchmark's medians, as recorded beside them.
    benchmarks = json.loads((out / "pytest-benchmark.json").read_text())["benchmarks"]
    median = {
        (b["extra_info"]["op"], b["extra_info"]["path"], b["extra_info"]["implementation"]): b[
            "stats"
        ]["median"]
        for b in benchmarks
        if b["extra_info"]["context"] in (64, 128) and b["extra_info"]["op"] == "decode_attention"
    }
    ratio = (
        median[("decode_attention", "one_kv_head", "compiled")]
        / median[("decode_attention", "one_kv_head", "contiguous_sdpa")]
    )
    assert figures["decode_attention.one_kv_head.compiled_over_contiguous_sdpa"] == pytest.approx(
        ratio
    )
    # Both code paths of the registered decode_attention op were benchmarked, and the ragged
    # decode attention of HeadwiseCache's layout.
    assert {b["extra_info"]["path"] for b in benchmarks} == {
        "paged",
        "several_kv_heads",
        "one_kv_head",
        "headwise",
        "repack",
    }
    # The cpp backend's kernels where it builds (a compiler is on this machine's PATH), on the
    # same inputs as the others.
    if "cpp" in ops.operations()["ragged_decode_attention"].implementations:
        ragged = {
            b["extra_info"]["implementation"]: b["stats"]["median"]
            for b in benchmarks
            if b["extra_info"]["op"] == "ragged_decode_attention"
        }
        assert figures["ragged_decode_attention.cpp_over_compiled"] == pytest.approx(
            ragged["compiled"] / ragged["cpp"]
        )
        assert "paged_attention.cpp_over_compiled" in figures
    assert results["workload"]["decode_attention.one_kv_head"]["num_kv_heads"] == 1
    assert results["workload"]["decode_attention.several_kv_heads"]["num_kv_heads"] > 1


def test_bench_core_quick_writes_report_and_plot_and_prints_report(quick_run):
    out, printed = quick_run
    report = (out / "report.md").read_text()
    assert report.strip() and report.strip() in printed
    assert f"kvstack bench core --quick --out {out}" in report  # the command that produced it
    for name in HEADLINE_FIGURES:
        assert f"`{name}`" in report
    assert (out / "core.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wrong_implementation_fails_the_core_benchmark_instead_of_being_timed(
    tmp_path, monkeypatch
):
    from kvstack.bench import core
    from kvstack.errors import KVStackError

    op = ops.operations()["paged_attention"]
    right = op.implementations["compiled"]

    def off_by_one_percent(*args, **kwargs):
        result = right(*args, **kwargs)
        return result._replace(out=result.out * 1.01)

    monkeypatch.setitem(op.implementations, "compiled", off_by_one_percent)
    with pytest.raises(KVStackError, match="the core microbenchmarks failed"):
        core.run_core(tmp_path / "out", quick=True)
    assert not (tmp_path / "out").exists()


def test_ops_prints_every_operation_and_backend(capsys):
    assert main(["ops"]) == 0
    printed = capsys.readouterr().out
    assert printed.strip() == ops.report()
    for name in ops.operations():
        assert any(
            line.split()[:3] == [name, "reference", "available"] for line in printed.splitlines()
        ), f"{name} reference backend not listed as available:\n{printed}"


def test_bench_core_without_out_is_rejected(capsys):
    with pytest.raises(SystemExit) as error:
        main(["bench", "core", "--quick"])
    assert error.value.code == 2
    assert "--out" in capsys.readouterr().err


def test_bench_core_out_that_is_a_file_is_rejected(tmp_path):
    path = tmp_path / "report.md"
    path.write_text("keep me")
    with pytest.raises(InvalidArgumentError, match="out_dir must be a directory"):
        main(["bench", "core", "--quick", "--out", str(path)])
    assert path.read_text() == "keep me"  # nothing changed
