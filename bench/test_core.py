"""The core microbenchmarks, in pytest-benchmark: the source of ``kvstack bench core``'s figures.

``kvstack bench core`` runs this file with ``--benchmark-json`` and turns the JSON into its
results (``bench/core.py``); ``pytest bench/test_core.py`` runs it by hand (with
``--benchmark-save`` / ``--benchmark-compare`` for comparisons between runs). With
``KVSTACK_BENCH_QUICK=1`` the sizes are tiny: the pipeline is checked, the numbers mean nothing.

Workloads (``workloads.py``), fp32, one decode step over shuffled token tables:

* ``paged_attention`` — the registered op, reference, compiled and the C++ decode kernel
  (``cpp``, where it builds), against
  ``scaled_dot_product_attention`` on the same tokens laid out contiguously, at contexts of
  1k/4k/8k tokens (batch 8, 32 query / 8 KV heads, head_dim 128);
* ``decode_attention`` — the registered op, on each of its code paths: several KV heads per
  table (the compiled decode kernel; the same shape at 4k) and one KV head per table (eager
  gathers + ``bmm``; SmolLM2's per-head tables under H2O at 50 %: 3 tables x 650 tokens, 3
  query heads, head_dim 64), each against the reference and contiguous SDPA;
* ``ragged_decode_attention`` — ``HeadwiseCache``'s decode step: 8 sequences of a 1300-token
  prompt whose three KV heads keep 60, 30 and 15 % of it in tables of their own (SmolLM2's
  heads: 3 query heads each, head_dim 64), from Tangram's static work list for one worker;
* the copy of a forced repack after 50 % random eviction (``copy_slots`` on the backend a repack
  uses on CPU, the C++ one where it builds, and the compiled one for the record) against a
  plain contiguous copy of the same bytes.

Every benchmark checks its output against the reference (the reference against contiguous
SDPA) before it is timed, so a fast wrong answer fails instead of being reported. Each records
its workload in ``extra_info`` (op, path, implementation, shape, context, dtype, threads).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kvstack import ops
from kvstack.bench.workloads import CORE_SHAPE, Shape, build_decode, build_ragged, build_repack
from kvstack.errors import BackendUnavailable


def quick() -> bool:
    return os.environ.get("KVSTACK_BENCH_QUICK") == "1"


def contexts() -> tuple[int, ...]:
    return (64, 128) if quick() else (1024, 4096, 8192)


def main_context() -> int:
    return contexts()[-1] if quick() else 4096


SEVERAL_KV_HEADS = CORE_SHAPE
ONE_KV_HEAD = Shape(batch=3, num_query_heads=3, num_kv_heads=1, head_dim=64)
ONE_KV_HEAD_CONTEXT = 656  # 650 tokens (half of a 1.3k-token prompt), whole 16-token blocks
QUICK_SEVERAL = Shape(batch=2, num_query_heads=4, num_kv_heads=2, head_dim=16)
QUICK_ONE = Shape(batch=3, num_query_heads=3, num_kv_heads=1, head_dim=16)

FAST_ROUNDS = 20
REFERENCE_ROUNDS = 3
WARMUP_ROUNDS = 2  # the first calls compile; torch.compile time is not what this measures


def _rounds(implementation: str) -> int:
    if quick():
        return 2
    return REFERENCE_ROUNDS if implementation == "reference" else FAST_ROUNDS


def pytest_generate_tests(metafunc):
    # Read at collection, so that KVSTACK_BENCH_QUICK set by the caller of pytest.main counts.
    if "context" in metafunc.fixturenames:
        metafunc.parametrize("context", contexts())


def _info(shape: Shape, context: int, **more) -> dict:
    return {
        "context": context,
        "batch": shape.batch,
        "num_query_heads": shape.num_query_heads,
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "block_size": shape.block_size,
        "dtype": str(shape.dtype),
        "threads": torch.get_num_threads(),
        **more,
    }


def _contiguous_sdpa(w):
    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            w.contiguous_query, w.contiguous_key, w.contiguous_value, enable_gqa=True
        )  # [B, H_q, 1, D]

    return sdpa


def _bench_attention(benchmark, op: str, path: str, implementation: str, w, args) -> None:
    """Check one implementation of ``op`` (or contiguous SDPA) on workload ``w``, then time it.

    The registered implementations are checked against the reference; the reference itself and
    contiguous SDPA are checked against each other."""
    reference = ops.get(op, "reference")
    sdpa = _contiguous_sdpa(w)
    if implementation == "contiguous_sdpa":
        call = sdpa
        got, want = sdpa().transpose(1, 2), reference(*args).out  # [B, 1, H_q, D]
    else:
        fn = _implementation(op, implementation)
        call = lambda: fn(*args)  # noqa: E731
        got = fn(*args).out
        want = sdpa().transpose(1, 2) if implementation == "reference" else reference(*args).out
    assert torch.isfinite(got).all(), f"{op} {implementation}: non-finite output"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    benchmark.extra_info.update(
        _info(w.shape, w.context, op=op, path=path, implementation=implementation)
    )
    benchmark.pedantic(
        call, rounds=_rounds(implementation), warmup_rounds=WARMUP_ROUNDS, iterations=1
    )


# --------------------------------------------------------------------------- paged_attention
_decode_workloads: dict = {}


def _decode(context: int, shape: Shape):
    key = (context, shape)
    if key not in _decode_workloads:
        _decode_workloads.clear()  # one workload alive at a time: 8k contexts are large
        _decode_workloads[key] = build_decode(context, shape)
    return _decode_workloads[key]


IMPLEMENTATIONS = ["reference", "compiled", "cpp", "contiguous_sdpa"]


def _implementation(op: str, backend: str):
    """The registered ``op`` on ``backend``; a backend that did not load here (no compiler for
    ``cpp``) is skipped with its reason, and its figures are left out."""
    try:
        return ops.get(op, backend)
    except BackendUnavailable as why:
        pytest.skip(str(why))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_paged_attention(benchmark, implementation, context):
    w = _decode(context, QUICK_SEVERAL if quick() else SEVERAL_KV_HEADS)
    _bench_attention(benchmark, "paged_attention", "paged", implementation, w, w.paged_args())


# --------------------------------------------------------------------------- decode_attention
@pytest.mark.parametrize("path", ["several_kv_heads", "one_kv_head"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_decode_attention(benchmark, implementation, path):
    if path == "one_kv_head":
        shape, context = (QUICK_ONE, 64) if quick() else (ONE_KV_HEAD, ONE_KV_HEAD_CONTEXT)
    else:
        shape, context = (QUICK_SEVERAL, main_context()) if quick() else (SEVERAL_KV_HEADS, 4096)
    w = _decode(context, shape)
    args = (w.query, w.pool.key, w.pool.value, w.slots)  # a live view: every slot visible
    _bench_attention(benchmark, "decode_attention", path, implementation, w, args)


# --------------------------------------------------------------------- ragged_decode_attention
RAGGED_SHAPE = Shape(batch=8, num_query_heads=9, num_kv_heads=3, head_dim=64)
QUICK_RAGGED = Shape(batch=2, num_query_heads=3, num_kv_heads=3, head_dim=16)
RAGGED_CONTEXT = 1300


def _dense_ragged(w) -> torch.Tensor:
    """Each (sequence, KV head)'s kept tokens gathered and attended by SDPA: [B, 1, H_q, D]."""
    b, h_q, h_kv, d = w.query.shape[0], w.query.shape[2], len(w.members), w.query.shape[3]
    per_kv = h_q // h_kv
    rows_k, rows_v = w.key_cache.view(-1, d), w.value_cache.view(-1, d)  # [S, D]
    out = torch.empty_like(w.query)
    for seq in range(b):
        for group, head in enumerate(w.members[:, 0].tolist()):
            table = w.slots[seq, group, : int(w.lengths[seq, group, 0])]
            heads = slice(head * per_kv, (head + 1) * per_kv)
            q = w.query[seq, 0, heads][:, None]  # [per_kv, 1, D]
            out[seq, 0, heads] = F.scaled_dot_product_attention(
                q, rows_k[table][None], rows_v[table][None]
            )[:, 0]
    return out


