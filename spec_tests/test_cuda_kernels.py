"""The CUDA kernels of ``cuda_kernels/*.cu`` against the reference (marked ``gpu``).

The kernels are built here, with ``torch.utils.cpp_extension`` from the sources, and reached as
``torch.ops.kvstack_cuda``; they are not yet the registry's ``cuda`` backend. Each test runs a
kernel on the GPU and the reference (``kvstack.reference``) on the CPU in float32, on the same
inputs: float32, float16 and bfloat16; grouped-query attention; ragged tables with -1 padding,
evicted tokens (gaps in positions) and shuffled slots; block sizes 1-64; sliding windows; more
keys than one split holds (the split-K merge).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstack import policies
from kvstack.reference import attention as reference
from kvstack.reference import merge as reference_merge
from kvstack.reference import repack as reference_repack
from spec_tests.strategies import TOLERANCES, AttentionCase, attention_cases

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
]

SOURCES = sorted((Path(__file__).resolve().parents[1] / "cuda_kernels").glob("*.cu"))
TOLERANCE = {**TOLERANCES, torch.float16: (2e-3, 2e-3)}


@functools.cache
def kernels():
    from torch.utils.cpp_extension import load

    load(
        name="kvstack_cuda_kernels_test",
        sources=[str(source) for source in SOURCES],
        is_python_module=False,
        extra_cuda_cflags=["-O3"],
    )
    return torch.ops.kvstack_cuda


def _on(case: AttentionCase, device: str, dtype: torch.dtype | None = None) -> AttentionCase:
    def move(tensor):
        tensor = tensor.to(device)
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    return AttentionCase(*(move(t) for t in case.args()), case.window)


def _check_attention(case: AttentionCase, dtype: torch.dtype, return_weights: bool) -> None:
    gpu = _on(case, "cuda", dtype)
    # The reference on the GPU inputs' values, in float32 on the CPU.
    expected = reference.paged_attention(
        *_on(gpu, "cpu", torch.float32).args(),
        window=case.window,
        return_weights=return_weights,
    )
    scale = 1.0 / math.sqrt(case.query.shape[-1])
    out, lse, weights = kernels().paged_attention(
        *gpu.args(), scale, case.window or 0, return_weights
    )
    atol, rtol = TOLERANCE[dtype]
    assert out.dtype == dtype and out.shape == case.query.shape
    torch.testing.assert_close(out.cpu().float(), expected.out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), expected.lse, atol=1e-4, rtol=1e-4)
    if return_weights:
        torch.testing.assert_close(weights.cpu(), expected.weights, atol=1e-5, rtol=1e-4)


@settings(max_examples=60)
@given(
    case=attention_cases(max_tokens=80, max_query=6, windows=True),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    return_weights=st.booleans(),
)
def test_paged_attention_matches_the_reference(case, dtype, return_weights):
    _check_attention(case, dtype, return_weights)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("t_k", [255, 256, 257, 1500])
@pytest.mark.parametrize("t_q", [1, 300])
def test_paged_attention_over_several_chunks(head_dim, group, t_k, t_q):
    # More keys than one chunk (256, or fewer for large groups). One query per sequence: the
    # keys are split across blocks and the LSE merge decides. 300 queries fill the device, so
    # one block walks every chunk with the online softmax.
    gen = torch.Generator().manual_seed(t_k * 31 + group * 7 + head_dim + t_q)
    batch, h_kv, block_size = 2, 2, 16
    num_blocks = -(-batch * t_k // block_size) + 1
    pool = (num_blocks, block_size, h_kv, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: batch * t_k].view(batch, t_k)
    slots[1, t_k // 2 :] = -1  # a shorter second sequence
    positions = torch.arange(t_k).expand(batch, t_k).contiguous()
    case = AttentionCase(
        torch.randn(batch, t_q, h_kv * group, head_dim, generator=gen),
        torch.randn(pool, generator=gen),
        torch.randn(pool, generator=gen),
        slots,
        positions,
        torch.arange(t_k - t_q, t_k).expand(batch, t_q).contiguous(),  # the last t_q tokens
    )
    for dtype in (torch.float32, torch.bfloat16):
        _check_attention(case, dtype, return_weights=True)


def test_paged_attention_with_no_visible_key_is_the_empty_state():
    case = AttentionCase(
        torch.randn(1, 2, 4, 16),
        torch.randn(4, 4, 2, 16),
        torch.randn(4, 4, 2, 16),
        torch.tensor([[3, -1, 7]]),
        torch.tensor([[5, 0, 6]]),
        torch.tensor([[1, 2]]),  # both queries precede every live key
    )
    gpu = _on(case, "cuda")
    out, lse, weights = kernels().paged_attention(*gpu.args(), 0.25, 0, True)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all()) and bool((weights == 0).all())


@settings(max_examples=30)
@given(
    states=st.integers(1, 5),
    rows=st.integers(1, 7),
    head_dim=st.sampled_from([1, 8, 64, 300]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_merge_attention_states_matches_the_reference(states, rows, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    outputs = torch.randn(states, rows, 3, head_dim, generator=gen).to(dtype)
    lses = torch.randn(states, rows, 3, generator=gen) * 4
    lses[0, 0] = -math.inf  # an empty segment
    lses[:, -1, -1] = -math.inf  # a row where every segment is empty
    expected_out, expected_lse = reference_merge.merge_attention_states(
        list(outputs.float()), list(lses)
    )
    out, lse = kernels().merge_attention_states(outputs.cuda(), lses.cuda())
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), expected_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.cpu(), expected_lse, atol=1e-5, rtol=1e-5)


def _pool(dtype, gen, num_blocks=6, block_size=4, heads=2, head_dim=8):
    shape = (num_blocks, block_size, heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_copy_slots_matches_the_reference(dtype, index_dtype):
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = _pool(dtype, gen)
    order = torch.randperm(key_cache.shape[0] * key_cache.shape[1], generator=gen)
    src, dst = order[:9], order[9:18]  # alias-free (I4): no slot is both
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference_repack.copy_slots(expected_k, expected_v, src, dst)
    gpu_k, gpu_v = key_cache.cuda(), value_cache.cuda()
    kernels().copy_slots(gpu_k, gpu_v, src.to("cuda", index_dtype), dst.to("cuda", index_dtype))
    assert torch.equal(gpu_k.cpu(), expected_k) and torch.equal(gpu_v.cpu(), expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_append_slots_writes_each_row_into_its_slot(dtype):
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = _pool(dtype, gen)
    slots = torch.tensor([5, 0, 23, 11])
    keys = torch.randn(4, 2, 8, generator=gen).to(dtype)
    values = torch.randn(4, 2, 8, generator=gen).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    expected_k.view(-1, 2, 8)[slots] = keys
    expected_v.view(-1, 2, 8)[slots] = values
    gpu_k, gpu_v = key_cache.cuda(), value_cache.cuda()
    kernels().append_slots(gpu_k, gpu_v, slots.cuda(), keys.cuda(), values.cuda())
    assert torch.equal(gpu_k.cpu(), expected_k) and torch.equal(gpu_v.cpu(), expected_v)


@settings(max_examples=30)
@given(
    tables=st.integers(1, 4),
    budget=st.integers(4, 40),
    heads=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_h2o_decode_step_matches_the_policy(tables, budget, heads, seed):
    # A decode step of H2O: every table holds budget + 1 live tokens (some logical indices
    # evicted before), observes this step's weights over its view, and evicts one token.
    gen = torch.Generator().manual_seed(seed)
    policy = policies.H2O()
    seen = budget + 1 + 5
    live = torch.stack(
        [torch.randperm(seen, generator=gen)[: budget + 1].sort().values for _ in range(tables)]
    )  # [N, L] logical order
    alive = torch.zeros(tables, seen, dtype=torch.bool).scatter_(1, live, True)
    state = policy.init_state(tables)
    # Earlier steps' sums: distinct values, so no victim is decided by float rounding alone.
    state.at(seen, torch.device("cpu")).copy_(
        torch.randperm(tables * seen, generator=gen).view(tables, seen).float()
    )
    weights = torch.rand(tables, heads, 1, budget + 1, generator=gen) / 8  # < 1: order kept
    scores = state.at(seen, torch.device("cpu")).clone().cuda()
    policy.observe_columns(state, alive, weights, live)
    expected = policy.choose_one_victim_each(state, alive, live, budget)
    first, end = policy.sink_tokens, budget + 1 - policy.recent_window(budget)
    victims = kernels().accumulate_and_pick_victims(
        scores, weights.cuda(), live.cuda(), live[:, first:end].contiguous().cuda()
    )
    torch.testing.assert_close(scores.cpu(), state.at(seen, torch.device("cpu")))
    assert torch.equal(victims.cpu(), expected)


def test_kernels_refuse_bad_input_by_name():
    pool = torch.zeros(2, 4, 1, 8, device="cuda")
    with pytest.raises(RuntimeError, match="slots must be"):
        kernels().paged_attention(
            torch.zeros(1, 1, 1, 8, device="cuda"),
            pool,
            pool,
            torch.zeros(2, 3, dtype=torch.int64, device="cuda"),  # batch 2, query batch 1
            torch.zeros(2, 3, dtype=torch.int64, device="cuda"),
            torch.zeros(1, 1, dtype=torch.int64, device="cuda"),
            1.0,
            0,
            False,
        )
    with pytest.raises(RuntimeError, match="src_slots and dst_slots"):
        kernels().copy_slots(
            pool,
            pool.clone(),
            torch.zeros(2, dtype=torch.int64, device="cuda"),
            torch.zeros(3, dtype=torch.int64, device="cuda"),
        )
