"""The equivalence suite can fail: a wrong ``copy_slots`` is caught.

``copy_slots`` is the cheapest op to check this way (one dynamic graph per dtype) and its
comparison is exact. The wrong implementation is a plausible bug, not garbage: a fused copy
that moves the key rows and forgets the value rows.

* In a subprocess (``-p`` plugin below), that bug is planted as the compiled backend of a
  test-only copy of the registry, and ``spec_tests/test_equivalence.py`` run on that op must
  fail there, in the comparison; the same command without the plant must pass. This
  process's registry is never touched.
* In process, ``check_against_reference`` (the check the suite runs per op) raises on the bug
  and passes a correct implementation that is not the reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

from kvstack import ops
from kvstack.reference import repack
from spec_tests.test_equivalence import check_against_reference

ROOT = Path(__file__).resolve().parent.parent
CASE = "test_fast_implementation_matches_reference[copy_slots-compiled]"

PLUGIN = '''"""Test-only registry: copy_slots' compiled backend is a wrong implementation."""


def pytest_configure(config):
    from kvstack import ops
    from spec_tests.test_equivalence_catches_wrong_kernel import copy_slots_forgetting_values

    op = ops.operations()["copy_slots"]
    op.implementations["compiled"] = copy_slots_forgetting_values
    op.unavailable.pop("compiled", None)
'''


def copy_slots_forgetting_values(key_cache, value_cache, src_slots, dst_slots):
    """``copy_slots`` with a bug: the keys move, the values stay where they were."""
    repack.copy_slots(key_cache, value_cache.clone(), src_slots, dst_slots)


def copy_slots_by_index(key_cache, value_cache, src_slots, dst_slots):
    """A correct ``copy_slots`` that is not the reference's loop: one indexed copy per cache
    (the moves do not overlap, I4)."""
    for cache in (key_cache, value_cache):
        rows = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, H_kv, D]
        rows[dst_slots] = rows[src_slots]


def run_equivalence_suite(tmp_path: Path, *, plant: bool) -> tuple[int, dict, str]:
    """Run the suite's copy_slots/compiled case in a fresh interpreter. Returns the exit code,
    {test name: (outcome, message)} from the JUnit report, and the output."""
    report = tmp_path / "report.xml"
    command = [sys.executable, "-m", "pytest", "spec_tests/test_equivalence.py"]
    command += ["-k", "test_fast_implementation_matches_reference and copy_slots and compiled"]
    command += ["-m", "not gpu", "--hypothesis-profile=ci", "-p", "no:cacheprovider", "-q"]
    command += [f"--junitxml={report}"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    if plant:
        (tmp_path / "plant_wrong_copy_slots.py").write_text(PLUGIN)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
        command += ["-p", "plant_wrong_copy_slots"]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    output = done.stdout + done.stderr
    assert report.exists(), f"pytest wrote no report (exit {done.returncode}):\n{output}"
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        found = [child for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = found[0].tag if found else "passed"
        message = "" if not found else (found[0].get("message") or "") + (found[0].text or "")
        outcomes[case.get("name")] = (outcome, message)
    return done.returncode, outcomes, output


def test_the_suite_fails_when_the_compiled_copy_slots_forgets_the_values(tmp_path):
    code, outcomes, output = run_equivalence_suite(tmp_path, plant=True)
    assert code == 1, f"exit {code}, expected 1 (tests failed):\n{output}"
    assert list(outcomes) == [CASE], output
    outcome, message = outcomes[CASE]
    assert outcome == "failure", output
    assert "copies are exact" in message, message  # failed in the comparison, not elsewhere


def test_the_same_command_passes_without_the_plant(tmp_path):
    op = ops.operations()["copy_slots"]
    if "compiled" not in op.implementations:
        pytest.skip(op.unavailable["compiled"])
    code, outcomes, output = run_equivalence_suite(tmp_path, plant=False)
    assert code == 0, f"exit {code}:\n{output}"
    assert outcomes == {CASE: ("passed", "")}, output


def test_the_check_raises_on_the_wrong_copy_slots():
    with pytest.raises(AssertionError, match="copies are exact"):
        check_against_reference("copy_slots", copy_slots_forgetting_values)


def test_the_check_passes_a_correct_copy_slots_that_is_not_the_reference():
    check_against_reference("copy_slots", copy_slots_by_index)


def test_the_two_copies_differ_on_a_move():
    """The plant is a real bug on the smallest move: its keys are right, its values are not."""
    key = torch.arange(4.0).view(2, 2, 1, 1)  # [num_blocks, block_size, H_kv, D]
    src, dst = torch.tensor([0]), torch.tensor([3])
    results = []
    for copy in (repack.copy_slots, copy_slots_forgetting_values, copy_slots_by_index):
        k, v = key.clone(), -key.clone()
        copy(k, v, src, dst)
        results.append((k.flatten().tolist(), v.flatten().tolist()))
    right, wrong, by_index = results
    assert right == ([0.0, 1.0, 2.0, 0.0], [-0.0, -1.0, -2.0, -0.0]) == by_index
    assert wrong == (right[0], [-0.0, -1.0, -2.0, -3.0])
