"""PagedCache on hybrid Mamba/linear-attention + attention models (random tiny configs).

Each plain attention layer is paged; each state layer (``linear_attention``, ``conv``:
transformers' ``LinearAttentionLayer``) keeps transformers' semantics with its conv and recurrent
states in arena "state" pages (``kvstack.hf.state_layers``); FalconH1's ``hybrid`` layers combine
both. Greedy (and beam) tokens must equal those of transformers' own ``DynamicCache(config=...)``.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import (
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

import kvstack.hf
from kvstack.arena import KVArena
from kvstack.errors import ArenaExhausted, InvalidArgumentError, KVStackError
from kvstack.hf import PagedCache, PagedLayer, TokenTableCache, TokenTableLayer
from kvstack.hf.state_layers import ArenaStateLayer, HybridStateLayer
from kvstack.models import TINY_HYBRIDS, tiny_hybrid_config
from kvstack.policies import H2O

HYBRIDS = list(TINY_HYBRIDS)


def hybrid_config(name: str, **overrides):
    return tiny_hybrid_config(name, **overrides)


@pytest.fixture(autouse=True, scope="module")
def reference_attention():
    """These tests are about state pages, not attention kernels (the compiled ones are checked
    against the reference in test_equivalence and test_hf_paged): the reference attention gives
    the same tokens without compiling a kernel for every new shape, which would dominate here."""
    kvstack.hf.set_backend("reference")
    yield
    kvstack.hf.set_backend(None)


@functools.cache
def tiny_model(name: str):
    torch.manual_seed(0)
    config = hybrid_config(name)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def prompt(length: int, seed: int, rows: int = 1) -> torch.Tensor:
    return torch.randint(2, 120, (rows, length), generator=torch.Generator().manual_seed(seed))


def generate(model, ids, cache, **kwargs) -> torch.Tensor:
    """Greedy ``generate``: eager attention for transformers' cache, kvstack's for ours."""
    model.set_attn_implementation("eager" if type(cache) is DynamicCache else "kvstack")
    kwargs.setdefault("max_new_tokens", 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, do_sample=False, past_key_values=cache, **kwargs)


def state_layers_of(cache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def state_tensors(cache) -> list[torch.Tensor]:
    return [
        state
        for layer in state_layers_of(cache)
        for states in (layer.conv_states, layer.recurrent_states)
        for state in states.values()
        if state is not None
    ]


def state_bytes(cache) -> int:
    """Bytes of a cache's state tensors, from their shapes (for DynamicCache: transformers' own)."""
    return sum(state.numel() * state.element_size() for state in state_tensors(cache))


def state_tensors_of(layer) -> list[torch.Tensor]:
    """One state layer's state tensors, in the order of its ``state_pages``."""
    return [layer._state_dict(kind)[index] for kind, index in layer.state_pages]


def previous_states(cache) -> list[bool]:
    """``has_previous_state`` of every state layer that holds states (NemotronH's MLP layers
    are state layers without states in transformers 5.17)."""
    return [
        cache.has_previous_state(index)
        for index, layer in enumerate(cache.layers)
        if isinstance(layer, LinearAttentionCacheLayerMixin)
        and any(layer.is_conv_states_initialized.values())
    ]


def state_page_offsets(cache) -> list[int]:
    return [
        page.offset
        for layer in state_layers_of(cache)
        for pages in layer.state_pages.values()
        for page in pages
    ]


def assert_states_in_arena(cache, arena: KVArena) -> None:
    buffer = arena.buffer.untyped_storage().data_ptr()
    states = state_tensors(cache)
    assert states, "the cache holds no states"
    assert all(state.untyped_storage().data_ptr() == buffer for state in states)


def assert_states_match(ours, theirs) -> None:
    """Same states, same shapes; values equal up to the attention kernels' rounding."""
    for mine, reference in zip(state_tensors(ours), state_tensors(theirs), strict=True):
        assert mine.shape == reference.shape and mine.dtype == reference.dtype
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)


class Between(LogitsProcessor):
    """Calls ``action`` once, before the token of decode step ``step`` is chosen."""

    def __init__(self, step: int, action) -> None:
        self.step, self.action, self.calls = step, action, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.step:
            self.action()
        return scores


class Filler:
    """An arena owner outside any cache (its pages never move with a cache)."""

    def pages_moved(self, moves) -> None:
        pass