@pytest.mark.parametrize("implementation", ["reference", "compiled", "cpp"])
def test_ragged_decode_attention(benchmark, implementation):
    _decode_workloads.clear()
    shape, context = (QUICK_RAGGED, 64) if quick() else (RAGGED_SHAPE, RAGGED_CONTEXT)
    w = build_ragged(context, shape)
    fn = _implementation("ragged_decode_attention", implementation)
    reference = ops.get("ragged_decode_attention", "reference")
    want = _dense_ragged(w) if implementation == "reference" else reference(*w.args()).out
    got = fn(*w.args()).out
    assert torch.isfinite(got).all(), f"ragged_decode_attention {implementation}: non-finite"
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    benchmark.extra_info.update(
        _info(
            shape,
            context,
            op="ragged_decode_attention",
            path="headwise",
            implementation=implementation,
            budgets=list(w.budgets),
            kept_tokens=w.lengths[0, :, 0].tolist(),
            work_rows=w.work.shape[0],
            workers=w.workers,
        )
    )
    benchmark.pedantic(
        lambda: fn(*w.args()),
        rounds=_rounds(implementation),
        warmup_rounds=WARMUP_ROUNDS,
        iterations=1,
    )


# --------------------------------------------------------------------------- repack copy
def copy_backend() -> str:
    """The backend ``ops.get("copy_slots", device="cpu")`` gives: what a repack runs here."""
    return ops.operations()["copy_slots"].backends("cpu")[0]


@pytest.mark.parametrize("implementation", ["copy_slots", "compiled_copy_slots", "plain_copy"])
def test_repack_copy(benchmark, implementation):
    _decode_workloads.clear()
    shape = QUICK_SEVERAL if quick() else SEVERAL_KV_HEADS
    w = build_repack(main_context(), shape)
    pool = w.pool
    if implementation in ("copy_slots", "compiled_copy_slots"):
        backend = copy_backend() if implementation == "copy_slots" else "compiled"
        copy_slots = ops.get("copy_slots", backend)

        def call() -> None:
            # Idempotent: sources and destinations are disjoint (vToken I4), so every round
            # moves the same bytes.
            copy_slots(pool.key, pool.value, w.src_slots, w.dst_slots)

        call()
        h_kv, d = shape.num_kv_heads, shape.head_dim
        for cache in (pool.key, pool.value):
            rows = cache.view(-1, h_kv, d)  # [S, H_kv, D]
            torch.testing.assert_close(rows[w.dst_slots], rows[w.src_slots], atol=0, rtol=0)
    else:

        def call() -> None:
            w.plain_dst.copy_(w.plain_src)

        call()
        assert torch.equal(w.plain_dst, w.plain_src)
    benchmark.extra_info.update(
        _info(
            shape,
            w.context,
            op="copy_slots",
            path="repack",
            implementation=implementation,
            evict_fraction=w.evict_fraction,
            copy_slots_backend=copy_backend(),
            moved_rows=w.moved_rows,
            bytes_moved=w.bytes_moved,
        )
    )
    benchmark.pedantic(
        call, rounds=_rounds(implementation), warmup_rounds=WARMUP_ROUNDS, iterations=1
    )


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
