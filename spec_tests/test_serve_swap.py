"""Swap instead of recompute: a preempted request's pages move to a host tier and back, its
output does not change, nothing is computed twice, and the batch rules order resident and
swapped work as they say.

Tiny random Llama models (fp32, CPU) on the reference attention, as in test_serve_engine.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstack.arena import KVArena
from kvstack.errors import InvalidArgumentError
from kvstack.policies import H2O
from kvstack.serve import (
    CacheSpec,
    Engine,
    FIFORule,
    Outlook,
    PageAwareRule,
    RoundRobinRule,
    Work,
)
from kvstack.serve.request import Request, RequestStats, Sampling
from spec_tests.test_serve_engine import (
    BLOCK_BYTES,
    PREFILL_CHUNK,
    TINY,
    count_paged_attention,
    drive,
    prompt,
    solo,
)
from spec_tests.tiny import tiny_serving_llama

pytestmark = pytest.mark.usefixtures("reference_attention")

# One page of the stacked store: a block of every layer (2 layers of the tiny model).
PAGE_BYTES = TINY["num_hidden_layers"] * BLOCK_BYTES
RULES = {"page_aware": PageAwareRule, "fifo": FIFORule, "round_robin": RoundRobinRule}
SHORT_WAIT = 4  # a fairness bound the tiny traces reach


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama(max_position_embeddings=1024)  # test_serve_engine's model


def swapping_engine(model, capacity: int, swap_bytes, **kwargs) -> Engine:
    kwargs.setdefault("max_batch_tokens", 48)
    kwargs.setdefault("prefill_chunk", PREFILL_CHUNK)
    return Engine(model, KVArena(capacity), cache=CacheSpec(), swap_bytes=swap_bytes, **kwargs)


def run_until_a_swap(model):
    """Four requests that outgrow a 20-block arena, stepped until one is swapped out: the
    engine, the (ids, new tokens) requests and their handles."""
    requests = [(prompt(12 + i, seed=10 + i), 40) for i in range(4)]
    serving = swapping_engine(model, 20 * BLOCK_BYTES, "1MiB")
    handles = [serving.submit(ids, n) for ids, n in requests]
    while not serving.swap.stats.swaps_out:
        serving.step()
    return serving, requests, handles


def count_computed_tokens(engine: Engine) -> list[int]:
    """Wrap the engine's forward: the list gets the tokens each step feeds the model."""
    fed: list[int] = []
    forward = engine._forward

    def counting(batch):
        fed.append(sum(work.tokens for work in batch))
        return forward(batch)

    engine._forward = counting
    return fed


def test_a_tight_arena_swaps_instead_of_recomputing_and_outputs_do_not_change(model):
    # Short prompts, long outputs: admitted together, they outgrow the arena mid-decode (the
    # trace of test_serve_engine's recompute test).
    requests = [(prompt(12 + i, seed=10 + i), 40) for i in range(4)]
    expected = [solo(model, "paged", ids, n) for ids, n in requests]
    serving = swapping_engine(model, 20 * BLOCK_BYTES, "1MiB")
    fed = count_computed_tokens(serving)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    stats = serving.swap.stats
    assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out
    assert stats.bytes_in == stats.bytes_out > 0 and stats.refused_out == 0
    assert serving.preemptions == stats.swaps_out
    assert [h.output_ids for h in handles] == expected
    # Every token went through the model once: its prompt, then each output but the last.
    assert sum(fed) == sum(len(ids) + n - 1 for ids, n in requests)
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0
    serving.arena.check_invariants()
    serving.swap.arena.check_invariants()


def test_a_host_tier_too_small_falls_back_to_recomputing(model):
    requests = [(prompt(12 + i, seed=10 + i), 40) for i in range(4)]
    serving = swapping_engine(model, 20 * BLOCK_BYTES, PAGE_BYTES)  # holds one page
    fed = count_computed_tokens(serving)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert serving.swap.stats.refused_out > 0
    assert [h.output_ids for h in handles] == [solo(model, "paged", i, n) for i, n in requests]
    assert sum(fed) > sum(len(ids) + n - 1 for ids, n in requests)  # some were recomputed
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0


