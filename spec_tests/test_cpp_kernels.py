"""The ``cpp`` backend: C++ kernels for CPU tensors (cuda_kernels/*_cpu.cpp), built on first use.

Its equivalence with the reference runs with every backend's in test_equivalence.py and in the
repack property and state-machine tests; here: that it builds wherever a compiler exists (so a
broken build cannot hide behind skipped tests), the registry's device rule, the layouts an arena
gives it, and bad input, for ``copy_slots`` and for the decode attention (``paged_attention``
with one query token: the C++ kernel; anything else goes to the compiled kernels).
"""

from __future__ import annotations

import math
import os
import shutil

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kvstack import ops
from kvstack.reference.attention import paged_attention as reference_paged_attention
from kvstack.reference.repack import copy_slots as reference_copy_slots
from spec_tests.strategies import TOLERANCES, AttentionCase, attention_cases

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
)
def test_cpp_decode_attention_matches_the_reference_on_arena_layouts(drawn, layout, check):
    """The C++ decode kernel (one query token, no weights) against the reference: GQA, windows,
    padding slots, positions with gaps, sequences that see nothing, bf16/fp16/fp32, and pools
    whose blocks or rows are strided (an arena's interleaved K/V)."""
    attention = cpp_paged()
    case = decode_case(drawn, layout)
    expected = reference_paged_attention(*case.args(), **case.kwargs())
    got = attention(*case.args(), **case.kwargs(), check=check)
    atol, rtol = TOLERANCES[case.query.dtype]
    assert got.out.dtype == case.query.dtype and got.weights is None
    torch.testing.assert_close(got.out.float(), expected.out.float(), atol=atol, rtol=rtol)
    assert torch.equal(got.lse == -math.inf, expected.lse == -math.inf)
    finite = expected.lse > -math.inf
    torch.testing.assert_close(got.lse[finite], expected.lse[finite], atol=1e-4, rtol=1e-5)


def test_cpp_decode_attention_is_the_kernel_for_decode_steps_only(monkeypatch):
    """Decode steps without weights run the C++ kernel; prefill chunks and weights go to the
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
    attention(
        torch.randn(2, 1, 4, 16),
        key_cache,
        value_cache,
        slots,
        positions,
        positions[:, -1:],
        return_weights=True,
    )
    assert calls == [1]


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
