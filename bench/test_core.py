"""pytest-benchmark suite of the core workloads at context 4096 (``pytest bench/``; not in CI).

The same workloads as ``kvstack bench core`` (see ``workloads.py``): one decode step of batch 8,
32 query / 8 KV heads, head_dim 128, fp32, over shuffled token tables — reference, compiled and
contiguous SDPA — and the copy of a forced repack after 50% random eviction against a plain copy
of the same bytes. Each benchmark records its workload in ``extra_info``; a fast implementation
also records its ratio to the baseline measured earlier in the same session (tests run in file
order: baselines first). ``kvstack bench core`` is the report; this file is for
pytest-benchmark's comparisons between runs (``--benchmark-save`` / ``--benchmark-compare``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvstack import ops
from kvstack.bench.workloads import Shape, build_decode, build_repack

CONTEXT = 4096
FAST_ROUNDS = 10  # compiled, SDPA, copies: ~0.1 s per call or less
REFERENCE_ROUNDS = 3  # ~1-2 s per call on 2 CPU cores

_medians_s: dict[str, float] = {}  # name -> median seconds, for ratios within this session


@pytest.fixture(scope="module")
def decode():
    return build_decode(CONTEXT)


@pytest.fixture(scope="module")
def repack():
    return build_repack(CONTEXT)


def _decode_info(w) -> dict:
    s = w.shape
    return {
        "workload": "decode attention, shuffled token tables",
        "context": w.context,
        "batch": s.batch,
        "num_query_heads": s.num_query_heads,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "block_size": s.block_size,
        "dtype": str(s.dtype),
        "threads": torch.get_num_threads(),
    }


def _repack_info(w) -> dict:
    s = w.shape
    return {
        "workload": "repack copy after 50% random eviction",
        "context": w.context,
        "batch": s.batch,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
        "block_size": s.block_size,
        "dtype": str(s.dtype),
        "evict_fraction": w.evict_fraction,
        "moved_rows": w.moved_rows,
        "bytes_moved": w.bytes_moved,
        "threads": torch.get_num_threads(),
    }


def _record_median(benchmark, name: str) -> float | None:
    if benchmark.stats is None:  # --benchmark-disable
        return None
    _medians_s[name] = benchmark.stats.stats.median
    return _medians_s[name]


def test_decode_reference(benchmark, decode):
    reference = ops.get("paged_attention", "reference")
    benchmark.extra_info.update(_decode_info(decode), implementation="reference")
    benchmark.pedantic(
        reference, args=decode.paged_args(), rounds=REFERENCE_ROUNDS, warmup_rounds=1
    )
    _record_median(benchmark, "reference")


def test_decode_contiguous_sdpa(benchmark, decode):
    def sdpa():
        return F.scaled_dot_product_attention(
            decode.contiguous_query, decode.contiguous_key, decode.contiguous_value, enable_gqa=True
        )

    benchmark.extra_info.update(_decode_info(decode), implementation="contiguous SDPA")
    benchmark.pedantic(sdpa, rounds=FAST_ROUNDS, warmup_rounds=2)
    _record_median(benchmark, "sdpa")


def test_decode_compiled(benchmark, decode):
    compiled = ops.get("paged_attention", "compiled")
    benchmark.extra_info.update(_decode_info(decode), implementation="compiled")
    # Warm-up rounds compile (torch.compile time is not what this measures).
    benchmark.pedantic(compiled, args=decode.paged_args(), rounds=FAST_ROUNDS, warmup_rounds=2)
    median = _record_median(benchmark, "compiled")
    if median is not None and "reference" in _medians_s:
        benchmark.extra_info["compiled_over_reference"] = _medians_s["reference"] / median
    if median is not None and "sdpa" in _medians_s:
        benchmark.extra_info["compiled_over_contiguous_sdpa"] = median / _medians_s["sdpa"]


def test_repack_plain_copy(benchmark, repack):
    benchmark.extra_info.update(_repack_info(repack), implementation="plain dst.copy_(src)")
    benchmark.pedantic(
        repack.plain_dst.copy_, args=(repack.plain_src,), rounds=FAST_ROUNDS, warmup_rounds=2
    )
    _record_median(benchmark, "plain_copy")


def test_repack_copy_slots(benchmark, repack):
    copy_slots = ops.get("copy_slots", "compiled")
    pool = repack.pool
    benchmark.extra_info.update(_repack_info(repack), implementation="compiled copy_slots")
    # Repeats move the same bytes: sources and destinations are disjoint (vToken I4).
    benchmark.pedantic(
        copy_slots,
        args=(pool.key, pool.value, repack.src_slots, repack.dst_slots),
        rounds=FAST_ROUNDS,
        warmup_rounds=2,
    )
    median = _record_median(benchmark, "copy_slots")
    if median is not None:
        benchmark.extra_info["gb_per_s"] = repack.bytes_moved / median / 1e9
    if median is not None and "plain_copy" in _medians_s:
        benchmark.extra_info["bandwidth_fraction"] = _medians_s["plain_copy"] / median


# --------------------------------------------------------------------------- the workloads
TINY = Shape(batch=3, num_query_heads=4, num_kv_heads=2, head_dim=8)


def test_decode_workload_is_seeded_shuffled_and_consistent():
    w = build_decode(64, TINY, seed=3)
    again = build_decode(64, TINY, seed=3)
    assert torch.equal(w.slots, again.slots) and torch.equal(w.pool.key, again.pool.key)
    assert not torch.equal(w.slots, build_decode(64, TINY, seed=4).slots)
    # The slot table is exactly what the token tables give attention.
    for b, table in enumerate(w.tables):
        assert torch.equal(w.slots[b], table.live_slots())
    all_blocks = [block for table in w.tables for block in table.blocks]
    assert sorted(all_blocks) == list(range(w.pool.num_blocks))  # the tables own the pool
    assert all_blocks != sorted(all_blocks)  # in shuffled order
    # The contiguous layout holds the same K/V rows: [B, H_kv, T, D].
    key_rows = w.pool.key.view(-1, TINY.num_kv_heads, TINY.head_dim)
    assert torch.equal(w.contiguous_key, key_rows[w.slots].transpose(1, 2))
    got = ops.get("paged_attention", "reference")(*w.paged_args()).out
    want = F.scaled_dot_product_attention(
        w.contiguous_query, w.contiguous_key, w.contiguous_value, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_repack_workload_moves_what_the_plans_say_and_counts_bytes():
    w = build_repack(64, TINY, seed=3)
    assert w.src_slots.numel() == sum(plan.src_slots.numel() for plan in w.plans) > 0
    assert not set(w.src_slots.tolist()) & set(w.dst_slots.tolist())  # disjoint (I4)
    assert all(table.num_live == 32 for table in w.tables)
    assert w.bytes_moved == w.moved_rows * TINY.num_kv_heads * TINY.head_dim * 4 * 2
    assert w.plain_src.numel() * w.plain_src.element_size() == w.bytes_moved