# ---------------------------------------------------------------------- tokens and bytes
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_greedy_tokens_equal_transformers_cache(name):
    model, ids = tiny_model(name), prompt(20, seed=1)
    reference = DynamicCache(config=model.config)
    expected = generate(model, ids, reference, max_new_tokens=12)
    cache = PagedCache(model.config)
    got = generate(model, ids, cache, max_new_tokens=12)
    assert torch.equal(got, expected)
    for ours, theirs in zip(cache.layers, reference.layers, strict=True):
        if type(theirs) is LinearAttentionLayer:
            assert type(ours) is ArenaStateLayer
        elif type(theirs) is LinearAttentionAndFullAttentionLayer:  # FalconH1
            assert isinstance(ours, HybridStateLayer) and isinstance(ours, PagedLayer)
        elif isinstance(ours, PagedLayer):
            assert type(theirs).__name__ in ("DynamicLayer", "DynamicSlidingWindowLayer")
        else:  # layers without a cache (NemotronH's MLP layers) stay transformers' own
            assert type(ours) is type(theirs)
    assert (
        len(cache.paged_layers) == 2 and cache.stats()["blocks_allocated"] == 2 * 2
    )  # 31 tokens, 16/block
    assert_states_in_arena(cache, cache.arena)
    assert_states_match(cache, reference)
    expected_bytes = state_bytes(reference)
    assert expected_bytes > 0
    assert cache.stats()["bytes_used_state"] == expected_bytes
    assert cache.arena.stats()["bytes_used_state"] == expected_bytes
    assert cache.stats()["bytes_used"] == expected_bytes + cache.stats()["bytes_used_kv"]
    # One page per (layer, row, state tensor), each exactly one row of its state.
    pages = [
        page for layer in state_layers_of(cache) for p in layer.state_pages.values() for page in p
    ]
    assert sorted(page.size for page in pages) == sorted(
        state[0].numel() for state in state_tensors(reference)
    )
    assert previous_states(cache) == previous_states(reference) and all(previous_states(cache))


@pytest.mark.parametrize("name", ["jamba", "lfm2", "falcon_h1"])
def test_hybrid_token_table_cache_evicts_attention_layers_only(name):
    model, ids = tiny_model(name), prompt(30, seed=2)
    outputs, caches = {}, {}
    for reclaim in (True, False):
        caches[reclaim] = TokenTableCache(
            model.config, H2O(), budget=12, block_size=4, reclaim=reclaim
        )
        outputs[reclaim] = generate(model, ids, caches[reclaim], max_new_tokens=10)
    assert torch.equal(outputs[True], outputs[False])
    for layer in caches[True].paged_layers:
        assert isinstance(layer, TokenTableLayer)
        assert all(table.num_live == 12 for table in layer.tables)
    assert caches[True].stats()["bytes_used_kv"] < caches[False].stats()["bytes_used_kv"]
    # The state layers evict nothing: their pages are the same size in both caches.
    state_layers = state_layers_of(caches[True])
    assert state_layers and all(
        isinstance(layer, (ArenaStateLayer, HybridStateLayer)) for layer in state_layers
    )
    assert_states_in_arena(caches[True], caches[True].arena)
    reference = DynamicCache(config=model.config)
    generate(model, ids, reference, max_new_tokens=1)
    for cache in caches.values():
        assert cache.stats()["bytes_used_state"] == state_bytes(reference)


# ---------------------------------------------------------------------- one arena, many caches
def test_hybrid_caches_share_one_fixed_arena_and_release_it():
    model = tiny_model("nemotron_h")
    ids = {"a": prompt(18, seed=3), "b": prompt(11, seed=4)}
    follow_up = prompt(5, seed=5)
    alone = {}
    for key in ids:  # each prompt alone, on transformers' cache: two turns
        reference = DynamicCache(config=model.config)
        first = generate(model, ids[key], reference)
        alone[key] = (first, generate(model, torch.cat([first, follow_up], 1), reference))
    arena = KVArena("1MiB", dtype=torch.float32)
    caches = {key: PagedCache(model.config, arena=arena) for key in ids}
    first = {key: generate(model, ids[key], caches[key]) for key in ids}  # b's pages after a's
    second = {  # a second turn of each, reusing the cache while the other one holds its pages
        key: generate(model, torch.cat([first[key], follow_up], 1), caches[key]) for key in ids
    }
    for key in ids:
        assert torch.equal(first[key], alone[key][0]) and torch.equal(second[key], alone[key][1])
        assert_states_in_arena(caches[key], arena)
    held = sum(cache.stats()["bytes_used_state"] for cache in caches.values())
    assert held > 0 and arena.stats()["bytes_used_state"] == held
    arena.check_invariants()
    for cache in caches.values():
        cache.release()
        assert cache.stats()["bytes_used"] == 0 and not state_tensors(cache)
    assert not arena.pages and arena.bytes_used == 0
    arena.check_invariants()


