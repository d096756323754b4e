"""kvstack.bench — the benchmark suites, their shared skeleton and the README's figures.

suite       ``run_suite``: the run/report/plot skeleton every suite shares, and the committed
            results file ``bench/results/SUITE.json`` (figures, targets, commit, machine)
timing      ``time_interleaved``: the one timer for whole-program runs (``generate``)
core        registered attention ops and the repack copy vs baselines of the same run; its
            measurements are the pytest-benchmark suite ``test_core.py``
vtoken      retained blocks with reclamation vs Naive-Evict, and generate speed (SmolLM2)
quality     retrieval accuracy and held-out NLL under eviction (SmolLM2)
gpu         generate speed on a CUDA device
figures     ``kvstack figures [--check]``: README tables from the results files
workloads   seeded decode and repack workloads; prompts, quality_data: the real-model inputs
"""
