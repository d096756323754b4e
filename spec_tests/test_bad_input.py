"""Every bad input is refused with the right error, a message that names the argument and the
value, and no change of state (kvstack.errors: "operations that raise leave their objects
unchanged").

Each test takes a small pool with one sequence in it (some tokens live, one evicted), snapshots
everything a call could touch (pool K/V bytes, free list, reference counts; the table's slots,
liveness, positions, blocks, free slots and version), makes one bad call, and compares.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvstack import ops
from kvstack.errors import (
    BackendUnavailable,
    DeadTokenError,
    DoubleFreeError,
    InvalidArgumentError,
    InvalidDTypeError,
    PoolExhausted,
    SlotOutOfRangeError,
)
from kvstack.reference.block_pool import BlockPool
from kvstack.reference.checks import FLOAT_DTYPES
from kvstack.reference.repack import execute_repack, plan_repack
from kvstack.reference.token_table import TokenTable

NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 6, 4, 2, 8
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
BACKENDS = ["reference", "compiled"]
META = torch.device("meta")  # stands in for "another device": there is no GPU here


def rows(n: int, *, heads: int = NUM_KV_HEADS, dim: int = HEAD_DIM, **kwargs) -> torch.Tensor:
    return torch.randn(n, heads, dim, **kwargs)


@pytest.fixture
def pool() -> BlockPool:
    pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pool.key.normal_()  # distinct bytes everywhere, so any stray write shows
    pool.value.normal_()
    return pool


@pytest.fixture
def table(pool: BlockPool) -> TokenTable:
    """Six tokens in two blocks; token 2 is evicted (its slot is free again)."""
    table = TokenTable(BLOCK_SIZE)
    table.append(pool, rows(6), rows(6))
    table.evict([2])
    return table


def snapshot(pool: BlockPool, *tables: TokenTable) -> tuple:
    return (
        pool.key.clone(),
        pool.value.clone(),
        list(pool.free_blocks),
        list(pool.ref_counts),
        [
            (
                t.slots.clone(),
                t.alive.clone(),
                t.positions.clone(),
                list(t.blocks),
                list(t.free_slots),
                t.version,
            )
            for t in tables
        ],
    )


def assert_unchanged(before: tuple, pool: BlockPool, *tables: TokenTable) -> None:
    after = snapshot(pool, *tables)
    assert torch.equal(before[0], after[0]), "pool.key changed"
    assert torch.equal(before[1], after[1]), "pool.value changed"
    assert before[2] == after[2], "pool free list changed"
    assert before[3] == after[3], "pool reference counts changed"
    names = ("slots", "alive", "positions", "blocks", "free_slots", "version")
    for i, (old, new) in enumerate(zip(before[4], after[4], strict=True)):
        for name, x, y in zip(names, old, new, strict=True):
            same = torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            assert same, f"table {i}: {name} changed from {x} to {y}"


def refused(error: type[Exception], *words: str):
    """pytest.raises(error) whose message must contain every word (argument names, values)."""
    return pytest.raises(error, match="(?s)" + "".join(f"(?=.*{re.escape(w)})" for w in words))


def backend_op(name: str, backend: str):
    try:
        return ops.get(name, backend)
    except BackendUnavailable as why:
        pytest.skip(str(why))


# ----------------------------------------------------------------------------- shapes
@pytest.mark.parametrize(
    ("key", "value", "argument", "got"),
    [
        (rows(3, heads=3), rows(3), "key", "(3, 3, 8)"),  # wrong number of KV heads
        (rows(3, dim=4), rows(3), "key", "(3, 2, 4)"),  # wrong head_dim
        (torch.randn(3, 16), rows(3), "key", "(3, 16)"),  # wrong rank
        (rows(3), rows(2), "value", "(2, 2, 8)"),  # value has fewer rows than key
        (rows(3), rows(3, dim=4), "value", "(3, 2, 4)"),
    ],
    ids=["key-heads", "key-head_dim", "key-rank", "value-rows", "value-head_dim"],
)
def test_append_wrong_shape(pool, table, key, value, argument, got) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, argument, got):
        table.append(pool, key, value)
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize(
    ("key", "value", "argument", "got"),
    [
        (rows(2, heads=1), rows(2), "key", "(2, 1, 8)"),
        (rows(3), rows(3), "key", "(3, 2, 8)"),  # three rows for two slots
        (rows(2), rows(2, dim=16), "value", "(2, 2, 16)"),
    ],
    ids=["key-heads", "key-rows", "value-head_dim"],
)
def test_pool_write_wrong_shape(pool, table, key, value, argument, got) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, argument, got):
        pool.write(torch.tensor([20, 21]), key, value)
    assert_unchanged(before, pool, table)


def test_append_wrong_positions_shape(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "positions", "(2,)"):
        table.append(pool, rows(3), rows(3), positions=torch.tensor([7, 8]))
    assert_unchanged(before, pool, table)


def test_append_negative_position(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "positions", "-1"):
        table.append(pool, rows(2), rows(2), positions=torch.tensor([-1, 0]))
    assert_unchanged(before, pool, table)


# ----------------------------------------------------------------------------- dtypes
NOT_FLOAT = [torch.int64, torch.int32, torch.bool, torch.float64]
assert torch.float64 not in FLOAT_DTYPES  # K/V are float32, float16 or bfloat16 only


@pytest.mark.parametrize("dtype", NOT_FLOAT, ids=str)
@pytest.mark.parametrize("argument", ["key", "value"])
def test_append_wrong_dtype(pool, table, argument, dtype) -> None:
    tensors = {"key": rows(2), "value": rows(2)}
    tensors[argument] = tensors[argument].to(dtype)
    before = snapshot(pool, table)
    with refused(InvalidDTypeError, argument, str(dtype)):
        table.append(pool, tensors["key"], tensors["value"])
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("dtype", NOT_FLOAT, ids=str)
@pytest.mark.parametrize("argument", ["key", "value"])
def test_pool_write_wrong_dtype(pool, table, argument, dtype) -> None:
    tensors = {"key": rows(2), "value": rows(2)}
    tensors[argument] = tensors[argument].to(dtype)
    before = snapshot(pool, table)
    with refused(InvalidDTypeError, argument, str(dtype)):
        pool.write(torch.tensor([20, 21]), tensors["key"], tensors["value"])
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool], ids=str)
def test_slots_wrong_dtype(pool, table, dtype) -> None:
    before = snapshot(pool, table)
    with refused(InvalidDTypeError, "slots", str(dtype)):
        pool.read(torch.tensor([0, 1]).to(dtype))
    with refused(InvalidDTypeError, "slots", str(dtype)):
        pool.write(torch.tensor([20, 21]).to(dtype), rows(2), rows(2))
    assert_unchanged(before, pool, table)


def test_append_float_positions(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidDTypeError, "positions", "torch.float32"):
        table.append(pool, rows(2), rows(2), positions=torch.tensor([6.0, 7.0]))
    assert_unchanged(before, pool, table)


# ----------------------------------------------------------------------------- devices
@pytest.mark.parametrize("argument", ["key", "value", "positions"])
def test_append_wrong_device(pool, table, argument) -> None:
    tensors = {"key": rows(2), "value": rows(2), "positions": torch.tensor([6, 7])}
    tensors[argument] = tensors[argument].to(META)
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, argument, "meta", "cpu"):
        table.append(pool, tensors["key"], tensors["value"], tensors["positions"])
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("argument", ["slots", "key", "value"])
def test_pool_write_wrong_device(pool, table, argument) -> None:
    tensors = {"slots": torch.tensor([20, 21]), "key": rows(2), "value": rows(2)}
    tensors[argument] = tensors[argument].to(META)
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, argument, "meta", "cpu"):
        pool.write(tensors["slots"], tensors["key"], tensors["value"])
    assert_unchanged(before, pool, table)


def test_pool_read_wrong_device(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "slots", "meta", "cpu"):
        pool.read(torch.tensor([0, 1], device=META))
    assert_unchanged(before, pool, table)


def test_evict_wrong_device(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "indices", "meta", "cpu"):
        table.evict(torch.tensor([0], device=META))
    assert_unchanged(before, pool, table)


# ----------------------------------------------------------------------------- slots and blocks
@pytest.mark.parametrize("bad_slot", [NUM_SLOTS, NUM_SLOTS + 5, -1])
def test_pool_read_slot_out_of_range(pool, table, bad_slot) -> None:
    before = snapshot(pool, table)
    with refused(SlotOutOfRangeError, "slots", str(bad_slot), str(NUM_SLOTS)):
        pool.read(torch.tensor([0, bad_slot]))
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("bad_slot", [NUM_SLOTS, -1])
def test_pool_write_slot_out_of_range(pool, table, bad_slot) -> None:
    before = snapshot(pool, table)
    # The in-range slot 20 must not be written either: the call is checked before it writes.
    with refused(SlotOutOfRangeError, "slots", str(bad_slot), str(NUM_SLOTS)):
        pool.write(torch.tensor([20, bad_slot]), rows(2), rows(2))
    assert_unchanged(before, pool, table)


def test_pool_slots_wrong_rank(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "slots", "(1, 2)"):
        pool.read(torch.tensor([[0, 1]]))
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("bad_block", [NUM_BLOCKS, NUM_BLOCKS + 3, -1])
def test_free_block_out_of_range(pool, table, bad_block) -> None:
    before = snapshot(pool, table)
    # An owned block named first must not be freed either (the list is checked first).
    with refused(SlotOutOfRangeError, "blocks", str(bad_block), str(NUM_BLOCKS)):
        pool.free([table.blocks[0], bad_block])
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("bad_block", ["1", 1.0, None, torch.tensor(1)], ids=repr)
def test_free_block_not_an_int(pool, table, bad_block) -> None:
    before = snapshot(pool, table)
    with refused(InvalidDTypeError, "blocks", "int"):
        pool.free([bad_block])
    assert_unchanged(before, pool, table)


def test_double_free_of_a_free_block(pool, table) -> None:
    free_block = pool.free_blocks[0]
    before = snapshot(pool, table)
    with refused(DoubleFreeError, "blocks", f"block {free_block}", "0 owner"):
        pool.free([table.blocks[0], free_block])
    assert_unchanged(before, pool, table)


def test_double_free_within_one_call(pool, table) -> None:
    block = table.blocks[1]
    before = snapshot(pool, table)
    with refused(DoubleFreeError, "blocks", f"block {block}", "1 owner", "2 time"):
        pool.free([block, block])
    assert_unchanged(before, pool, table)


def test_double_free_after_free(pool) -> None:
    (block,) = pool.allocate(1)
    pool.free([block])
    before = snapshot(pool)
    with refused(DoubleFreeError, f"block {block}"):
        pool.free([block])
    assert_unchanged(before, pool)


# ----------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("release", [True, False])
def test_evict_dead_token(pool, table, release) -> None:
    before = snapshot(pool, table)
    # Token 0 is live and named first: it must stay live, since the call is refused as a whole.
    with refused(DeadTokenError, "indices", "[2]"):
        table.evict([0, 2], release=release)
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("bad_index", [6, 100, -1])
def test_evict_unknown_index(pool, table, bad_index) -> None:
    before = snapshot(pool, table)
    with refused(SlotOutOfRangeError, "indices", str(bad_index), "6"):
        table.evict([0, bad_index])
    assert_unchanged(before, pool, table)


def test_evict_duplicated_index(pool, table) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "indices", "twice", "[1, 3, 1]"):
        table.evict([1, 3, 1])
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize(
    "indices",
    [torch.tensor([0.7]), [1.0, 3.0], torch.tensor([True, False])],
    ids=["float-tensor", "float-list", "bool-tensor"],
)
def test_evict_non_integer_indices(pool, table, indices) -> None:
    before = snapshot(pool, table)
    with refused(InvalidDTypeError, "indices", "dtype"):
        table.evict(indices)
    assert_unchanged(before, pool, table)


# ----------------------------------------------------------------------------- exhaustion
def test_allocate_more_than_free(pool, table) -> None:
    free = pool.num_free_blocks
    before = snapshot(pool, table)
    with refused(PoolExhausted, f"asked for {free + 1} blocks", f"only {free} of {NUM_BLOCKS}"):
        pool.allocate(free + 1)
    assert_unchanged(before, pool, table)


@pytest.mark.parametrize("n", [-1, 1.5, True, "2"], ids=repr)
def test_allocate_bad_count(pool, table, n) -> None:
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "n", repr(n)):
        pool.allocate(n)
    assert_unchanged(before, pool, table)


def test_append_more_than_the_pool_holds(pool, table) -> None:
    # The table has 3 free slots and the pool 4 free blocks (16 slots): 20 tokens need 5 blocks.
    assert len(table.free_slots) == 3 and pool.num_free_blocks == 4
    before = snapshot(pool, table)
    with refused(PoolExhausted, "asked for 5 blocks", "only 4"):
        table.append(pool, rows(20), rows(20))
    assert_unchanged(before, pool, table)  # the 3 free slots were not consumed either
    table.append(pool, rows(19), rows(19))  # one token fewer fits exactly
    assert pool.num_free_blocks == 0


# ----------------------------------------------------------------------------- sizes
BAD_SIZES = [0, -1, 1.5, True, "16"]


@pytest.mark.parametrize("value", BAD_SIZES, ids=repr)
@pytest.mark.parametrize("argument", ["num_blocks", "block_size", "num_kv_heads", "head_dim"])
def test_block_pool_size_not_a_positive_int(argument, value) -> None:
    sizes = dict(num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    sizes[argument] = value
    with refused(InvalidArgumentError, argument, "positive integer", repr(value)):
        BlockPool(**sizes)


@pytest.mark.parametrize("value", BAD_SIZES, ids=repr)
def test_token_table_block_size_not_a_positive_int(value) -> None:
    with refused(InvalidArgumentError, "block_size", "positive integer", repr(value)):
        TokenTable(value)


def test_pool_with_other_block_size(pool, table) -> None:
    other = BlockPool(NUM_BLOCKS, BLOCK_SIZE * 2, NUM_KV_HEADS, HEAD_DIM)
    before = snapshot(pool, table)
    before_other = snapshot(other)
    with refused(InvalidArgumentError, "block_size", str(BLOCK_SIZE * 2), str(BLOCK_SIZE)):
        table.append(other, rows(1), rows(1))
    with refused(InvalidArgumentError, "block_size", str(BLOCK_SIZE * 2), str(BLOCK_SIZE)):
        table.release_all(other)
    assert_unchanged(before, pool, table)
    assert_unchanged(before_other, other)


# ----------------------------------------------------------------------------- repack
def test_execute_stale_plan(pool, table) -> None:
    table.evict([0, 1, 3])  # two live tokens in two blocks: one block can go
    plan = plan_repack(table, force=True)
    assert plan is not None
    table.append(pool, rows(1), rows(1))  # a later mutation makes the plan stale
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "plan", f"version {plan.table_version}"):
        execute_repack(table, pool, plan)
    assert_unchanged(before, pool, table)


def test_execute_plan_built_for_another_table(pool, table) -> None:
    table.evict([0, 1, 3])
    plan = plan_repack(table, force=True)
    other = TokenTable(BLOCK_SIZE)
    other.append(pool, rows(6), rows(6))
    other.evict([0, 1, 3])
    while other.version < table.version:  # same version number, different table
        other.append(pool, rows(1), rows(1))
    other.version = table.version
    before = snapshot(pool, table, other)
    with refused(InvalidArgumentError, "plan", "another table"):
        execute_repack(other, pool, plan)
    assert_unchanged(before, pool, table, other)


def test_execute_plan_with_another_pool(pool, table) -> None:
    table.evict([0, 1, 3])
    plan = plan_repack(table, force=True)
    stranger = BlockPool(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    before = snapshot(pool, table)
    with refused(DoubleFreeError, "plan.freed_blocks"):
        execute_repack(table, stranger, plan)
    assert_unchanged(before, pool, table)
    assert stranger.num_free_blocks == NUM_BLOCKS


def test_execute_plan_twice(pool, table) -> None:
    table.evict([0, 1, 3])
    plan = plan_repack(table, force=True)
    execute_repack(table, pool, plan)
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "plan", "version"):
        execute_repack(table, pool, plan)
    assert_unchanged(before, pool, table)


def test_execute_plan_from_before_release_all(pool, table) -> None:
    # The plan saw version v. release_all and as many later mutations as v must not bring the
    # table back to version v: the plan would free blocks the table no longer owns.
    table.evict([0, 1, 3])
    plan = plan_repack(table, force=True)
    table.release_all(pool)
    while table.version < plan.table_version:
        table.append(pool, rows(1), rows(1))
    before = snapshot(pool, table)
    with refused(InvalidArgumentError, "plan", f"version {plan.table_version}"):
        execute_repack(table, pool, plan)
    assert_unchanged(before, pool, table)


# ----------------------------------------------------------------------------- attention
def attention_args(pool: BlockPool, table: TokenTable, **replace) -> dict:
    slots = table.live_slots()[None]  # [1, T_k]
    args = dict(
        query=torch.randn(1, 1, 2 * NUM_KV_HEADS, HEAD_DIM),  # [B, T_q, H_q, D]
        key_cache=pool.key,
        value_cache=pool.value,
        slots=slots,
        key_positions=table.live_positions()[None],
        query_positions=torch.tensor([[table.next_position()]]),
    )
    args.update(replace)
    return args


BAD_ATTENTION = {
    # case: (replacements, error, words the message must contain)
    "query-rank-3": (
        dict(query=torch.randn(1, 2 * NUM_KV_HEADS, HEAD_DIM)),
        InvalidArgumentError,
        ["query", "4 dimensions", "(1, 4, 8)"],
    ),
    "head_dim-mismatch": (
        dict(query=torch.randn(1, 1, 2 * NUM_KV_HEADS, HEAD_DIM // 2)),
        InvalidArgumentError,
        [
            "key_cache",
            str(HEAD_DIM // 2),
            f"({NUM_BLOCKS}, {BLOCK_SIZE}, {NUM_KV_HEADS}, {HEAD_DIM})",
        ],
    ),
    "H_q-not-multiple-of-H_kv": (
        dict(query=torch.randn(1, 1, 3, HEAD_DIM)),
        InvalidArgumentError,
        ["query", "3 heads", f"{NUM_KV_HEADS} KV heads"],
    ),
    "int-query": (
        dict(query=torch.ones(1, 1, 2 * NUM_KV_HEADS, HEAD_DIM, dtype=torch.int64)),
        InvalidDTypeError,
        ["query", "torch.int64"],
    ),
    "slots-below-padding": (
        dict(slots=torch.tensor([[0, 1, -2, 3, 4]])),
        SlotOutOfRangeError,
        ["slots", "-2", "-1 (padding)"],
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_ATTENTION))
def test_paged_attention_bad_input(pool, table, backend, case) -> None:
    attention = backend_op("paged_attention", backend)
    replace, error, words = BAD_ATTENTION[case]
    args = attention_args(pool, table, **replace)
    inputs = {name: tensor.clone() for name, tensor in args.items()}
    before = snapshot(pool, table)
    with refused(error, *words):
        attention(*args.values())
    assert_unchanged(before, pool, table)
    assert all(torch.equal(inputs[name], args[name]) for name in args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_slot_past_the_pool(pool, table, backend) -> None:
    attention = backend_op("paged_attention", backend)
    args = attention_args(pool, table, slots=torch.tensor([[0, 1, NUM_SLOTS, 3, 4]]))
    before = snapshot(pool, table)
    with refused(SlotOutOfRangeError, "slots", str(NUM_SLOTS)):
        attention(*args.values())
    assert_unchanged(before, pool, table)


BAD_DECODE = {
    # case: (replacements, error, words the message must contain)
    "two-queries": (
        dict(query=torch.randn(1, 2, 2 * NUM_KV_HEADS, HEAD_DIM)),
        InvalidArgumentError,
        ["query", "2 tokens", "expected 1", "paged_attention"],
    ),
    "padding-slot": (
        dict(slots=torch.tensor([[0, 1, -1, 3, 4]])),
        SlotOutOfRangeError,
        ["slots", "-1 (padding)", "paged_attention"],
    ),
    "no-slots": (
        dict(slots=torch.zeros((1, 0), dtype=torch.int64)),
        InvalidArgumentError,
        ["slots", "(1, 0)", "at least one slot"],
    ),
    "head_dim-mismatch": (
        dict(query=torch.randn(1, 1, 2 * NUM_KV_HEADS, HEAD_DIM // 2)),
        InvalidArgumentError,
        ["key_cache", str(HEAD_DIM // 2)],
    ),
    "slot-past-the-pool": (
        dict(slots=torch.tensor([[0, 1, NUM_SLOTS, 3, 4]])),
        SlotOutOfRangeError,
        ["slots", str(NUM_SLOTS)],
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_decode_attention_bad_input(pool, table, backend, case) -> None:
    decode = backend_op("decode_attention", backend)
    replace, error, words = BAD_DECODE[case]
    args = attention_args(pool, table, **replace)
    args = {name: args[name] for name in ("query", "key_cache", "value_cache", "slots")}
    inputs = {name: tensor.clone() for name, tensor in args.items()}
    before = snapshot(pool, table)
    with refused(error, *words):
        decode(*args.values())
    assert_unchanged(before, pool, table)
    assert all(torch.equal(inputs[name], args[name]) for name in args)


# ----------------------------------------------------------------------------- merge
def _states(*shapes: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.randn(shape) for shape in shapes]


BAD_MERGE = {
    "outputs-differ": (
        _states((3, 4, 8), (3, 4, 16)),
        _states((3, 4), (3, 4)),
        ["outputs[1]", "(3, 4, 8)", "(3, 4, 16)"],
    ),
    "lse-differs-from-output": (
        _states((3, 4, 8), (3, 4, 8)),
        _states((3, 4), (3, 2)),
        ["lses[1]", "(3, 4)", "(3, 2)"],
    ),
    "lse-has-head_dim": (
        _states((3, 4, 8)),
        _states((3, 4, 8)),
        ["lses[0]", "(3, 4)", "(3, 4, 8)"],
    ),
    "count-differs": (
        _states((3, 4, 8), (3, 4, 8)),
        _states((3, 4)),
        ["outputs", "lses", "2 and 1"],
    ),
    "no-segments": ([], [], ["outputs", "lses", "0 and 0"]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_MERGE))
def test_merge_attention_states_mismatched_shapes(backend, case) -> None:
    merge = backend_op("merge_attention_states", backend)
    outputs, lses, words = BAD_MERGE[case]
    copies = [t.clone() for t in outputs + lses]
    with refused(InvalidArgumentError, *words):
        merge(outputs, lses)
    assert all(torch.equal(a, b) for a, b in zip(copies, outputs + lses, strict=True))
