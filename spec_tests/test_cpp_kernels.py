"""The ``cpp`` backend: C++ kernels for CPU tensors (cuda_kernels/*_cpu.cpp), built on first use.

Its equivalence with the reference runs with every backend's in test_equivalence.py and in the
repack property and state-machine tests; here: that it builds wherever a compiler exists (so a
broken build cannot hide behind skipped tests), the registry's device rule, the layouts an arena
gives it, and bad input, for ``copy_slots``, for the decode attention (``paged_attention``
with one query token: the C++ kernel; anything else goes to the compiled kernels) and for the
ragged decode attention over head groups' tables (``ragged_decode_attention``).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvstack import ops
from kvstack.reference.attention import paged_attention as reference_paged_attention
from kvstack.reference.ragged import ragged_decode_attention as reference_ragged
from kvstack.reference.repack import copy_slots as reference_copy_slots
from spec_tests.strategies import (
    TOLERANCES,
    AttentionCase,
    RaggedCase,
    attention_cases,
    ragged_cases,
    ragged_tables,
)

COPY = ops.operations()["copy_slots"]


def test_the_cpp_backend_builds_where_a_compiler_exists():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    assert "cpp" in COPY.implementations, COPY.unavailable.get("cpp")


def test_a_device_picks_the_backends_that_run_on_it():
    if "cpp" not in COPY.implementations:
        pytest.skip(COPY.unavailable["cpp"])
    assert COPY.backends("cpu")[0] == "cpp"
    assert ops.get("copy_slots", device="cpu") is COPY.implementations["cpp"]
    # CUDA tensors never reach the C++ CPU kernel: the first backend for them is another.
    assert "cpp" not in COPY.backends("cuda")
    assert "cuda" not in COPY.backends(torch.device("cpu"))


@st.composite
def interleaved_pools(draw):
    """K and V as views of one buffer, the way an arena may lay them out: K/V interleaved per
    block, per row or per head, so blocks, rows and heads are strided."""
    num_blocks, block_size = draw(st.integers(2, 6)), draw(st.sampled_from([1, 2, 16]))
    heads, head_dim = draw(st.integers(1, 3)), draw(st.sampled_from([1, 4, 8]))
    where = draw(st.sampled_from(["block", "row", "head"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    # The pair's axis sits after the blocks, the rows or the heads.
    axis = {"block": 1, "row": 2, "head": 3}[where]
    shape = [num_blocks, block_size, heads, head_dim]
    shape.insert(axis, 2)
    buffer = torch.randn(shape, generator=gen).to(dtype)
    key, value = buffer.select(axis, 0), buffer.select(axis, 1)  # [N, bs, H, D] each
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    moves = draw(st.integers(0, len(slots) // 2))
    return buffer, key, value, slots[:moves], slots[moves : 2 * moves]


@given(case=interleaved_pools())
def test_cpp_copy_slots_on_strided_layouts_matches_the_reference(case):
    if "cpp" not in COPY.implementations:
        pytest.skip(COPY.unavailable["cpp"])
    buffer, key, value, src, dst = case
    expected = buffer.clone()
    expected_views = _views_like(expected, buffer, key, value)
    reference_copy_slots_strided(*expected_views, src, dst)
    COPY.implementations["cpp"](key, value, src, dst)
    assert torch.equal(buffer, expected)


def _views_like(new_buffer, buffer, key, value):
    """The same views of ``new_buffer`` as ``key``/``value`` are of ``buffer``."""
    return tuple(
        new_buffer.as_strided(view.shape, view.stride(), view.storage_offset())
        for view in (key, value)
    )


def reference_copy_slots_strided(key, value, src, dst):
    """The reference's row copies, on views that ``view()`` cannot flatten: row by row."""
    block_size = key.shape[1]
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        for cache in (key, value):
            cache[d // block_size, d % block_size] = cache[s // block_size, s % block_size]


def test_the_strided_reference_is_the_reference_on_contiguous_pools():
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(3, 4, 2, 8, generator=gen), torch.randn(3, 4, 2, 8, generator=gen)
    src, dst = torch.tensor([0, 5, 11]), torch.tensor([3, 7, 1])
    a, b = key.clone(), value.clone()
    reference_copy_slots(a, b, src, dst)
    reference_copy_slots_strided(key, value, src, dst)
    assert torch.equal(a, key) and torch.equal(b, value)


@pytest.mark.parametrize(
    "src, dst, words",
    [
        ([0, 12], [1, 2], "[0, 12)"),  # 12 slots: 3 blocks of 4
        ([0, 1], [2, -1], "[0, 12)"),
        ([0, 1], [2], "one length"),
    ],
)
def test_cpp_copy_slots_refuses_bad_slots_and_changes_nothing(src, dst, words):
    if "cpp" not in COPY.implementations:
        pytest.skip(COPY.unavailable["cpp"])
    key, value = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    before = key.clone(), value.clone()
    with pytest.raises(RuntimeError, match=words.replace("[", r"\[").replace(")", r"\)")):
        COPY.implementations["cpp"](key, value, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(key, before[0]) and torch.equal(value, before[1])


def test_cpp_copy_slots_refuses_mismatched_pools():
    if "cpp" not in COPY.implementations:
        pytest.skip(COPY.unavailable["cpp"])
    with pytest.raises(RuntimeError, match="must match"):
        COPY.implementations["cpp"](
            torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 4), torch.tensor([0]), torch.tensor([1])
        )


# --------------------------------------------------------------------------- decode attention
PAGED = ops.operations()["paged_attention"]


def cpp_paged():
    if "cpp" not in PAGED.implementations:
        pytest.skip(PAGED.unavailable["cpp"])
    return PAGED.implementations["cpp"]


def decode_case(case: AttentionCase, layout: str) -> AttentionCase:
    """The case's last query of each sequence (a decode step), its pools laid out as an arena
    may give them: plain, or K and V interleaved per block or per row."""
    key_cache, value_cache = case.key_cache, case.value_cache
    if layout != "plain":
        axis = {"block": 1, "row": 2}[layout]
        buffer = torch.stack([key_cache, value_cache], dim=axis).contiguous()
        key_cache, value_cache = buffer.select(axis, 0), buffer.select(axis, 1)
    return AttentionCase(
        case.query[:, -1:],
        key_cache,
        value_cache,
        case.slots,
        case.key_positions,
        case.query_positions[:, -1:],
        case.window,
    )


@settings(deadline=None, max_examples=80)
@given(
    drawn=attention_cases(windows=True),
    layout=st.sampled_from(["plain", "block", "row"]),
    check=st.booleans(),
    weights=st.booleans(),
)
def test_cpp_decode_attention_matches_the_reference_on_arena_layouts(drawn, layout, check, weights):
    """The C++ decode kernel (one query token, its weights if asked) against the reference: GQA,
    windows, padding slots, positions with gaps, sequences that see nothing, bf16/fp16/fp32, and
    pools whose blocks or rows are strided (an arena's interleaved K/V)."""
    attention = cpp_paged()
    case = decode_case(drawn, layout)
    expected = reference_paged_attention(*case.args(), **case.kwargs(), return_weights=weights)
    got = attention(*case.args(), **case.kwargs(), check=check, return_weights=weights)
    atol, rtol = TOLERANCES[case.query.dtype]
    assert got.out.dtype == case.query.dtype
    if weights:  # each visible key's probability at its column, 0 elsewhere, in float32
        assert got.weights.dtype == torch.float32
        torch.testing.assert_close(got.weights, expected.weights, atol=atol, rtol=rtol)
    else:
        assert got.weights is None
    torch.testing.assert_close(got.out.float(), expected.out.float(), atol=atol, rtol=rtol)
    assert torch.equal(got.lse == -math.inf, expected.lse == -math.inf)
    finite = expected.lse > -math.inf
    torch.testing.assert_close(got.lse[finite], expected.lse[finite], atol=1e-4, rtol=1e-5)


def test_cpp_decode_attention_is_the_kernel_for_decode_steps_only(monkeypatch):
    """Decode steps run the C++ kernel, with or without weights; prefill chunks go to the
    compiled kernels (a spy on the library call tells them apart)."""
    attention = cpp_paged()
    calls = []
    library = torch.ops.kvstack_cpu
    real = library.paged_decode
    monkeypatch.setattr(
        library, "paged_decode", lambda *args: calls.append(1) or real(*args), raising=False
    )
    key_cache = torch.randn(4, 8, 2, 16)
    value_cache = torch.randn(4, 8, 2, 16)
    slots = torch.arange(20).view(2, 10)
    positions = torch.arange(10).expand(2, 10)
    attention(torch.randn(2, 1, 4, 16), key_cache, value_cache, slots, positions, positions[:, -1:])
    assert calls == [1]
    attention(torch.randn(2, 3, 4, 16), key_cache, value_cache, slots, positions, positions[:, -3:])
    assert calls == [1]
    weighted = attention(
        torch.randn(2, 1, 4, 16),
        key_cache,
        value_cache,
        slots,
        positions,
        positions[:, -1:],
        return_weights=True,
    )
    assert calls == [1, 1] and weighted.weights.shape == (2, 4, 1, 10)


def test_cpp_decode_attention_refuses_a_slot_outside_the_pool_even_unchecked():
    """``check=False`` skips the argument checks, but a slot past the pool is still refused by
    the kernel, never read."""
    attention = cpp_paged()
    key_cache = torch.randn(2, 4, 1, 8)
    slots = torch.tensor([[0, 1, 8]])  # the pool has 8 slots
    positions = torch.tensor([[0, 1, 2]])
    with pytest.raises(RuntimeError, match=r"slots must be -1 or in \[0, 8\)"):
        attention(
            torch.randn(1, 1, 1, 8),
            key_cache,
            key_cache.clone(),
            slots,
            positions,
            positions[:, -1:],
            check=False,
        )


@pytest.mark.parametrize("head_dim", [64, 128, 24])  # the kernel's specialised widths, and not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_decode_attention_at_model_head_dims(head_dim, dtype):
    attention = cpp_paged()
    generator = torch.Generator().manual_seed(head_dim)
    key_cache = torch.randn(6, 16, 3, head_dim, generator=generator).to(dtype)
    value_cache = torch.randn(6, 16, 3, head_dim, generator=generator).to(dtype)
    slots = torch.randperm(96, generator=generator)[:80].view(2, 40)
    slots[1, 30:] = -1
    positions = torch.arange(40).expand(2, 40).contiguous()
    query = torch.randn(2, 1, 9, head_dim, generator=generator).to(dtype)
    args = (query, key_cache, value_cache, slots, positions, torch.tensor([[39], [20]]))
    for window in (None, 7):
        expected = reference_paged_attention(*args, window=window)
        got = attention(*args, window=window)
        atol, rtol = TOLERANCES[dtype]
        torch.testing.assert_close(got.out.float(), expected.out.float(), atol=atol, rtol=rtol)
        torch.testing.assert_close(got.lse, expected.lse, atol=1e-4, rtol=1e-5)


def test_cpp_decode_attention_takes_what_the_spec_takes_mixed_dtypes_and_infinite_keys():
    """A query in another dtype than the pool (the spec computes in float32: the compiled
    kernels take it), and keys whose every score is -inf (the spec's nothing-visible result:
    zeros and an lse of -inf, not NaN)."""
    attention = cpp_paged()
    key_cache = torch.randn(2, 4, 1, 8).bfloat16()
    slots = torch.arange(8).view(1, 8)
    positions = torch.arange(8).view(1, 8)
    query = torch.randn(1, 1, 2, 8)  # float32 over a bf16 pool
    args = (query, key_cache, key_cache.clone(), slots, positions, positions[:, -1:])
    torch.testing.assert_close(
        attention(*args).out, reference_paged_attention(*args).out, atol=1e-5, rtol=1e-5
    )
    infinite = torch.full((2, 4, 1, 8), math.inf)
    negative = -torch.ones(1, 1, 2, 8)
    args = (negative, infinite, infinite.clone(), slots, positions, positions[:, -1:])
    expected, got = reference_paged_attention(*args), attention(*args)
    assert torch.equal(expected.out, torch.zeros_like(expected.out))
    assert torch.equal(got.out, expected.out) and torch.equal(got.lse, expected.lse)


# ---------------------------------------------------------------------- ragged decode attention
RAGGED = ops.operations()["ragged_decode_attention"]


def cpp_ragged():
    if "cpp" not in RAGGED.implementations:
        pytest.skip(RAGGED.unavailable["cpp"])
    return RAGGED.implementations["cpp"]


def interleaved(key_cache: torch.Tensor, value_cache: torch.Tensor, layout: str):
    """The pools as an arena may give them: plain, or K and V interleaved per block or row."""
    if layout == "plain":
        return key_cache, value_cache
    axis = {"block": 1, "row": 2}[layout]
    buffer = torch.stack([key_cache, value_cache], dim=axis).contiguous()
    return buffer.select(axis, 0), buffer.select(axis, 1)


def assert_ragged_close(got, expected, dtype):
    atol, rtol = TOLERANCES[dtype]
    assert got.out.dtype == expected.out.dtype and got.weights is None
    torch.testing.assert_close(got.out.float(), expected.out.float(), atol=atol, rtol=rtol)
    assert torch.equal(got.lse == -math.inf, expected.lse == -math.inf)
    finite = expected.lse > -math.inf
    torch.testing.assert_close(got.lse[finite], expected.lse[finite], atol=1e-4, rtol=1e-5)


@settings(deadline=None, max_examples=80)
@given(case=ragged_cases(), layout=st.sampled_from(["plain", "block", "row"]), check=st.booleans())
def test_cpp_ragged_attention_matches_the_reference_on_arena_layouts(
    case: RaggedCase, layout, check
):
    """The C++ kernel against the reference with and without the argument checks: head groups
    with short members, junk (NaN, inf, any slot) where no member reads, random splits, and
    pools whose blocks or rows are strided."""
    key_cache, value_cache = interleaved(case.key_cache, case.value_cache, layout)
    args = (case.query, key_cache, value_cache, *case.args()[3:])
    expected = reference_ragged(*case.args(), **case.kwargs())
    got = cpp_ragged()(*args, **case.kwargs(), check=check)
    assert_ragged_close(got, expected, case.query.dtype)


def model_sized_case(head_dim: int, dtype: torch.dtype, seed: int = 0) -> RaggedCase:
    """Three KV heads of three query heads in groups of two (one short), two sequences of 60
    tokens whose heads keep different shares, the second group split in three."""
    gen = torch.Generator().manual_seed(seed)
    members = torch.tensor([[2, 0], [1, -1]])
    kept = torch.rand((2, 3, 60), generator=gen) < torch.tensor([0.9, 0.3, 0.6])[None, :, None]
    keys = torch.randn((2, 60, 3, head_dim), generator=gen).to(dtype)
    values = torch.randn((2, 60, 3, head_dim), generator=gen).to(dtype)
    key_cache, value_cache, slots, lengths = ragged_tables(keys, values, kept, members, 16, gen)
    work = torch.tensor([[1, 2, 3], [0, 0, 1], [1, 0, 3], [1, 1, 3]])
    query = torch.randn((2, 1, 9, head_dim), generator=gen).to(dtype)
    return RaggedCase(
        query, key_cache, value_cache, slots, lengths, members, work, keys, values, kept
    )


@pytest.mark.parametrize("head_dim", [64, 128, 24])  # the kernel's specialised widths, and not
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_ragged_attention_at_model_head_dims(head_dim, dtype):
    case = model_sized_case(head_dim, dtype)
    expected = reference_ragged(*case.args())
    assert_ragged_close(cpp_ragged()(*case.args()), expected, dtype)


def test_cpp_ragged_attention_takes_a_query_in_another_dtype_than_the_pool():
    """The spec computes in float32 whatever the dtypes; the compiled kernel takes this one."""
    case = model_sized_case(16, torch.bfloat16)
    args = (case.query.float(), *case.args()[1:])
    assert_ragged_close(cpp_ragged()(*args), reference_ragged(*args), torch.bfloat16)


UNCHECKED_BAD = {
    "a read slot beyond the pool": (
        lambda c: {"slots": c.slots.index_put((torch.tensor([0]),) * 3, torch.tensor(10**6))},
        "a slot names a row outside the pool",
    ),
    "a -1 slot where a member reads": (
        lambda c: {"slots": c.slots.index_put((torch.tensor([0]),) * 3, torch.tensor(-1))},
        "a slot names a row outside the pool",
    ),
    "a length beyond the table": (
        lambda c: {"lengths": c.lengths + c.slots.shape[2]},
        "lengths holds",
    ),
    "a group out of range": (
        lambda c: {"work": torch.tensor([[0, 0, 1], [2, 0, 1]])},
        "work row 1 is \\(2, 0, 1\\)",
    ),
    "a part beyond its parts": (
        lambda c: {"work": torch.tensor([[0, 0, 1], [1, 1, 1]])},
        "work row 1 is \\(1, 1, 1\\)",
    ),
    "a head beyond the count": (
        lambda c: {"members": torch.tensor([[3, 0], [1, -1]])},
        "members names KV head 3",
    ),
    "a member below -1": (
        lambda c: {"members": torch.tensor([[2, 0], [1, -2]])},
        "members must be -1 or a KV head",
    ),
    "lengths of the wrong shape": (
        lambda c: {"lengths": c.lengths[:, :1]},
        "lengths must be",
    ),
}


@pytest.mark.parametrize("bad", sorted(UNCHECKED_BAD))
def test_cpp_ragged_attention_refuses_what_it_would_read_out_of_bounds_even_unchecked(bad):
    """``check=False`` skips the wrapper's checks; the kernel still refuses what would make it
    read outside a tensor, with the argument named, and leaves the pools as they were."""
    case = model_sized_case(8, torch.float32)
    change, message = UNCHECKED_BAD[bad]
    names = ["query", "key_cache", "value_cache", "slots", "lengths", "members", "work"]
    args = dict(zip(names, case.args(), strict=True)) | change(case)
    pools = case.key_cache.clone(), case.value_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        cpp_ragged()(*args.values(), check=False)
    assert torch.equal(case.key_cache, pools[0]) and torch.equal(case.value_cache, pools[1])


def test_cpp_attention_keeps_a_nan_query_nan_as_the_reference_does():
    """A NaN query head (an fp16 overflow upstream) must not come back looking valid: the paged
    rule gives it lse NaN (out 0, weights 0), the ragged rule NaN out and lse for a head that
    read keys; the other heads are untouched."""
    gen = torch.Generator().manual_seed(3)
    key_cache, value_cache = torch.randn(4, 4, 2, 8, generator=gen), torch.randn(4, 4, 2, 8)
    slots = torch.arange(12).view(1, 12)
    positions = torch.arange(12).view(1, 12)
    query = torch.randn(1, 1, 4, 8, generator=gen)
    query[0, 0, 1] = math.nan  # KV head 0's second query head
    args = (query, key_cache, value_cache, slots, positions, positions[:, -1:])
    expected = reference_paged_attention(*args, return_weights=True)
    got = cpp_paged()(*args, return_weights=True)
    for name in ("out", "lse", "weights"):
        torch.testing.assert_close(getattr(got, name), getattr(expected, name), equal_nan=True)
    assert torch.isnan(got.lse[0, 0, 1]) and not torch.isnan(got.lse[0, 0, [0, 2, 3]]).any()

    case = model_sized_case(8, torch.float32)
    case.query[1, 0, 4] = math.nan  # sequence 1, KV head 1 (a group of its own, three splits)
    expected = reference_ragged(*case.args())
    got = cpp_ragged()(*case.args())
    torch.testing.assert_close(got.out, expected.out, equal_nan=True)
    torch.testing.assert_close(got.lse, expected.lse, equal_nan=True)
    assert torch.isnan(got.out[1, 0, 4]).all() and torch.isnan(got.lse[1, 0, 4])
    assert torch.isnan(got.lse).sum() == 1


def test_cpp_ragged_attention_hands_a_pool_of_strided_heads_to_the_compiled_kernel():
    """Slots whose H_p x D values are not one row (a view of every other D): not the kernel's
    layout (it would refuse it), so the compiled kernel answers, with the reference's result."""
    case = model_sized_case(8, torch.float32)
    wide = torch.randn(*case.key_cache.shape[:3], 16)
    wide[..., ::2] = case.key_cache
    key_cache = wide[..., ::2]  # stride(3) == 2
    assert key_cache.stride(3) != 1
    args = (case.query, key_cache, *case.args()[2:])
    assert_ragged_close(cpp_ragged()(*args), reference_ragged(*case.args()), torch.float32)


@pytest.mark.parametrize("weights", [False, True])
def test_the_cpp_decode_ops_fake_kernels_match_their_schemas(weights):
    """The fake (meta) kernels that torch.compile traces with give the real kernels' shapes and
    dtypes (``torch.library.opcheck``: the schema and the fake tensor checks)."""
    cpp_paged(), cpp_ragged()  # builds and registers the library, or skips
    library = torch.ops.kvstack_cpu
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = torch.randn(3, 4, 2, 8, generator=gen), torch.randn(3, 4, 2, 8)
    slots = torch.arange(10).view(2, 5)
    positions = torch.arange(10).view(2, 5) % 5
    empty = torch.empty(0, dtype=torch.long)
    paged_args = (
        torch.randn(2, 1, 4, 8),
        key_cache,
        value_cache,
        slots,
        positions,
        torch.tensor([[4], [3]]),
        empty,
        0.5,
        weights,
    )
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(library.paged_decode.default, paged_args, test_utils=checks)
    case = model_sized_case(8, torch.float32)
    torch.library.opcheck(library.ragged_decode.default, (*case.args(), 0.5), test_utils=checks)


def test_a_build_lock_a_killed_process_left_never_hangs_a_load_and_a_live_one_is_waited_for():
    """torch waits without a timeout for its build lock file to go, so one that a killed
    process left would hang every later load; kvstack's load holds its own lock (the kernel's,
    released when its holder dies) and removes torch's file when no load holds that."""
    import fcntl
    import subprocess
    import sys

    from torch.utils import cpp_extension

    from kvstack import cuda_kernels

    cuda_kernels.load_cpu()  # built here, so the loads below only check the build
    build = Path(cpp_extension._get_build_directory(cuda_kernels._CPU_LIBRARY, verbose=False))
    load = [sys.executable, "-c", "from kvstack import cuda_kernels; cuda_kernels.load_cpu()"]
    (build / "lock").touch()  # what a process killed inside torch's load leaves
    with open(build / "kvstack.flock", "a") as held:  # a load in progress here
        fcntl.flock(held, fcntl.LOCK_EX)
        waiting = subprocess.Popen(load, stderr=subprocess.PIPE, text=True)
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=3)  # it waits for the load in progress, not for ever
        assert (build / "lock").exists()  # while a load holds the lock, its file is left
        fcntl.flock(held, fcntl.LOCK_UN)
    assert waiting.wait(timeout=300) == 0, waiting.stderr.read()
    assert "a build lock that a killed process left behind" in waiting.stderr.read()
    assert not (build / "lock").exists()
