"""The README's example is code users copy: run it, and check what its comments claim."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_and_its_comments_hold():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README.md has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    table, pool, out = namespace["table"], namespace["pool"], namespace["out"]
    assert len(table.blocks) == 4 and table.num_live == 50
    assert pool.num_free_blocks == 64 - 4
    assert out.shape == (1, 1, 8, 64)
