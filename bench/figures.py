"""``kvstack figures``: the README's figure tables, rendered from the committed results files.

Every figure the README shows sits between two marker comments,

    <!-- figures: SUITE -->
    ...generated from bench/results/SUITE.json...
    <!-- /figures -->

and nowhere else. ``kvstack figures`` rewrites those blocks from ``bench/results/*.json``;
``kvstack figures --check`` changes nothing and fails (exit 1), printing each problem, when

* a block differs from what its results file gives (a figure typed or edited by hand);
* a results file is stale: a path it depends on (the suite's ``DEPENDS_ON``) differs between
  the commit it was measured at and the working tree, or it was measured with uncommitted
  changes to such a path, or it is a quick run, or its commit is not in this repository. CUDA
  sources (``.cu``, ``.cuh``) do not count for results measured without a GPU, which never
  compiled or ran them;
* a README block names a suite without a results file, a results file has no README block (its
  figures would reach no reader), or the README, outside the blocks and code, holds something
  that reads like a measured figure (a number with a unit such as ``%``, ``x``, ``ms``,
  ``MiB``, ``tok/s``).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

from kvstack.bench.suite import (
    REPO_ROOT,
    RESULTS_DIR,
    SUITES,
    changed_since,
    could_affect,
    git,
    machine_line,
)

README = REPO_ROOT / "README.md"
BLOCK = re.compile(r"(<!-- figures: (\w+) -->\n)(.*?)(<!-- /figures -->)", re.DOTALL)
# A number followed by a unit, or a fraction written out: what a measured figure looks like in
# prose (parameters belong in `code`, which is not searched).
TYPED_FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?\s?(?:%|×|x\b|MiB|GiB|MB|GB|ms\b|µs|us\b|tok/s|tokens/s|GB/s)"
    r"|(?<![\w.])0\.\d{2,}\b"
)


def suite_module(name: str) -> Any:
    return importlib.import_module(f"kvstack.bench.{name}")


def load_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict]:
    return {
        path.stem: json.loads(path.read_text())
        for path in sorted(results_dir.glob("*.json"))
        if path.stem in SUITES
    }


def render_block(name: str, results: dict) -> str:
    """The generated text of README block ``name``: its tables and where they came from."""
    tables = suite_module(name).readme_tables(results)
    provenance = (
        f"From `bench/results/{name}.json`: `{results['command']}` at commit "
        f"{results['commit'][:10]}, {results['date'][:10]}, "
        f"{results['wall_seconds'] / 60:.0f} min; {machine_line(results)}."
    )
    return "\n\n".join([*tables.values(), provenance]) + "\n"


def render(readme: str, all_results: dict[str, dict]) -> tuple[str, list[str]]:
    """(README with every block regenerated, problems: blocks whose results are missing)."""
    problems = []

    def replace(match: re.Match) -> str:
        opening, name, _, closing = match.groups()
        if name not in all_results:
            problems.append(
                f"README block '{name}' has no results file bench/results/{name}.json "
                f"(run `kvstack bench {name} --out DIR`)"
            )
            return match.group(0)
        return opening + render_block(name, all_results[name]) + closing

    return BLOCK.sub(replace, readme), problems


def stale(name: str, results: dict) -> list[str]:
    """Why the results file of suite ``name`` no longer describes the code (empty: it does)."""
    problems = []
    where = f"bench/results/{name}.json"
    if results.get("quick"):
        problems.append(f"{where} is a --quick run; its numbers mean nothing")
    commit = results.get("commit")
    if not commit or git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return [*problems, f"{where}: its commit {commit!r} is not in this repository"]
    # The same rule as for later changes: a file the run could not have executed (a CUDA source,
    # for a run without a GPU) does not make it untrustworthy, whenever it changed.
    dirty = could_affect(results.get("dirty_dependencies", []), results.get("machine", {}))
    if dirty:
        problems.append(f"{where} was measured with uncommitted changes to {', '.join(dirty)}")
    depends_on = sorted(set(results["depends_on"]) | set(suite_module(name).DEPENDS_ON))
    changed = could_affect(changed_since(commit, depends_on), results.get("machine", {}))
    if changed:
        problems.append(
            f"{where} is stale: measured at {commit[:10]}, and these files it depends on "
            f"changed since: {', '.join(changed)}"
        )
    return problems


def typed_figures(readme: str) -> list[str]:
    """Lines outside generated blocks and code that read like a measured figure."""
    text = BLOCK.sub("", readme)
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    text = re.sub(r"`[^`]*`", "", text)  # inline code may wrap a line
    found = []
    for line in text.splitlines():
        for match in TYPED_FIGURE.finditer(line):
            found.append(f"README: {match.group(0)!r} looks typed by hand: {line.strip()[:100]}")
    return found


def check(readme_path: Path = README, results_dir: Path = RESULTS_DIR) -> list[str]:
    """Every problem ``kvstack figures --check`` reports (empty: the README is current)."""
    readme = readme_path.read_text()
    all_results = load_results(results_dir)
    rendered, problems = render(readme, all_results)
    if not BLOCK.search(readme):
        problems.append("README has no '<!-- figures: SUITE -->' block")
    blocks = {match.group(2) for match in BLOCK.finditer(readme)}
    for name in sorted(set(all_results) - blocks):
        problems.append(
            f"bench/results/{name}.json has no README block: add '<!-- figures: {name} -->' "
            "and '<!-- /figures -->' where its table belongs, then run `kvstack figures`"
        )
    if rendered != readme:
        new = {m.group(2): m.group(3) for m in BLOCK.finditer(rendered)}
        for match in BLOCK.finditer(readme):
            if new.get(match.group(2)) != match.group(3):
                problems.append(
                    f"README block '{match.group(2)}' differs from bench/results/"
                    f"{match.group(2)}.json (run `kvstack figures` to regenerate it)"
                )
    for name, results in all_results.items():
        problems += stale(name, results)
    problems += typed_figures(readme)
    return problems


def main(check_only: bool, readme_path: Path = README, results_dir: Path = RESULTS_DIR) -> int:
    """``kvstack figures [--check]``; returns the exit status."""
    if check_only:
        problems = check(readme_path, results_dir)
        for problem in problems:
            print(problem)
        if not problems:
            print(f"{readme_path.name}: every figure matches its results file, none is stale")
        return 1 if problems else 0
    readme = readme_path.read_text()
    rendered, problems = render(readme, load_results(results_dir))
    for problem in problems:
        print(problem)
    if rendered != readme:
        readme_path.write_text(rendered)
        print(f"{readme_path.name}: figure blocks regenerated")
    else:
        print(f"{readme_path.name}: already current")
    return 1 if problems else 0
