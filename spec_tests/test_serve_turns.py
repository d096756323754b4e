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
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.policies import H2O
from kvstack.serve import CacheSpec, Engine
from kvstack.tiers import CostAware, TailFirstLRU, TurnStore
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


def test_a_failed_kv_copy_finishes_its_request_and_the_rest_of_the_step_still_commits(
    model, monkeypatch
):
    # Request 0 finishes in a step that also decodes request 1, and copying its K/V out fails:
    # request 0 ends with its pages back, request 1 keeps that step's token, and runs on to
    # the tokens it makes alone.
    engine = serving(model)
    first = engine.submit(prompt(20, seed=30), 3, keep_kv=True)
    second = engine.submit(prompt(24, seed=31), 8)
    alone = serving(model)
    expected = alone.submit(prompt(24, seed=31), 8)
    alone.run()
    while len(first.output_ids) < 2:
        engine.step()

    def fail(request) -> None:
        raise MemoryError("host full")

    monkeypatch.setattr(engine, "_copy_kv_out", fail)
    produced_before = len(second.output_ids)
    with pytest.raises(MemoryError, match="host full"):
        engine.step()
    monkeypatch.undo()
    assert first.done and first.kept_kv is None and first not in engine.running
    assert len(second.output_ids) == produced_before + 1
    engine.run()
    assert second.output_ids == expected.output_ids
    assert engine.arena.bytes_used == 0


def test_keep_kv_on_an_evicting_cache_is_refused_and_changes_nothing(model):
    engine = Engine(model, KVArena(64 * BLOCK_BYTES), cache=CacheSpec(policy=H2O(), ratio=0.5))
    with pytest.raises(InvalidArgumentError, match="keep_kv needs the lossless cache"):
        engine.submit(prompt(20, seed=3), 4, keep_kv=True)
    assert not engine.has_work()


# --------------------------------------------------------------------------- TurnStore
PAGE = 16  # tokens per page of the store, the engine's block size


def page_bytes(model) -> int:
    """One TurnStore page of the tiny model: K and V of 2 layers x 16 tokens x 2 heads x 16."""
    return 2 * model.config.num_hidden_layers * PAGE * 2 * 16 * 4


