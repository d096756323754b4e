"""Every registered fast implementation equals its reference (FlashInfer's
``test_<op>_reference_correctness``, made automatic by the op registry).

``CASES`` holds one input strategy and one comparison per operation; a test fails if an
operation is registered without a case, so a new op cannot escape this file. Backends that
cannot load here are skipped with the registry's reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from kvstack import ops
from spec_tests.strategies import (
    TOLERANCES,
    attention_cases,
    dtypes,
    ragged_cases,
    rotary_embedding,
)

FAST_BACKENDS = [b for b in ops.BACKENDS if b != "reference"]


def assert_close(actual, expected, dtype, what):
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(
        actual.cpu(), expected.cpu(), atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}"
    )


def assert_lse_close(actual, expected, what):
    # -inf (a query that sees nothing) must match exactly; finite values to float32 accuracy.
    assert torch.equal(actual.cpu() == -torch.inf, expected.cpu() == -torch.inf), (
        f"{what}: -inf pattern"
    )
    finite = expected.cpu() > -torch.inf
    torch.testing.assert_close(actual.cpu()[finite], expected.cpu()[finite], atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- cases per op
@st.composite
def attention_inputs(draw):
    # With and without weights: a backend may run a decode step without them another way
    # (the cpp backend's C++ decode kernel).
    case = draw(attention_cases(windows=True))
    kwargs = {"return_weights": draw(st.booleans()), **case.kwargs()}
    return case.args(), kwargs, case.query.dtype


def compare_attention(fast, ref, dtype):
    assert_close(fast.out, ref.out, dtype, "out")
    assert_lse_close(fast.lse, ref.lse, "lse")
    assert (fast.weights is None) == (ref.weights is None)
    if ref.weights is not None:
        torch.testing.assert_close(fast.weights.cpu(), ref.weights.cpu(), atol=1e-5, rtol=1e-4)


@st.composite
def decode_inputs(draw):
    """A decode step over live views: one query per sequence, every row the same number of
    live slots (scattered over the pool), no padding."""
    batch, h_kv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    group, head_dim = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([8, 16, 32]))
    block_size, length = draw(st.sampled_from([1, 3, 16, 64])), draw(st.integers(1, 80))
    dtype = draw(dtypes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    num_blocks = -(-batch * length // block_size) + 1
    shape = (num_blocks, block_size, h_kv, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(dtype)
    value_cache = torch.randn(shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[: batch * length]
    slots = slots.view(batch, length).to(draw(st.sampled_from([torch.int64, torch.int32])))
    query = torch.randn((batch, 1, h_kv * group, head_dim), generator=gen).to(dtype)
    scale = draw(st.none() | st.floats(0.05, 2.0))
    kwargs = {"scale": scale, "return_weights": draw(st.booleans())}
    return (query, key_cache, value_cache, slots), kwargs, dtype


@st.composite
def ragged_inputs(draw):
    case = draw(ragged_cases())
    return case.args(), case.kwargs(), case.query.dtype


def compare_ragged(fast, ref, dtype):
    assert_close(fast.out, ref.out, dtype, "out")
    assert_lse_close(fast.lse, ref.lse, "lse")


@st.composite
def merge_inputs(draw):
    count = draw(st.integers(1, 4))
    lead = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    heads, head_dim = draw(st.integers(1, 4)), draw(st.sampled_from([4, 16]))
    dtype = draw(dtypes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    outputs = [torch.randn(*lead, heads, head_dim, generator=gen).to(dtype) for _ in range(count)]
    lses = [10 * torch.randn(*lead, heads, generator=gen) for _ in range(count)]
    for lse in lses:  # some segments are empty for some queries: lse = -inf, out = 0
        empty = torch.rand(lse.shape, generator=gen) < 0.3
        lse[empty] = -torch.inf
    for out, lse in zip(outputs, lses, strict=True):
        out[lse == -torch.inf] = 0
    return (outputs, lses), {}, dtype


def compare_merge(fast, ref, dtype):
    assert_close(fast[0], ref[0], dtype, "out")
    assert_lse_close(fast[1], ref[1], "lse")


@st.composite
def multi_segment_inputs(draw):
    case = draw(attention_cases())
    pieces = draw(st.integers(1, 3))
    t_k = case.slots.shape[1]
    cuts = sorted(draw(st.lists(st.integers(0, t_k), min_size=pieces - 1, max_size=pieces - 1)))
    bounds = [0, *cuts, t_k]
    segments = [
        (case.key_cache, case.value_cache, case.slots[:, a:b], case.key_positions[:, a:b])
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    return (case.query, segments, case.query_positions), {}, case.query.dtype


def compare_multi_segment(fast, ref, dtype):
    assert_close(fast.out, ref.out, dtype, "out")
    assert_lse_close(fast.lse, ref.lse, "lse")


@st.composite
def copy_slots_inputs(draw):
    block_size = draw(st.sampled_from([1, 4, 16, 64]))
    num_blocks = draw(st.integers(2, 8))
    dtype = draw(dtypes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    shape = (num_blocks, block_size, 2, 8)
    key_cache, value_cache = (
        torch.randn(shape, generator=gen).to(dtype),
        torch.randn(shape, generator=gen).to(dtype),
    )
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    moves = draw(st.integers(0, len(slots) // 2))
    src, dst = slots[:moves], slots[moves : 2 * moves]  # disjoint, as a repack plan's are (I4)
    return (key_cache, value_cache, src, dst), {}, dtype


def run_copy_slots(fn, args, kwargs):
    key_cache, value_cache, src, dst = args
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    fn(key_cache, value_cache, src, dst, **kwargs)
    return key_cache, value_cache


def compare_copy_slots(fast, ref, dtype):
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1]), "copies are exact"


@st.composite
def move_pages_inputs(draw):
    """Page moves as ``KVArena.compact`` makes them, or any permutation of disjoint runs: the
    destinations never overlap one another, but each may overlap any source (the op's contract),
    so an implementation that writes a run before it has read every source is caught."""
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    if draw(st.booleans()):
        # A compaction: random pages (gap before each, size, alignment, kind) slide down to the
        # lowest offset their alignment allows ("kv"), or up to the top ("state", two-ended).
        pages = draw(
            st.lists(
                st.tuples(
                    st.integers(0, 9),
                    st.integers(1, 12),
                    st.sampled_from([1, 1, 4, 8]),
                    st.sampled_from(["kv", "state"]),
                ),
                max_size=8,
            )
        )
        two_ended = draw(st.booleans())
        layout, cursor = [], 0
        for gap, size, align, kind in pages:
            offset = -(-(cursor + gap) // align) * align
            layout.append((offset, size, align, kind))
            cursor = offset + size
        total = cursor + draw(st.integers(0, 9))
        down = [page for page in layout if not two_ended or page[3] == "kv"]
        up = [page for page in reversed(layout) if two_ended and page[3] == "state"]
        runs, cursor, top = [], 0, total
        for offset, size, align, _ in down:
            target = -(-cursor // align) * align
            runs.append((offset, target, size))
            cursor = target + size
        for offset, size, align, _ in up:
            target = (top - size) // align * align
            runs.append((offset, target, size))
            top = target
        assume(cursor <= top)  # the two ends collide: the arena would compact one way only
        runs = [run for run in runs if run[0] != run[1]]  # the arena moves only what moves
    else:
        # A permutation: runs tile [base, ...) and are laid out again, in another order, from
        # another base; some runs are left where they are.
        sizes = draw(st.lists(st.integers(1, 12), max_size=8))
        order = draw(st.permutations(range(len(sizes))))
        moving = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
        src_base, dst_base = draw(st.integers(0, 9)), draw(st.integers(0, 9))
        sources = [src_base + sum(sizes[:i]) for i in range(len(sizes))]
        destinations, cursor = {}, dst_base
        for i in order:
            destinations[i] = cursor
            cursor += sizes[i]
        runs = [(sources[i], destinations[i], sizes[i]) for i in order if moving[i]]
        total = max(src_base, dst_base) + sum(sizes) + draw(st.integers(0, 4))
    # Pages of several elements each (KV blocks): every offset and size a multiple of ``unit``,
    # and a buffer that may end mid-unit.
    unit = draw(st.sampled_from([1, 1, 2, 16]))
    runs = [(src * unit, dst * unit, size * unit) for src, dst, size in runs]
    total = total * unit + draw(st.integers(0, unit - 1))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    buffer = torch.randn(total, generator=gen).to(dtype)  # [E] distinct values
    src, dst, size = (torch.tensor([run[k] for run in runs], dtype=torch.int64) for k in range(3))
    return (buffer, src, dst, size), {}, dtype


def run_move_pages(fn, args, kwargs):
    buffer, src, dst, sizes = args
    buffer = buffer.clone()
    fn(buffer, src, dst, sizes, **kwargs)
    return buffer


def compare_move_pages(fast, ref, dtype):
    assert torch.equal(fast.cpu(), ref.cpu()), "page moves are exact"


@st.composite
def rope_inputs(draw, rerotate: bool):
    head_dim = draw(st.sampled_from([8, 32, 64]))
    tokens, heads = draw(st.integers(1, 40)), draw(st.integers(1, 3))
    dtype = draw(dtypes)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    keys = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    low = -2000 if rerotate else 0
    positions = torch.randint(low, 4000, (tokens,), generator=gen)
    emb = rotary_embedding(draw(st.sampled_from(["default", "linear", "llama3", "yarn"])), head_dim)
    return (keys, positions, emb), {}, dtype


def compare_tensors(fast, ref, dtype):
    assert_close(fast, ref, dtype, "keys")


def call(fn, args, kwargs):
    return fn(*args, **kwargs)


CASES = {
    "paged_attention": (attention_inputs(), call, compare_attention),
    "decode_attention": (decode_inputs(), call, compare_attention),
    "ragged_decode_attention": (ragged_inputs(), call, compare_ragged),
    "merge_attention_states": (merge_inputs(), call, compare_merge),
    "multi_segment_attention": (multi_segment_inputs(), call, compare_multi_segment),
    "copy_slots": (copy_slots_inputs(), run_copy_slots, compare_copy_slots),
    "move_pages": (move_pages_inputs(), run_move_pages, compare_move_pages),
    "rotate_keys": (rope_inputs(rerotate=False), call, compare_tensors),
    "rerotate_keys": (rope_inputs(rerotate=True), call, compare_tensors),
}


def test_every_registered_op_has_an_equivalence_case():
    assert set(ops.operations()) == set(CASES), "register a case for every op in ops._SPEC"


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_implementation_matches_reference(name, backend):
    op = ops.operations()[name]
    if backend not in op.implementations:
        pytest.skip(op.unavailable[backend])
    if backend not in op.backends("cpu"):
        pytest.skip(f"the {backend} backend takes {ops.BACKEND_DEVICES[backend]} tensors only")
    check_against_reference(name, op.implementations[backend])


def check_against_reference(name: str, fast, *, device: str = "cpu") -> None:
    """Hypothesis over ``CASES[name]``: ``fast`` (given inputs on ``device``) must give the CPU
    reference's result. Raises the comparison's AssertionError on the shrunk counterexample;
    spec_tests/test_equivalence_catches_wrong_kernel.py shows it does for a wrong kernel."""
    inputs, run, compare = CASES[name]
    reference = ops.operations()[name].reference

    @given(inputs)
    def check(drawn):
        args, kwargs, dtype = drawn
        expected = run(reference, args, kwargs)
        if device == "cpu":
            compare(run(fast, args, kwargs), expected, dtype)
        else:
            actual = run(fast, to_device(args, device), kwargs)
            compare(to_device(actual, "cpu"), expected, dtype)

    check()


def to_device(obj, device):
    """Move every tensor (and module) inside nested args to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, torch.nn.Module):
        return copy.deepcopy(obj).to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a NamedTuple such as AttentionOutput
        return type(obj)(*(to_device(item, device) for item in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(item, device) for item in obj)
    if isinstance(obj, dict):
        return {key: to_device(value, device) for key, value in obj.items()}
    return obj


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fast_implementation_on_cuda_matches_cpu_reference(name, backend):
    op = ops.operations()[name]
    if backend not in op.implementations:
        pytest.skip(op.unavailable[backend])
    if backend not in op.backends("cuda"):
        pytest.skip(f"the {backend} backend takes {ops.BACKEND_DEVICES[backend]} tensors only")
    check_against_reference(name, op.implementations[backend], device="cuda")


@given(case=attention_cases(max_query=12, windows=True))
def test_compiled_prefill_in_query_chunks_matches_reference(case, monkeypatch_chunk):
    """A long prefill runs in query chunks, each over the key columns it can see; with a chunk
    of 3 queries, small random cases exercise every chunk boundary and key cut."""
    compiled = ops.get("paged_attention", "compiled")
    reference = ops.get("paged_attention", "reference")
    kwargs = {"return_weights": True, **case.kwargs()}
    compare_attention(
        compiled(*case.args(), **kwargs), reference(*case.args(), **kwargs), case.query.dtype
    )


@pytest.fixture(scope="module")
def monkeypatch_chunk():
    import kvstack.compiled.attention as compiled_attention

    saved = compiled_attention.QUERY_CHUNK
    compiled_attention.QUERY_CHUNK = 3
    yield
    compiled_attention.QUERY_CHUNK = saved


@pytest.mark.parametrize("backend", ["reference", "compiled"])
@given(case=attention_cases())
def test_paged_attention_without_checks_computes_the_same(backend, case):
    """check=False (the HF attention's trusted path) skips only the argument checks."""
    attention = ops.get("paged_attention", backend)
    kwargs = {"return_weights": True, **case.kwargs()}
    checked = attention(*case.args(), **kwargs)
    unchecked = attention(*case.args(), check=False, **kwargs)
    for a, b in zip(checked, unchecked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@given(case=attention_cases())
def test_decode_attention_is_paged_attention_over_a_live_view(case):
    """On a decode step whose keys are all visible (positions before the query, no window, no
    padding), decode_attention gives paged_attention's out, lse and weights, on every backend."""
    assume(case.slots.shape[1] > 0)  # every sequence empty: no key, so no decode step
    rows = (case.slots >= 0).all(dim=1)  # sequences without padding
    assert rows.any(), "the longest sequence has no padding"
    query, slots = case.query[rows, -1:], case.slots[rows]
    key_positions = case.key_positions[rows]
    query_positions = key_positions.max(dim=1, keepdim=True).values  # sees every key
    args = (query, case.key_cache, case.value_cache)
    expected = ops.get("paged_attention", "reference")(
        *args, slots, key_positions, query_positions, return_weights=True
    )
    for backend in ops.operations()["decode_attention"].backends():
        decode = ops.get("decode_attention", backend)
        compare_attention(decode(*args, slots, return_weights=True), expected, query.dtype)
