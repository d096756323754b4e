"""The ``cpp`` backend: C++ kernels for CPU tensors (cuda_kernels/*_cpu.cpp), built on first use.

Its equivalence with the reference runs with every backend's in test_equivalence.py and in the
repack property and state-machine tests; here: that it builds wherever a compiler exists (so a
broken build cannot hide behind skipped tests), the registry's device rule, the layouts an arena
gives it, and bad input.
"""

from __future__ import annotations

import os
import shutil

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

from kvstack import ops
from kvstack.reference.repack import copy_slots as reference_copy_slots

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