# ---------------------------------------------------------------------- pages that move
def test_compaction_mid_generation_moves_state_pages_and_keeps_tokens():
    model, ids = tiny_model("nemotron_h"), prompt(20, seed=6)
    expected = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    arena = KVArena("1MiB", dtype=torch.float32)
    # State pages are placed from the top: the filler sits above the cache's state pages, so
    # freeing it and compacting slides every one of them up.
    filler = arena.allocate(Filler(), "state", 1000)
    cache = PagedCache(model.config, arena=arena)
    seen = {}

    def free_filler_and_compact():
        seen["before"] = state_page_offsets(cache)
        arena.free(filler)
        arena.compact()
        seen["after"] = state_page_offsets(cache)

    step = Between(4, free_filler_and_compact)
    got = generate(
        model, ids, cache, max_new_tokens=10, logits_processor=LogitsProcessorList([step])
    )
    assert step.calls == 10 and arena.compactions == 1
    assert all(
        after == before + 1000 for before, after in zip(seen["before"], seen["after"], strict=True)
    )
    assert torch.equal(got, expected)
    assert_states_in_arena(cache, arena)
    arena.check_invariants()


def test_private_arena_growth_mid_generation_rebinds_states():
    model, ids = tiny_model("falcon_h1"), prompt(20, seed=7)
    expected = generate(model, ids, DynamicCache(config=model.config), max_new_tokens=10)
    cache = PagedCache(model.config)
    buffers = []

    def grow():  # a reservation beyond the capacity replaces the private arena's buffer
        buffers.append(cache.arena.buffer)
        cache.arena.reserve("grow", 2 * cache.arena.capacity_bytes)
        buffers.append(cache.arena.buffer)

    step = Between(5, grow)
    got = generate(
        model, ids, cache, max_new_tokens=10, logits_processor=LogitsProcessorList([step])
    )
    assert len(buffers) == 2 and buffers[0] is not buffers[1]
    assert torch.equal(got, expected)
    assert_states_in_arena(cache, cache.arena)


# ---------------------------------------------------------------------- beams, batches, rows
@pytest.mark.parametrize("name", ["nemotron_h", "falcon_h1"])
def test_hybrid_beam_search_equals_transformers_cache(name):
    model, ids = tiny_model(name), prompt(16, seed=8)
    expected = generate(model, ids, DynamicCache(config=model.config), num_beams=2)
    cache = PagedCache(model.config)
    got = generate(model, ids, cache, num_beams=2)
    assert torch.equal(got, expected)
    assert_states_in_arena(cache, cache.arena)
    assert all(state.shape[0] == 2 for state in state_tensors(cache))  # one row per beam


@pytest.mark.parametrize("name", ["nemotron_h", "falcon_h1"])
def test_hybrid_batch_of_two_rows_equals_transformers_cache(name):
    model, ids = tiny_model(name), prompt(14, seed=9, rows=2)
    reference = DynamicCache(config=model.config)
    expected = generate(model, ids, reference)
    cache = PagedCache(model.config)
    got = generate(model, ids, cache)
    assert torch.equal(got, expected)
    assert_states_in_arena(cache, cache.arena)
    assert_states_match(cache, reference)
    assert cache.stats()["bytes_used_state"] == state_bytes(reference)


def prefilled(name: str, rows: int = 2, arena: KVArena | None = None) -> PagedCache:
    model = tiny_model(name)
    cache = PagedCache(model.config, arena=arena)
    model.set_attn_implementation("kvstack")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 5.24 renames past_key_values to cache
        model(prompt(6, seed=10, rows=rows), past_key_values=cache, use_cache=True)
    return cache