def converse(model, turns, store: TurnStore | None, capacity_blocks: int = 64, after_turn=None):
    """Run ``turns`` ((conversation, new message ids, new tokens[, tokens of its history kept])
    in order) one at a time on one engine; with a store, each through ``TurnStore.submit`` /
    ``save_turn``, else with the whole prompt computed. A turn that keeps fewer tokens of its
    history rewrites it (a user who edits an earlier message). Returns each turn's outputs."""
    engine = serving(model, capacity_blocks * BLOCK_BYTES)
    history: dict[str, list[int]] = {}
    outputs = []
    for conversation, message, new_tokens, *kept in turns:
        ids = history.get(conversation, [])[: kept[0] if kept else None] + message
        if store is None:
            handle = engine.submit(ids, new_tokens)
        else:
            looked_up = store.stats.reused_tokens + store.stats.recomputed_tokens
            handle = store.submit(engine, conversation, ids, new_tokens)
            # What the lookup read back or recomputed is what the engine was handed.
            handed = 0 if handle.prefix_kv is None else handle.prefix_kv[0].shape[1]
            assert handed == store.stats.reused_tokens + store.stats.recomputed_tokens - looked_up
        engine.run()
        if store is not None:
            store.save_turn(conversation, handle)
            store.store.check()
            for name, held in store.conversations.items():  # every page it covers is known
                for index in range(len(held) // PAGE):
                    key = f"{name}.{index}"
                    assert key in store.store.pages or key in store.store.dropped, key
            assert store.bytes_held() <= store.store.capacity["host"] + store.store.capacity["disk"]
        history[conversation] = ids + handle.output_ids
        outputs.append(handle.output_ids)
        if after_turn is not None:
            after_turn(engine, handle)
    assert engine.arena.bytes_used == 0
    return outputs


def three_conversations(turns_each: int = 3) -> list[tuple[str, list[int], int]]:
    turns = []
    for turn in range(turns_each):
        for index, name in enumerate(("ann", "ben", "cy")):
            turns.append((name, prompt(9 + 5 * index + 3 * turn, seed=100 * index + turn), 12))
    return turns


def test_with_room_for_everything_every_turn_reuses_its_whole_history(model):
    store = TurnStore(model, host_bytes=64 * page_bytes(model))
    reused_before = []

    def check(engine, handle):
        reused_before.append(store.stats.reused_tokens)

    outputs = converse(model, three_conversations(), store, after_turn=check)
    assert outputs == converse(model, three_conversations(), None)
    assert store.stats.recomputed_tokens == store.stats.missed_tokens == 0
    assert not store.store.dropped
    # Each later turn read every whole page of its conversation so far.
    assert store.stats.reused_tokens > 0 and reused_before[3] > reused_before[2]


@pytest.mark.parametrize("rule", [TailFirstLRU(), CostAware()], ids=["lru", "cost"])
def test_a_small_budget_drops_pages_and_every_turn_still_makes_the_same_tokens(model, rule):
    store = TurnStore(model, host_bytes=5 * page_bytes(model), rule=rule)
    outputs = converse(model, three_conversations(4), store)
    assert outputs == converse(model, three_conversations(4), None)
    assert store.store.drops > 0
    assert store.stats.reused_tokens > 0
    if isinstance(rule, TailFirstLRU):  # a conversation's held pages stay a prefix: no holes
        assert store.stats.recomputed_tokens == 0


@settings(
    # Half the profile's examples (12 in CI): each runs every turn twice on the engine.
    max_examples=max(12, settings.default.max_examples // 2),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    turns=st.lists(
        st.tuples(
            st.sampled_from(["ann", "ben", "cy"]),
            st.integers(1, 40),  # new message tokens
            st.integers(1, 12),  # new tokens
            st.one_of(st.none(), st.integers(0, 60)),  # None: the whole history; else kept
            st.integers(0, 10_000),  # the message's seed
        ),
        min_size=3,  # a conversation back for a second turn, mostly
        max_size=8,
    ),
    host_pages=st.integers(1, 6),  # mostly fewer pages than the conversations hold: drops
    rule=st.sampled_from(["lru", "cost"]),
)
def test_random_turns_make_the_tokens_of_computing_every_prompt(model, turns, host_pages, rule):
    drawn = [
        (name, prompt(length, seed=seed), new, *([] if kept is None else [kept]))
        for name, length, new, kept, seed in turns
    ]
    chosen = TailFirstLRU() if rule == "lru" else CostAware()
    store = TurnStore(model, host_bytes=host_pages * page_bytes(model), rule=chosen)
    assert converse(model, drawn, store, capacity_blocks=128) == converse(
        model, drawn, None, capacity_blocks=128
    )
    stats = store.stats
    assert stats.lookups == len(drawn)
    event(f"reused: {stats.reused_tokens > 0}, holes: {stats.recomputed_tokens > 0}")
    rewritten = any(kept is not None for _, _, _, kept, _ in turns)
    event(f"pages dropped: {store.store.drops > 0}, history rewritten: {rewritten}")
    if rule == "lru":  # tail first: a conversation's held pages are always a prefix, no holes
        assert stats.recomputed_tokens == 0


def saved_turn(model, store: TurnStore) -> tuple[list[int], object]:
    """One turn of conversation "ann" (70 prompt tokens, 10 new) through ``store``: its prompt
    ids and handle. It computed 79 tokens: 4 whole pages are saved."""
    engine = serving(model)
    ids = prompt(70, seed=7)
    handle = store.submit(engine, "ann", ids, 10)
    engine.run()
    store.save_turn("ann", handle)
    return ids, handle


def test_a_hole_is_recomputed_to_the_kv_of_prefilling_its_tokens(model):
    store = TurnStore(model, host_bytes=64 * page_bytes(model))
    ids, handle = saved_turn(model, store)
    history = ids + handle.output_ids[:-1]  # 79 tokens computed: 4 whole pages
    for index in (0, 2):  # holes at the head and in the middle; page 3 is held
        store.store.drop(f"ann.{index}")
    following = ids + handle.output_ids + prompt(5, seed=8)
    keys, values = store.prefix_kv("ann", following)
    expected_keys, expected_values = prefill_kv(model, history[: 4 * PAGE])
    torch.testing.assert_close(keys, expected_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    assert store.stats.recomputed_tokens == 2 * PAGE
    assert store.stats.reused_tokens == 2 * PAGE


def test_dropped_tail_pages_are_left_to_the_engine(model):
    store = TurnStore(model, host_bytes=64 * page_bytes(model))
    ids, handle = saved_turn(model, store)
    for index in (2, 3):
        store.store.drop(f"ann.{index}")
    keys, _ = store.prefix_kv("ann", ids + handle.output_ids + [5])
    assert keys.shape[1] == 2 * PAGE
    assert store.stats.missed_tokens == 2 * PAGE and store.stats.recomputed_tokens == 0
    store.store.drop("ann.0")
    store.store.drop("ann.1")
    assert store.prefix_kv("ann", ids + handle.output_ids + [5]) is None


def test_lru_keeps_a_conversations_head_across_its_turns(model):
    # One conversation, 3 turns of 30-token messages and 12 new tokens, 3 pages of room: the
    # turn's lookup reads the old pages before its save writes the new ones, yet all are the
    # turn's, so LRU drops the tail and the next turn recomputes nothing.
    store = TurnStore(model, host_bytes=3 * page_bytes(model), rule=TailFirstLRU())
    turns = [("ann", prompt(30, seed=40 + turn), 12) for turn in range(3)]
    assert converse(model, turns, store) == converse(model, turns, None)
    assert store.store.drops > 0
    assert store.stats.recomputed_tokens == 0
    assert sorted(store.store.pages) == ["ann.0", "ann.1", "ann.2"]


def test_the_rules_drop_the_tail_first_lru_and_the_head_first_cost_aware(model):
    engine = serving(model)
    handles = [engine.submit(prompt(80, seed=9 + i), 4, keep_kv=True) for i in range(2)]
    engine.run()  # each kept 83 tokens: 5 whole pages
    dropped = {}
    for name, rule in (("lru", TailFirstLRU()), ("cost", CostAware())):
        store = TurnStore(model, host_bytes=8 * page_bytes(model), rule=rule)
        store.save_turn("ann", handles[0])
        store.save_turn("ben", handles[1])  # 2 of the 10 pages must go
        dropped[name] = sorted(store.store.dropped)
    assert dropped["lru"] == ["ann.3", "ann.4"]  # the older conversation, its tail first
    assert dropped["cost"] == ["ann.0", "ann.1"]  # the earliest positions: cheapest to recompute


def test_cost_aware_prices_each_drop_alone_across_conversations(model):
    """A third drop: ann.2 (idle, reuse probability 0.5) or ben.1 (just written, 1). Priced as
    one sequence's recompute span (``CostAware.rank_drops``), ben.1 would cost nothing, since
    ann.0 and ann.1 span its positions already; but ben's hole is recomputed on its own, at its
    own tokens' cost, so the store prices every page alone and drops ann.2."""
    engine = serving(model)
    handles = [engine.submit(prompt(80, seed=9 + i), 4, keep_kv=True) for i in range(2)]
    engine.run()  # each kept 83 tokens: 5 whole pages
    store = TurnStore(model, host_bytes=7 * page_bytes(model), rule=CostAware())
    store.save_turn("ann", handles[0])
    store.save_turn("ben", handles[1])  # 3 of the 10 pages must go
    assert sorted(store.store.dropped) == ["ann.0", "ann.1", "ann.2"]


@pytest.mark.parametrize("damage", ["flipped byte", "file deleted"])
def test_a_corrupt_or_missing_disk_page_is_dropped_and_recomputed(model, tmp_path, damage):
    store = TurnStore(
        model,
        host_bytes=page_bytes(model),
        disk_path=tmp_path,
        disk_bytes=64 * page_bytes(model),
        rule=TailFirstLRU(),
    )
    ids, handle = saved_turn(model, store)
    on_disk = [key for key, info in store.store.pages.items() if info.home == "disk"]
    assert on_disk
    victim = next(tmp_path.glob(f"{sorted(on_disk)[0]}*"))
    if damage == "file deleted":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    following = ids + handle.output_ids + prompt(5, seed=8)
    keys, values = store.prefix_kv("ann", following)
    # The damaged page lies before a held one (the store writes the tail first, so the head's
    # pages went to disk): it is a hole, recomputed, and all 4 pages come back.
    assert keys.shape[1] == 4 * PAGE and store.stats.recomputed_tokens == PAGE
    expected_keys, expected_values = prefill_kv(model, (ids + handle.output_ids)[: 4 * PAGE])
    torch.testing.assert_close(keys, expected_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)
    assert sorted(on_disk)[0] in store.store.dropped


def next_turn(model, store: TurnStore, ids: list[int], handle) -> object:
    """Conversation "ann"'s next turn after ``saved_turn``, run on a new engine: its handle."""
    engine = serving(model)
    following = store.submit(engine, "ann", ids + handle.output_ids + prompt(40, seed=3), 6)
    engine.run()
    return following


def save_failing(store: TurnStore, handle, monkeypatch, fails) -> None:
    """``save_turn("ann", handle)`` with the store's page writes failing (ENOSPC) where
    ``fails(key, writes so far)`` says; the writes work again after."""
    put = store.store.put
    calls = []

    def failing_put(key, page, **kwargs):
        calls.append(key)
        if fails(key, len(calls)):
            raise OSError(28, "No space left on device")
        return put(key, page, **kwargs)

    monkeypatch.setattr(store.store, "put", failing_put)
    with pytest.raises(OSError, match="No space left"):
        store.save_turn("ann", handle)
    monkeypatch.setattr(store.store, "put", put)


def test_a_save_that_fails_keeps_what_the_conversation_held_before(model, monkeypatch):
    store = TurnStore(model, host_bytes=64 * page_bytes(model))
    ids, handle = saved_turn(model, store)
    held = (list(store.conversations["ann"]), sorted(store.store.pages))
    following = next_turn(model, store, ids, handle)
    # The second new page fails: the first is written already.
    save_failing(store, following, monkeypatch, lambda key, calls: calls == 2)
    assert (store.conversations["ann"], sorted(store.store.pages)) == held
    store.store.check()
    store.save_turn("ann", following)  # and the next save works
    assert len(store.store.pages) > len(held[1])


def test_a_failed_save_leaves_the_pages_it_had_dropped_dropped_not_lost(model, monkeypatch):
    """The save rewrites dropped pages ann.2 (written) and ann.1 (its write fails): both are
    dropped again, as before the save, and the next lookup recomputes them."""
    store = TurnStore(model, host_bytes=64 * page_bytes(model))
    ids, handle = saved_turn(model, store)
    store.store.drop("ann.1")
    store.store.drop("ann.2")
    held = (list(store.conversations["ann"]), sorted(store.store.pages))
    following = next_turn(model, store, ids, handle)
    # ann.1 is written after the new pages and ann.2: the save is tail first.
    save_failing(store, following, monkeypatch, lambda key, calls: key == "ann.1")
    assert (store.conversations["ann"], sorted(store.store.pages)) == held
    assert sorted(store.store.dropped) == ["ann.1", "ann.2"]
    store.store.check()
    history = ids + handle.output_ids[:-1]  # what the store holds: 4 pages
    keys, values = store.prefix_kv("ann", history + prompt(5, seed=8))
    expected_keys, expected_values = prefill_kv(model, history[: 4 * PAGE])
    assert keys.shape[1] == 4 * PAGE
    torch.testing.assert_close(keys, expected_keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values, expected_values, rtol=1e-5, atol=1e-5)


def test_bad_turn_store_input_is_refused_and_changes_nothing(model, tmp_path):
    store = TurnStore(model, host_bytes=8 * page_bytes(model))
    engine = serving(model)
    handle = engine.submit(prompt(40, seed=1), 4, keep_kv=True)
    plain = engine.submit(prompt(20, seed=2), 4)
    engine.run()
    store.save_turn("ann", handle)
    store.store.drop("ann.1")

    def state():
        return (
            {name: list(ids) for name, ids in store.conversations.items()},
            set(store.store.pages),
            set(store.store.dropped),
            store.bytes_held(),
            store.store.clock,
            vars(store.stats).copy(),
        )

    before = state()
    keys, values = handle.kept_kv
    computed = handle.prompt_ids + handle.output_ids[:-1]
    diverged = computed[:20] + [(t + 1) % 256 for t in computed[20:]]
    with pytest.raises(InvalidArgumentError, match="expected \\(keys, values\\)"):
        store.save("ann", diverged, (keys.double(), values.double()))  # before ann's pages go
    with pytest.raises(InvalidArgumentError, match=r"kv is .*expected \(keys, values\)"):
        store.save("ben", computed[:-1], handle.kept_kv)  # one token id short
    with pytest.raises(InvalidArgumentError, match="expected \\(keys, values\\)"):
        store.save("ben", computed, (keys.double(), values.double()))
    with pytest.raises(InvalidArgumentError, match="conversation=''"):
        store.save("", computed, handle.kept_kv)
    with pytest.raises(InvalidArgumentError, match="not usable as a file name"):
        store.prefix_kv("a/b", computed)
    with pytest.raises(InvalidArgumentError, match="kept no K/V"):
        store.save_turn("ben", plain)
    # A turn the engine would refuse is refused before the store reads ann's pages (a read
    # would bring the dropped page back by recomputing it and count hits).
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        store.submit(engine, "ann", computed + [5], 0)
    with pytest.raises(InvalidArgumentError, match="input_ids holds token id"):
        store.submit(engine, "ann", computed + [10**6], 4)
    with pytest.raises(InvalidArgumentError, match="sampling must be"):
        store.submit(engine, "ann", computed + [5], 4, sampling="greedy")
    assert state() == before and not engine.has_work()
    with pytest.raises(InvalidArgumentError, match="cannot hold one page"):
        TurnStore(model, host_bytes=page_bytes(model) - 1)
    with pytest.raises(InvalidArgumentError, match="cannot hold one page file"):
        TurnStore(
            model, host_bytes=page_bytes(model), disk_path=tmp_path, disk_bytes=page_bytes(model)
        )
    with pytest.raises(InvalidArgumentError, match="keep_kv=1; expected a bool"):
        engine.submit(prompt(20, seed=3), 4, keep_kv=1)
    assert not engine.has_work()
