"""``StackedKV``: one block table per request for every layer. Its slots address disjoint arena
memory of its own pages, layer by layer; its K/V survive the arena's compaction; it returns its
pages; it costs the arena what ``PagedCache`` costs."""

from __future__ import annotations

import pytest
import torch

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.serve.stacked_kv import StackedKV

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 8
BLOCK_BYTES = BLOCK * 2 * HEADS * DIM * 4  # one layer's block, K and V, fp32


def store(arena: KVArena, layers: int = LAYERS) -> StackedKV:
    return StackedKV(arena, layers=layers, block_size=BLOCK, num_kv_heads=HEADS, head_dim=DIM)


def write(kv: StackedKV, start: int, end: int, seed: int) -> list[torch.Tensor]:
    """Store tokens [start, end) in every layer (K = V = distinct values); returns what each
    layer holds [end - start, H, D]."""
    kv.reserve(end - kv.tokens)
    key_cache, value_cache = kv.key_value()
    rows = []
    for layer in range(LAYERS):
        slots = kv.base_slots(start, end) + layer * BLOCK
        values = torch.randn(
            end - start, HEADS, DIM, generator=torch.Generator().manual_seed(seed + layer)
        )
        key_cache.reshape(-1, HEADS, DIM).index_copy_(0, slots, values)
        value_cache.reshape(-1, HEADS, DIM).index_copy_(0, slots, -values)
        rows.append(values)
    kv.tokens = end
    return rows


def read(kv: StackedKV, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    key_cache, value_cache = kv.key_value()
    out = []
    for layer in range(LAYERS):
        slots = kv.base_slots(start, end) + layer * BLOCK
        out.append(
            (key_cache.reshape(-1, HEADS, DIM)[slots], value_cache.reshape(-1, HEADS, DIM)[slots])
        )
    return out


def test_every_layer_of_every_token_has_its_own_slot_in_the_requests_pages():
    arena = KVArena(40 * BLOCK_BYTES)
    kv = store(arena)
    written = write(kv, 0, 10, seed=0)  # 3 pages of 4 tokens, 3 layers each
    assert len(kv.pages) == 3 and kv.stats()["blocks_allocated"] == 9
    element = arena.itemsize
    owned = [range(p.offset * element, (p.offset + p.size) * element) for p in kv.pages]
    slots = torch.cat([kv.base_slots(0, 10) + layer * BLOCK for layer in range(LAYERS)])
    assert slots.unique().numel() == slots.numel()  # 30 distinct (layer, token) slots
    for slot in slots.tolist():  # inside the store's own pages
        block, offset = divmod(slot, BLOCK)
        byte = (block * BLOCK + offset) * 2 * HEADS * DIM * element
        assert any(byte in run for run in owned)
    for (keys, values), expected in zip(read(kv, 0, 10), written, strict=True):
        assert torch.equal(keys, expected) and torch.equal(values, -expected)


def test_k_v_survive_compaction_and_pages_return_to_the_arena():
    # Pages of 3 blocks (a, c) and of 2 (f, g, two-layer stores) in an arena of 11 blocks:
    # a 0-2, f 3-4, c 5-7, g 8-9, free 10. f leaves: 3 blocks free, but no 3 in a row, so a's
    # next page compacts the arena (c and g move down), and everyone keeps their K/V.
    arena = KVArena(11 * BLOCK_BYTES)
    a, f, c, g = store(arena), store(arena, 2), store(arena), store(arena, 2)
    first_a = write(a, 0, 4, seed=1)
    f.reserve(4)
    first_c = write(c, 0, 3, seed=3)
    g.reserve(4)
    f.release()
    assert f.stats()["bytes_used"] == 0 and f.pages == []
    before = arena.compactions
    second_a = write(a, 4, 8, seed=4)
    assert arena.compactions == before + 1
    for store_kv, parts in ((a, [(0, 4, first_a), (4, 8, second_a)]), (c, [(0, 3, first_c)])):
        for start, end, expected in parts:
            for (keys, values), rows in zip(read(store_kv, start, end), expected, strict=True):
                assert torch.equal(keys, rows) and torch.equal(values, -rows)
    for store_kv in (a, c, g):
        store_kv.release()
    assert arena.bytes_used == 0


def test_a_store_costs_what_per_layer_tables_cost_and_refuses_tokens_it_has_no_page_for():
    arena = KVArena(40 * BLOCK_BYTES)
    kv = store(arena)
    assert kv.blocks_needed(9) == 3 * LAYERS  # ceil(9 / 4) pages of LAYERS blocks
    kv.reserve(9)
    assert arena.bytes_used == kv.stats()["bytes_used"] == 3 * LAYERS * BLOCK_BYTES
    assert kv.blocks_needed(3) == 0  # room for 12 tokens already
    with pytest.raises(InvalidArgumentError, match=r"tokens \[0, 13\)"):
        kv.base_slots(0, 13)
    kv.release()
    assert arena.bytes_used == 0 and kv.stats()["peak_bytes_used"] == 3 * LAYERS * BLOCK_BYTES


@pytest.mark.parametrize("tokens", [1, 4, 9, 16])
def test_a_store_holds_the_arena_bytes_a_paged_cache_holds_for_the_same_tokens(tokens):
    # The claim the engine's accounting rests on: StackedKV takes exactly the arena bytes of
    # PagedCache's per-layer tables (one whole-row table per layer) for the same tokens.
    from transformers import LlamaConfig

    from kvstack.hf import PagedCache

    config = LlamaConfig(
        hidden_size=HEADS * DIM * 2,
        intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS * 2,
        num_key_value_heads=HEADS,
        head_dim=DIM,
        vocab_size=32,
    )
    paged_arena, stacked_arena = KVArena(40 * BLOCK_BYTES), KVArena(40 * BLOCK_BYTES)
    paged = PagedCache(config, block_size=BLOCK, arena=paged_arena)
    for layer in range(LAYERS):
        key = torch.randn(1, HEADS, tokens, DIM)
        paged.update(key, key, layer)
    kv = store(stacked_arena)
    kv.reserve(tokens)
    assert stacked_arena.bytes_used == paged_arena.bytes_used == paged.stats()["bytes_used"]
    assert kv.stats()["blocks_allocated"] == paged.stats()["blocks_allocated"]