def test_batch_select_and_repeat_take_new_pages_and_free_the_old():
    cache = prefilled("nemotron_h")
    layer = state_layers_of(cache)[0]
    before = {
        key: state.clone()
        for key, state in zip(layer.state_pages, state_tensors_of(layer), strict=True)
    }
    row_bytes = layer.state_bytes_used // 2
    old_pages = [page for pages in layer.state_pages.values() for page in pages]
    layer.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    assert all(page not in cache.arena.pages for page in old_pages)
    assert layer.state_bytes_used == 4 * row_bytes
    for key, state in zip(layer.state_pages, state_tensors_of(layer), strict=True):
        assert torch.equal(state, before[key][[0, 0, 1, 1]])
    layer.batch_select_indices(torch.tensor([3]))
    for key, state in zip(layer.state_pages, state_tensors_of(layer), strict=True):
        assert torch.equal(state, before[key][[1]])
    assert layer.state_bytes_used == row_bytes
    assert_states_in_arena(cache, cache.arena)
    cache.arena.check_invariants()


def test_batch_repeat_that_does_not_fit_changes_nothing():
    probe = prefilled("nemotron_h")  # how many bytes the cache holds with two rows
    used = probe.stats()["bytes_used"]
    arena = KVArena(used + 4096, dtype=torch.float32)  # room for the cache, not twice its states
    cache = prefilled("nemotron_h", arena=arena)
    layer = state_layers_of(cache)[0]
    pages = {key: list(pages) for key, pages in layer.state_pages.items()}
    states = [state.clone() for state in state_tensors_of(layer)]
    stats = cache.stats()
    with pytest.raises(ArenaExhausted, match="state pages need"):
        layer.batch_repeat_interleave(4)
    assert layer.state_pages == pages and cache.stats() == stats
    assert all(torch.equal(a, b) for a, b in zip(states, state_tensors_of(layer), strict=True))
    assert arena.stats()["bytes_used"] == stats["bytes_used"]
    arena.check_invariants()


# ---------------------------------------------------------------------- reset and release
@pytest.mark.parametrize("name", ["nemotron_h", "falcon_h1"])
def test_reset_then_generate_equals_a_fresh_run(name):
    model, ids = tiny_model(name), prompt(12, seed=11)
    cache = PagedCache(model.config)
    fresh = generate(model, ids, PagedCache(model.config))
    generate(model, prompt(17, seed=12), cache)  # another prompt first
    assert previous_states(cache) and all(previous_states(cache))
    state_bytes_before = cache.stats()["bytes_used_state"]
    offsets = state_page_offsets(cache)
    cache.reset()
    # transformers' reset: states zeroed, no previous state, the objects (here pages) kept.
    assert previous_states(cache) and not any(previous_states(cache))
    assert all(not state.any() for state in state_tensors(cache))
    assert cache.stats()["bytes_used_state"] == state_bytes_before
    assert state_page_offsets(cache) == offsets
    assert torch.equal(generate(model, ids, cache), fresh)
    assert all(previous_states(cache))


def test_release_returns_every_page_and_the_cache_works_again():
    model, ids = tiny_model("falcon_h1"), prompt(12, seed=13)
    arena = KVArena("1MiB", dtype=torch.float32)
    cache = PagedCache(model.config, arena=arena)
    first = generate(model, ids, cache)
    assert arena.stats()["pages_state"] == 2 * 2  # 2 layers x (conv, recurrent) x 1 row
    cache.release()
    assert not arena.pages and cache.stats()["bytes_used"] == 0
    for layer in state_layers_of(cache):
        assert not layer.state_pages and not any(layer.has_previous_state.values())
        assert not any(layer.is_conv_states_initialized.values())
    # New pages start as zeros (transformers' lazy_initialization), whatever the arena held.
    arena.buffer.fill_(1.0)
    layer = state_layers_of(cache)[0]
    layer.lazy_initialization(conv_states=torch.ones(1, 8, 2), conv_kernel_size=4)
    assert layer.conv_states[0].shape == (1, 8, 4) and not layer.conv_states[0].any()
    layer.lazy_initialization(conv_states=torch.ones(1, 8, 2), conv_kernel_size=4)  # again
    assert arena.stats()["pages_state"] == 1  # the first page went back: nothing leaks
    assert cache.stats()["bytes_used_state"] == 8 * 4 * 4
    layer.release()
    assert torch.equal(generate(model, ids, cache), first)
    assert_states_in_arena(cache, arena)


