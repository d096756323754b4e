"""The README's example is code users copy: run it, and check what its comments claim."""

from __future__ import annotations

import math
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 2, "README.md should have the HF example and the core example"
    return blocks


def test_readme_hf_example_runs():
    namespace: dict = {}
    exec(compile(python_blocks()[0], str(README), "exec"), namespace)
    stats = namespace["cache"].stats()
    assert set(stats) == set(namespace["cache"].STATS_UNITS)  # the comment's promise
    budget = math.ceil(0.5 * namespace["ids"].shape[1])  # ratio=0.5 of the prompt, per table
    assert stats["live_tokens_per_layer"] == budget  # one row, each layer at its budget
    assert stats["live_tokens_all_layers"] == 30 * budget  # 30 layers
    assert stats["bytes"] < namespace["paged"].stats()["bytes"]


def test_readme_example_runs_and_its_comments_hold():
    namespace: dict = {}
    exec(compile(python_blocks()[1], str(README), "exec"), namespace)
    table, pool, out = namespace["table"], namespace["pool"], namespace["out"]
    assert len(table.blocks) == 4 and table.num_live == 50
    assert pool.num_free_blocks == 64 - 4
    assert out.shape == (1, 1, 8, 64)
