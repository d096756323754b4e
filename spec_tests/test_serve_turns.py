"""A conversation's turns on the engine: ``Engine.submit(keep_kv=True)`` copies a finished
request's K/V out of the arena, and the next turn passes it back as ``prefix_kv``.

* The kept K/V is what a ``DynamicCache`` holds after prefilling the same tokens.
* A next turn from it makes the tokens it makes when it computes its whole prompt, also when
  the arena is tight enough to preempt.
* Evicting caches are refused, and change nothing.

Tiny random Llama (fp32, CPU) on the reference attention backend.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.policies import H2O
from kvstack.serve import CacheSpec, Engine
from spec_tests.test_serve_engine import BLOCK_BYTES, prompt
from spec_tests.tiny import tiny_serving_llama

pytestmark = pytest.mark.usefixtures("reference_attention")


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama(max_position_embeddings=1024)


def serving(model, capacity: int = 64 * BLOCK_BYTES) -> Engine:
    return Engine(model, KVArena(capacity), max_batch_tokens=48, prefill_chunk=16)


def prefill_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V a ``DynamicCache`` holds after one forward over ``ids``: [L, n, H_kv, D] each."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    keys = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return keys, values


def test_kept_kv_is_the_prefill_kv_of_the_prompt_and_outputs(model):
    engine = serving(model)
    ids = prompt(37, seed=1)
    handle = engine.submit(ids, 9, keep_kv=True)
    other = engine.submit(prompt(20, seed=2), 5)  # batched beside it; keeps nothing
    engine.run()
    keys, values = handle.kept_kv
    computed = ids + handle.output_ids[:-1]  # the last output was never fed back
    expected_keys, expected_values = prefill_kv(model, computed)
    assert keys.shape == expected_keys.shape == (2, len(computed), 2, 16)
    torch.testing.assert_close(keys, expected_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    assert other.kept_kv is None
    assert engine.arena.bytes_used == 0


@pytest.mark.parametrize("capacity_blocks", [64, 18])  # 18: a next turn is preempted
def test_a_next_turn_from_kept_kv_makes_the_tokens_of_computing_its_whole_prompt(
    model, capacity_blocks
):
    first_turns = [(prompt(30 + 7 * i, seed=10 + i), 12 + i) for i in range(3)]
    engine = serving(model, capacity_blocks * BLOCK_BYTES)
    handles = [engine.submit(ids, n, keep_kv=True) for ids, n in first_turns]
    engine.run()
    next_turns = [
        (ids + h.output_ids + prompt(6 + i, seed=20 + i), 30)
        for i, ((ids, _), h) in enumerate(zip(first_turns, handles, strict=True))
    ]
    reused = [
        engine.submit(ids, n, prefix_kv=h.kept_kv)
        for (ids, n), h in zip(next_turns, handles, strict=True)
    ]
    engine.run()
    fresh = serving(model)
    computed = [fresh.submit(ids, n) for ids, n in next_turns]
    fresh.run()
    assert [h.output_ids for h in reused] == [h.output_ids for h in computed]
    if capacity_blocks == 18:  # its K/V was written again at its second admission
        assert sum(h.stats.preemptions for h in reused) > 0
    assert engine.arena.bytes_used == 0


def test_keep_kv_on_an_evicting_cache_is_refused_and_changes_nothing(model):
    engine = Engine(model, KVArena(64 * BLOCK_BYTES), cache=CacheSpec(policy=H2O(), ratio=0.5))
    with pytest.raises(InvalidArgumentError, match="keep_kv needs the lossless cache"):
        engine.submit(prompt(20, seed=3), 4, keep_kv=True)
    assert not engine.has_work()