def test_a_swapped_request_is_offered_as_not_resident_with_its_bytes(model):
    serving, _, handles = run_until_a_swap(model)
    swapped = [h for h in handles if h.swapped is not None]
    assert swapped and all(h in serving.running and h.cache is None for h in swapped)
    assert "swapped" in repr(swapped[0])
    work = serving._offer(swapped[0])
    pages = -(-swapped[0].computed // 16)
    assert not work.resident and work.fetch_bytes == pages * PAGE_BYTES
    # Cancelling it returns its host pages.
    held = serving.swap.bytes_used
    assert serving.cancel(swapped[0])
    assert serving.swap.bytes_used == held - pages * PAGE_BYTES
    serving.run()
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0


def test_an_error_mid_step_keeps_swapped_pages_and_recomputes_the_rest(model, monkeypatch):
    serving, requests, handles = run_until_a_swap(model)
    swapped = [h for h in handles if h.swapped is not None]
    held = serving.swap.bytes_used
    assert swapped and held

    def fail(call: int) -> None:
        if call == 2:  # the step's second attention call: layer 0 is written, layer 1 not
            raise RuntimeError("injected")

    count_paged_attention(monkeypatch, fail)
    with pytest.raises(RuntimeError, match="injected"):
        serving.step()
    monkeypatch.undo()
    # The swapped requests kept their host pages (a step that failed did not touch them unless
    # it swapped them in); every request the step ran gave its pages back to recompute.
    assert all(h.swapped is not None or h in serving.waiting for h in swapped)
    assert serving.swap.bytes_used == sum(h.swapped.nbytes for h in swapped if h.swapped)
    assert all(r.cache is None for r in serving.waiting)
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, "paged", i, n) for i, n in requests]
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    rule=st.sampled_from([*sorted(RULES), "page_aware_short_wait"]),
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(16, 60)), min_size=2, max_size=5),
    arrivals=st.lists(st.integers(0, 4), min_size=5, max_size=5),
    tightness=st.sampled_from([0.2, 0.35, 0.5, 0.7]),
    swap_pages=st.sampled_from([1, 4, 64]),  # host tier: too small for most, some, all
    max_batch_tokens=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 1000),
)
def test_random_traces_with_swapping_finish_with_solo_tokens_and_empty_tiers(
    model, rule, lengths, arrivals, tightness, swap_pages, max_batch_tokens, seed
):
    longest = sum(-(-(p + n) // 16) * TINY["num_hidden_layers"] for p, n in lengths)  # blocks
    capacity = max(4, round(tightness * longest)) * BLOCK_BYTES
    serving = swapping_engine(
        model,
        capacity,
        swap_pages * PAGE_BYTES,
        max_batch_tokens=max_batch_tokens,
        rule=PageAwareRule(SHORT_WAIT) if rule == "page_aware_short_wait" else RULES[rule](),
    )
    requests = [(prompt(p, seed + i), n) for i, (p, n) in enumerate(lengths)]

    def check_tiers() -> None:
        # Nothing swapped holds arena pages; the host holds exactly the swapped requests' pages.
        swapped = [r for r in serving.running if r.swapped is not None]
        assert all(r.cache is None for r in swapped)
        assert serving.swap.bytes_used == sum(r.swapped.nbytes for r in swapped)
        if rule == "page_aware_short_wait":
            # The fairness bound: past SHORT_WAIT steps without running a request goes first;
            # several overdue at once go one a step at worst, at most one per request.
            for request in serving.running:
                since = max(request.last_scheduled_step, request.admitted_at_step)
                assert serving._step - since <= SHORT_WAIT + len(lengths) + 1

    fed = count_computed_tokens(serving)
    handles = drive(serving, requests, arrivals, check_tiers)
    if not serving.swap.stats.refused_out:  # every preemption swapped: nothing recomputed
        assert sum(fed) == sum(len(ids) + n - 1 for _, ids, n in handles)
    for handle, ids, n in handles:
        assert handle.output_ids == solo(model, "paged", ids, n)
    stats = serving.swap.stats
    assert stats.swaps_in == stats.swaps_out and stats.bytes_in == stats.bytes_out
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0
    serving.arena.check_invariants()
    serving.swap.arena.check_invariants()


def test_the_page_aware_rule_fetches_no_more_than_fifo_or_round_robin(model):
    # All at once on a tight arena: FIFO brings the oldest swapped request back by pushing the
    # newest out; round robin brings back whoever ran least recently; the page-aware rule waits
    # for room. The same outputs, fewer bytes.
    requests = [(prompt(10 + 3 * i, seed=30 + i), 40 + 4 * i) for i in range(6)]
    fetched = {}
    for name, rule in RULES.items():
        serving = swapping_engine(model, 24 * BLOCK_BYTES, "1MiB", rule=rule())
        handles = [serving.submit(ids, n) for ids, n in requests]
        serving.run()
        assert [h.output_ids for h in handles] == [solo(model, "paged", i, n) for i, n in requests]
        fetched[name] = serving.swap.stats.bytes_in
    assert fetched["fifo"] > 0 and fetched["round_robin"] > 0
    assert fetched["page_aware"] <= fetched["fifo"]
    assert fetched["page_aware"] < fetched["round_robin"]


class _WithoutLookahead(PageAwareRule):
    """The page-aware rule as it was before its look-ahead: every swapped request may come back
    once its pages fit, and the victim is the request holding the fewest bytes."""

    def may_swap_in(self, work, outlook, step):
        return True

    def choose_victim(self, candidates, outlook):
        return min(
            candidates, key=lambda request: (request.cache.stats()["bytes_used"], -request.id)
        )


def test_looking_ahead_fetches_fewer_bytes_over_seeded_traces(model):
    # Requests arriving over the first steps on arenas a quarter to half their KV, a seeded
    # sample: what goes out with the look-ahead comes back less often. (Not every trace: a
    # forecast that a newcomer upsets can cost a move; the sum over the sample is the claim.)
    rng = random.Random(0)
    fetched = {"page_aware": 0, "without_lookahead": 0, "fifo": 0}
    rules = {"page_aware": PageAwareRule, "without_lookahead": _WithoutLookahead, "fifo": FIFORule}
    for trial in range(8):
        count = rng.randint(3, 7)
        lengths = [(rng.randint(1, 40), rng.randint(16, 80)) for _ in range(count)]
        arrivals = sorted(rng.randint(0, 12) for _ in range(count))
        longest = sum(-(-(p + n) // 16) * TINY["num_hidden_layers"] for p, n in lengths)
        alone = max(-(-(p + n) // 16) * TINY["num_hidden_layers"] for p, n in lengths) + 2
        capacity = max(alone, round(rng.choice([0.25, 0.35, 0.5]) * longest)) * BLOCK_BYTES
        requests = [(prompt(p, 100 * trial + i), n) for i, (p, n) in enumerate(lengths)]
        for name, rule in rules.items():
            serving = swapping_engine(model, capacity, "4MiB", rule=rule(), max_batch_tokens=32)
            handles = drive(serving, requests, arrivals)
            if name == "page_aware":  # (the random-trace test checks every rule's tokens)
                for handle, ids, n in handles:
                    assert handle.output_ids == solo(model, "paged", ids, n)
            fetched[name] += serving.swap.stats.bytes_in
    assert fetched["page_aware"] < fetched["without_lookahead"]
    assert fetched["page_aware"] < fetched["fifo"]


def test_swapped_work_the_rule_holds_back_waits_unless_nothing_else_can_run(model):
    class NeverBack(PageAwareRule):
        def may_swap_in(self, work, outlook, step):
            return False

    requests = [(prompt(10 + 3 * i, seed=30 + i), 40 + 4 * i) for i in range(6)]
    serving = swapping_engine(model, 24 * BLOCK_BYTES, "1MiB", rule=NeverBack())
    choose = serving._choose_batch

    def checking_choose():
        batch = choose()
        if any(not work.resident for work in batch):  # held back until none is resident
            assert all(request.cache is None for request in serving.running)
        return batch

    serving._choose_batch = checking_choose
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, "paged", i, n) for i, n in requests]
    stats = serving.swap.stats
    assert stats.swaps_in == stats.swaps_out > 0
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0


def test_a_swap_in_whose_copy_fails_changes_nothing(model, monkeypatch):
    serving, requests, handles = run_until_a_swap(model)
    swapped = next(h for h in handles if h.swapped is not None)
    # Room for its pages: the others run on (nothing comes back meanwhile) until enough is free.
    monkeypatch.setattr(serving.rule, "may_swap_in", lambda work, outlook, step: False)
    while serving.arena.bytes_free < swapped.swapped.nbytes:
        serving.step()
    assert swapped.swapped is not None
    used, held = serving.arena.bytes_used, serving.swap.bytes_used

    def failing_copy(*args, **kwargs):
        raise RuntimeError("injected copy failure")

    # The swap-in's first page copy fails: its new pages go back, the host copy stays.
    swap_in = serving.swap.swap_in

    def swap_in_failing(source, store):
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "copy_", failing_copy)
            swap_in(source, store)

    monkeypatch.setattr(serving.swap, "swap_in", swap_in_failing)
    with pytest.raises(RuntimeError, match="injected copy failure"):
        serving._swap_in(swapped)
    assert swapped.swapped is not None and swapped.cache is None
    assert serving.arena.bytes_used == used and serving.swap.bytes_used == held
    monkeypatch.undo()
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, "paged", i, n) for i, n in requests]
    assert serving.arena.bytes_used == 0 and serving.swap.bytes_used == 0


def test_swapping_into_a_store_that_holds_tokens_is_refused_and_changes_nothing(model):
    serving, _, handles = run_until_a_swap(model)
    swapped = next(h for h in handles if h.swapped is not None)
    occupied = next(h for h in handles if h.cache is not None and h.cache.tokens)
    used, held = serving.arena.bytes_used, serving.swap.bytes_used
    with pytest.raises(InvalidArgumentError, match="store must be empty"):
        serving.swap.swap_in(swapped.swapped, occupied.cache)
    assert serving.arena.bytes_used == used and serving.swap.bytes_used == held
    assert swapped.swapped.nbytes and occupied.cache.tokens


def test_a_rule_that_names_a_victim_it_was_not_offered_is_refused(model):
    class Wrong(PageAwareRule):
        def choose_victim(self, candidates, outlook):
            return _work(99, 0).request

    serving = swapping_engine(model, 20 * BLOCK_BYTES, "1MiB", rule=Wrong())
    for i in range(4):
        serving.submit(prompt(12 + i, seed=10 + i), 40)
    with pytest.raises(InvalidArgumentError, match="choose_victim returned"):
        serving.run()


# ----------------------------------------------------------------- the rules, alone


def _work(request_id: int, last_step: int, resident: bool = True, fetch: int = 0) -> Work:
    request = Request(
        id=request_id,
        prompt_ids=[1],
        max_new_tokens=1,
        stop_ids=frozenset(),
        sampling=Sampling(),
        stats=RequestStats(submitted_at=0.0),
        last_scheduled_step=last_step,
    )
    return Work(request, 1, "decode", resident=resident, fetch_bytes=fetch)


def test_page_aware_takes_resident_work_then_the_fewest_bytes_then_the_overdue_first():
    rule = PageAwareRule(max_wait=5)
    resident_new, resident_old = _work(0, 9), _work(1, 8)
    big, small = _work(2, 7, False, 4096), _work(3, 9, False, 1024)
    order = rule.order([big, resident_new, small, resident_old], step=10)
    assert [w.request.id for w in order] == [1, 0, 3, 2]
    # Past max_wait steps without running, the swapped one goes first, wherever its pages are.
    overdue = _work(4, 3, False, 8192)
    order = rule.order([resident_new, overdue, small], step=10)
    assert [w.request.id for w in order] == [4, 0, 3]


class _Holding:
    """A stand-in cache that holds ``bytes_used`` arena bytes."""

    def __init__(self, bytes_used: int) -> None:
        self.bytes_used = bytes_used

    def stats(self) -> dict[str, float]:
        return {"bytes_used": self.bytes_used}


def _request(
    request_id: int, prompt: int, new: int, outputs: int = 0, computed: int = 0, held: int = 0
) -> Request:
    """A request of ``prompt`` tokens and ``new`` new ones, ``outputs`` of them made, its first
    ``computed`` tokens in ``held`` bytes of the arena."""
    request = Request(
        id=request_id,
        prompt_ids=[1] * prompt,
        max_new_tokens=new,
        stop_ids=frozenset(),
        sampling=Sampling(),
        stats=RequestStats(submitted_at=0.0),
        output_ids=[2] * outputs,
        computed=computed,
    )
    request.cache = _Holding(held)
    return request


def _outlook(capacity_pages: int, *resident: Request) -> Outlook:
    return Outlook(capacity_pages, block_size=4, prefill_chunk=8, resident=resident)


def test_the_outlook_counts_steps_to_finish_and_pages_held_meanwhile():
    outlook = _outlook(100)
    fresh = _request(0, prompt=20, new=5)
    # Prompt in chunks of 8 (3 steps, the last makes output 1), then 4 decode steps.
    assert outlook.steps_to_finish(fresh) == 7
    assert [outlook.pages_after(fresh, s) for s in range(9)] == [0, 2, 4, 5, 6, 6, 6, 6, 6]
    # Decoding: 18 fed, output 3 of 5 made; 2 more steps feed 2 tokens, the last never fed.
    decoding = _request(1, prompt=16, new=5, outputs=3, computed=18)
    assert outlook.steps_to_finish(decoding) == 2
    assert [outlook.pages_after(decoding, s) for s in range(4)] == [5, 5, 5, 5]
    # Preempted and recomputing: its prompt and 3 outputs are fed again, a chunk a step.
    recomputing = _request(2, prompt=16, new=5, outputs=3, computed=0)
    assert outlook.steps_to_finish(recomputing) == 3 + 1
    assert outlook.pages_after(recomputing, 1) == 2 and outlook.pages_after(recomputing, 4) == 5


def test_the_outlook_fits_requests_until_the_first_of_them_finishes():
    a = _request(0, prompt=8, new=10, outputs=1, computed=8)  # 9 steps left, 17 tokens at end
    b = _request(1, prompt=8, new=3, outputs=1, computed=8)  # 2 steps left: 10 tokens then
    # After 2 steps: a holds 10 tokens (3 pages), b 10 (3 pages).
    assert _outlook(6, a, b).fits_until_a_finish([a, b])
    assert not _outlook(5, a, b).fits_until_a_finish([a, b])
    assert _outlook(5, a).fits_until_a_finish([a])  # a alone: 17 tokens, 5 pages
    assert _outlook(0).fits_until_a_finish([])


def test_page_aware_swaps_out_the_smallest_request_whose_leaving_is_enough():
    # Three resident requests on 12 pages of 4 tokens. The next to finish is c, in 4 steps;
    # by then a holds 28 tokens (7 pages), b 20 (5), c 8 (2): 14 pages, 2 too many.
    a = _request(0, prompt=24, new=20, outputs=1, computed=24, held=4096)
    b = _request(1, prompt=16, new=20, outputs=1, computed=16, held=2048)
    c = _request(2, prompt=4, new=5, outputs=1, computed=4, held=1024)
    outlook = _outlook(12, a, b, c)
    # c holds the fewest bytes but its leaving is not enough (a and b then grow until b
    # finishes, past 12 pages); b's is, and so is a's: b holds fewer.
    assert not outlook.fits_until_a_finish([a, b])
    assert outlook.fits_until_a_finish([a, c]) and outlook.fits_until_a_finish([b, c])
    assert PageAwareRule().choose_victim([a, b, c], outlook) is b
    # Where none is enough alone, the one holding the most goes: the fewest moves.
    assert PageAwareRule().choose_victim([a, b, c], _outlook(6, a, b, c)) is a
    # An admitted request that has computed nothing holds nothing: it goes first, back to
    # the queue.
    d = _request(3, prompt=4, new=2, held=0)
    assert PageAwareRule().choose_victim([a, b, c, d], _outlook(40, a, b, c, d)) is d


def test_page_aware_brings_a_swapped_request_back_only_when_the_room_lasts():
    resident = _request(0, prompt=8, new=30, outputs=1, computed=8, held=2048)
    swapped = _request(1, prompt=8, new=20, outputs=4, computed=11)
    swapped.cache = None
    work = Work(swapped, 1, "decode", resident=False, fetch_bytes=3 * 1024)
    rule = PageAwareRule(max_wait=5)
    # Until the swapped request finishes (16 steps): resident 24 tokens (6 pages), swapped
    # 27 (7 pages).
    assert rule.may_swap_in(work, _outlook(13, resident), step=3)
    assert not rule.may_swap_in(work, _outlook(12, resident), step=3)
    # Past max_wait steps without running, it comes back wherever the room lasts.
    swapped.last_scheduled_step = 1
    assert not rule.may_swap_in(work, _outlook(12, resident), step=6)
    assert rule.may_swap_in(work, _outlook(12, resident), step=7)


def test_fifo_and_round_robin_ignore_where_pages_are():
    works = [_work(2, 4), _work(0, 9, False, 4096), _work(1, 2, False, 64)]
    assert [w.request.id for w in FIFORule().order(works, 10)] == [0, 1, 2]
    assert [w.request.id for w in RoundRobinRule().order(works, 10)] == [1, 2, 0]


def test_without_swapped_work_page_aware_orders_by_last_step_as_before():
    works = [_work(i, last, True) for i, last in enumerate([5, -1, 3, 40, 3])]
    for step in (10, 41, 100):
        order = PageAwareRule(max_wait=4).order(works, step)
        assert [w.request.id for w in order] == [1, 2, 4, 0, 3]


# ----------------------------------------------------------------- bad input


def test_swap_is_refused_where_a_request_cannot_be_swapped(model):
    with pytest.raises(InvalidArgumentError, match="swap_bytes needs the lossless cache"):
        Engine(
            model,
            KVArena(64 * BLOCK_BYTES),
            cache=CacheSpec(policy=H2O(), ratio=0.5),
            swap_bytes="1MiB",
        )
    with pytest.raises(InvalidArgumentError, match="swap_bytes='lots' is not a byte count"):
        Engine(model, KVArena(64 * BLOCK_BYTES), swap_bytes="lots")
    with pytest.raises(InvalidArgumentError, match="max_wait"):
        PageAwareRule(max_wait=0)
