"""kvstack.bench — benchmark workloads, the core benchmark and its report.

workloads  seeded decode (shuffled token tables) and repack workloads, with their baselines
core       ``run_core``: decode attention and repack copy vs baselines of the same run;
           writes figures.json, report.md and decode_attention.png (``kvstack bench core``)
test_core  pytest-benchmark suite of the same workloads (``pytest bench/``; not run in CI)
"""