# ---------------------------------------------------------------------- several states per layer
def test_several_states_per_layer_match_transformers_layer():
    config = hybrid_config("jamba", number_of_conv_states=2)
    ours, theirs = PagedCache(config), DynamicCache(config=config)
    layer_idx = 0
    assert ours.layers[layer_idx].number_of_states == theirs.layers[layer_idx].number_of_states == 2
    generator = torch.Generator().manual_seed(14)
    for step, length in enumerate((6, 1, 1)):  # a prefill (longer than the kernel), two decodes
        for state_idx in (0, 1):
            if step == 0 and state_idx == 1:
                continue  # state 1 starts one step late: has_previous_state is per state
            conv = torch.randn(2, 8, length, generator=generator)
            recurrent = torch.randn(2, 8, 5, generator=generator)
            got = ours.update_conv_state(conv, layer_idx, state_idx, conv_kernel_size=4)
            want = theirs.update_conv_state(conv, layer_idx, state_idx, conv_kernel_size=4)
            assert torch.equal(got, want)
            got = ours.update_recurrent_state(recurrent, layer_idx, state_idx)
            want = theirs.update_recurrent_state(recurrent, layer_idx, state_idx)
            assert torch.equal(got, want)
        for state_idx in (0, 1):
            assert ours.has_previous_state(layer_idx, state_idx) == theirs.has_previous_state(
                layer_idx, state_idx
            )
        assert ours.has_previous_state(layer_idx) == theirs.has_previous_state(layer_idx)
    assert_states_match(ours, theirs)
    assert_states_in_arena(ours, ours.arena)
    # A page per (row, state tensor): 2 rows x 2 states x (conv, recurrent), exactly sized.
    assert ours.stats()["bytes_used_state"] == state_bytes(theirs) == 2 * 2 * (8 * 4 + 8 * 5) * 4
    beams = torch.tensor([1, 1])
    ours.layers[layer_idx].reorder_cache(beams)
    theirs.layers[layer_idx].reorder_cache(beams)
    assert_states_match(ours, theirs)
    assert_states_in_arena(ours, ours.arena)
    ours.reset()
    theirs.reset()
    assert not ours.has_previous_state(layer_idx) and not theirs.has_previous_state(layer_idx)
    assert_states_match(ours, theirs)


# ---------------------------------------------------------------------- bad input
def test_state_of_another_dtype_is_refused_before_anything_changes():
    config = hybrid_config("nemotron_h")
    arena = KVArena("64KiB", dtype=torch.float32)
    cache = PagedCache(config, arena=arena)
    layer = cache.layers[0]
    with pytest.raises(InvalidArgumentError, match=r"torch\.float64.*torch\.float32"):
        cache.update_conv_state(torch.zeros(1, 8, 4, dtype=torch.float64), 0)
    assert not arena.pages and cache.stats()["bytes_used_state"] == 0
    assert not layer.is_conv_states_initialized[0] and not layer.has_previous_state[0]


def test_state_that_does_not_fit_the_arena_changes_nothing():
    config = hybrid_config("nemotron_h")
    arena = KVArena(16 * 2 * 16 * 2 * 4, dtype=torch.float32)  # one KV block, 4 KiB
    cache = PagedCache(config, arena=arena, block_size=16)
    with pytest.raises(ArenaExhausted, match="state pages need 8192 bytes"):
        cache.update_recurrent_state(torch.zeros(2, 1024), 0)
    layer = cache.layers[0]
    assert not arena.pages and cache.stats()["bytes_used_state"] == 0
    assert not layer.is_recurrent_states_initialized[0] and layer.recurrent_states[0] is None


def test_update_with_another_batch_is_refused():
    cache = prefilled("nemotron_h", rows=2)
    layer = state_layers_of(cache)[0]
    states = [state.clone() for state in state_tensors_of(layer)]
    with pytest.raises(InvalidArgumentError, match=r"holds pages of shape \(2, "):
        layer.update_recurrent_state(torch.zeros(3, *layer.recurrent_states[0].shape[1:]))
    assert all(torch.equal(a, b) for a, b in zip(states, state_tensors_of(layer), strict=True))


def test_past_recording_and_offloading_are_refused():
    cache = prefilled("falcon_h1", rows=1)
    layer = cache.layers[0]
    with pytest.raises(KVStackError, match="cannot record past states"):
        cache.activate_past_recording()
    with pytest.raises(KVStackError, match="cannot be cropped"):
        layer.crop(-1)
    with pytest.raises(KVStackError, match="offloading them would take them out"):
        layer.offload()
    assert not layer.record_past and not layer.is_compileable and not layer.is_croppable
