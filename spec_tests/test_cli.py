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
    "decode_attention.compiled_over_reference",
    "decode_attention.compiled_over_contiguous_sdpa",
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


def test_bench_core_quick_writes_figures_with_headline_names(quick_run):
    out, _ = quick_run
    figures = json.loads((out / "figures.json").read_text())
    for name in HEADLINE_FIGURES:
        assert name in figures, f"{name} missing from figures.json: {sorted(figures)}"
        assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures[name])
    # Quick contexts are 64 and 128; the headline figures are the 128 ones.
    assert figures["decode_attention.compiled_over_reference"] == pytest.approx(
        figures["decode_attention.compiled_over_reference.ctx128"]
    )
    assert all(isinstance(value, float) for value in figures.values())


def test_bench_core_quick_writes_report_and_plot_and_prints_report(quick_run):
    out, printed = quick_run
    report = (out / "report.md").read_text()
    assert report.strip() and report.strip() in printed
    assert f"kvstack bench core --quick --out {out}" in report  # the command that produced it
    for name in HEADLINE_FIGURES:
        assert f"`{name}`" in report
    assert (out / "decode_attention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
