"""A fact memory's K/V into the serving engine (``Engine.submit(prefix_kv=...)``): every request
makes the tokens ``generate`` makes from a ``DynamicCache`` holding the same K/V, through
batching and preemption; the arena is empty afterwards; bad input is refused and changes
nothing.

Tiny random Llama (fp32, CPU) on the reference attention backend, byte tokenizer, hashed-word
embedder: the fixtures of ``test_facts``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.policies import H2O
from kvstack.serve import CacheSpec, Engine
from spec_tests.test_facts import FACTS, memory, tiny_model

pytestmark = pytest.mark.usefixtures("reference_attention")

HEADER = "Notes:\n"
QUESTIONS = ["Who bakes? ", "What is the dog called? ", "Who plays? ", "What does Biscuit like? "]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def fact_memory():
    model = tiny_model()
    model.generation_config.eos_token_id = None
    mem = memory(prefix=HEADER, context_turns=2)
    for index, fact in enumerate(FACTS):
        mem.add(fact, context=FACTS[:index])
    return mem


def requests(mem) -> list[tuple[list[int], tuple[torch.Tensor, torch.Tensor]]]:
    """Prompts with different facts (and orders) and their prefix K/V."""
    picks = [["f0", "f1"], ["f2"], ["f3", "f0", "f2"], ["f1", "f3"]]
    return [mem.prompt_kv(ids, q) for ids, q in zip(picks, QUESTIONS, strict=True)]


def generate_from(model, ids: list[int], prefix_kv, new_tokens: int = NEW_TOKENS) -> list[int]:
    """``generate`` alone, from a ``DynamicCache`` holding ``prefix_kv`` (None: empty; sdpa)."""
    cache = DynamicCache(config=model.config)
    keys, values = prefix_kv if prefix_kv is not None else (torch.zeros(0), None)
    for layer in range(len(keys)):
        # [n, H_kv, D] -> [1, H_kv, n, D]
        cache.update(keys[layer].transpose(0, 1)[None], values[layer].transpose(0, 1)[None], layer)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def serve(model, arena: KVArena, batch, new_tokens: int = NEW_TOKENS) -> tuple[Engine, list]:
    engine = Engine(model, arena, prefill_chunk=8, max_batch_tokens=32)
    handles = [engine.submit(ids, new_tokens, prefix_kv=kv) for ids, kv in batch]
    engine.run()
    return engine, handles


def test_prompt_kv_is_the_prefix_and_the_facts_rotated_at_their_prompt_positions(fact_memory):
    mem = fact_memory
    ids, (keys, values) = mem.prompt_kv(["f2", "f0"], "Who? ")
    assert ids == mem.prompt_ids(HEADER, ["f2", "f0"], "Who? ")
    count = len(mem.prefix_ids) + len(mem.facts["f2"].token_ids) + len(mem.facts["f0"].token_ids)
    assert keys.shape == values.shape == (2, count, 2, 16)  # [L, n, H_kv, D]
    # The same K/V as build_cache's: the header prefilled, the facts injected after it.
    cache, _ = mem.build_cache(HEADER, ["f2", "f0"], "Who? ")
    for layer in range(2):
        built_keys = cache.layers[layer].keys[0].transpose(0, 1)  # [n, H_kv, D]
        assert torch.allclose(keys[layer], built_keys, rtol=1e-5, atol=1e-6)
        assert torch.equal(values[layer], cache.layers[layer].values[0].transpose(0, 1))


def test_injected_requests_make_the_tokens_of_generate_from_the_same_kv(fact_memory):
    model = tiny_model()
    batch = requests(fact_memory)
    expected = [generate_from(model, ids, kv) for ids, kv in batch]
    arena = KVArena("4MiB")
    engine, handles = serve(model, arena, batch)
    assert [h.output_ids for h in handles] == expected
    assert engine.preemptions == 0
    assert arena.bytes_used == 0


def test_a_preempted_injected_request_loads_its_kv_again_and_keeps_its_tokens(fact_memory):
    model = tiny_model()
    batch = requests(fact_memory)
    new_tokens = 40  # past the decode headroom (16 tokens) the engine admits with
    expected = [generate_from(model, ids, kv, new_tokens) for ids, kv in batch]
    # Room for the two longest requests' prompts and headroom, not their outputs: running
    # requests outgrow it mid-decode and the newest is preempted.
    page = 2 * 16 * 2 * 16 * 2 * 4  # 16 tokens x 2 layers x 2 KV heads x dim 16 x K, V x fp32
    longest = sorted(len(ids) for ids, _ in batch)[-2:]
    arena = KVArena(page * sum(-(-(n + 16) // 16) for n in longest))
    engine, handles = serve(model, arena, batch, new_tokens)
    assert engine.preemptions > 0
    assert [h.output_ids for h in handles] == expected
    assert arena.bytes_used == 0


def test_cancelling_an_injected_request_returns_its_pages(fact_memory):
    model = tiny_model()
    arena = KVArena("4MiB")
    engine = Engine(model, arena, prefill_chunk=8, max_batch_tokens=32)
    ids, kv = requests(fact_memory)[0]
    handle = engine.submit(ids, NEW_TOKENS, prefix_kv=kv)
    engine.step()
    assert arena.bytes_used > 0
    assert engine.cancel(handle)
    assert arena.bytes_used == 0


def test_bad_prefix_kv_is_refused_and_the_engine_is_unchanged(fact_memory):
    model = tiny_model()
    ids, (keys, values) = requests(fact_memory)[0]
    engine = Engine(model, KVArena("4MiB"))
    count = keys.shape[1]
    bad = {
        "pair of tensors": keys,
        r"keys \(2, 5, 2, 16\)": (keys[:, :5], values),
        r"expected both \[layers=2, n, kv_heads=2, head_dim=16\]": (keys[:1], values[:1]),
        "at least the last prompt token": (keys, values),  # all of a prompt cut to it
        "the arena holds torch.float32": (keys.double(), values.double()),
    }
    for pattern, prefix_kv in bad.items():
        prompt = ids[:count] if "last prompt token" in pattern else ids
        with pytest.raises(InvalidArgumentError, match=pattern):
            engine.submit(prompt, NEW_TOKENS, prefix_kv=prefix_kv)
    assert not engine.has_work()
    evicting = Engine(model, KVArena("4MiB"), cache=CacheSpec(policy=H2O(), ratio=0.5))
    with pytest.raises(InvalidArgumentError, match="prefix_kv needs the lossless cache"):
        evicting.submit(ids, NEW_TOKENS, prefix_kv=(keys, values))
    assert not evicting.has_work()
    with pytest.raises(InvalidArgumentError, match="question=.* has no tokens"):
        fact_memory.prompt_kv(["f0"], "")


# --------------------------------------------------------------------------- any prefix K/V
def random_prefix_kv(model, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V for ``count`` tokens of every layer, [L, n, H_kv, D] each, drawn at random: the
    engine must use them as given, whatever they hold."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    shape = (config.num_hidden_layers, count, config.num_key_value_heads, 16)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    # (prompt tokens, of them given as K/V, new tokens) per request; None: no prefix K/V.
    requests_drawn=st.lists(
        st.tuples(st.integers(2, 40), st.one_of(st.none(), st.integers(1, 39)), st.integers(1, 30)),
        min_size=1,
        max_size=4,
    ),
    # The arena in 16-token pages of both layers: from one request's worth (preemption) up.
    pages=st.integers(4, 24),
    seed=st.integers(0, 1000),
)
def test_random_prefix_kv_traces_make_generates_tokens_and_leave_an_empty_arena(
    requests_drawn, pages, seed
):
    model = tiny_model()
    model.generation_config.eos_token_id = None  # the engine stops only at ids it is given
    page = 2 * 16 * 2 * 16 * 2 * 4  # 16 tokens x 2 layers x 2 KV heads x dim 16 x K, V x fp32
    arena = KVArena(pages * page)
    engine = Engine(model, arena, prefill_chunk=8, max_batch_tokens=24)
    submitted = []
    for index, (length, given_tokens, new_tokens) in enumerate(requests_drawn):
        gen = torch.Generator().manual_seed(seed + index)
        ids = torch.randint(1, 256, (length,), generator=gen).tolist()
        count = None if given_tokens is None else min(given_tokens, length - 1)
        kv = None if count is None else random_prefix_kv(model, count, seed + index)
        try:
            handle = engine.submit(ids, new_tokens, prefix_kv=kv)
        except InvalidArgumentError:  # too large for this arena even alone
            assert not engine.could_run_alone(length, new_tokens)
            continue
        submitted.append((handle, ids, kv, new_tokens))
    engine.run()
    for handle, ids, kv, new_tokens in submitted:
        assert handle.output_ids == generate_from(model, ids, kv, new_tokens)
    assert arena.bytes_used == 0
    arena.check_invariants()
