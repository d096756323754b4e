"""The serving engine: many requests on one fixed arena give each request its solo tokens.

Random tiny Llama models (fp32, CPU) on the reference attention backend (the specification,
and no compile time). Solo runs: lossless requests against ``DynamicCache`` under ``generate``,
evicting ones against ``generate`` with the same kvstack cache alone.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvstack.arena import KVArena
from kvstack.calibrate import HeadProfile, model_identity
from kvstack.errors import InvalidArgumentError
from kvstack.hf import HeadwiseCache, TokenTableCache
from kvstack.models import TINY_HYBRIDS, tiny_hybrid_config
from kvstack.policies import H2O, SnapKV
from kvstack.serve import CacheSpec, Engine, Sampling
from spec_tests.tiny import TINY_LLAMA, tiny_serving_llama

TINY = {**TINY_LLAMA, "max_position_embeddings": 1024}
BLOCK_BYTES = (
    16 * 2 * 16 * 2 * 4
)  # a whole-row block: 16 tokens x 2 KV heads x dim 16 x K, V x fp32
PREFILL_CHUNK = 16
# Per-head budgets for the tiny model's 2 layers x 2 KV heads (as a calibration would write).
HEADWISE_BUDGETS = ((0.3, 0.8), (0.6, 0.2))
TINY_PROFILE = HeadProfile(
    budgets=HEADWISE_BUDGETS,
    mean=HEADWISE_BUDGETS,
    std=((0.0, 0.0), (0.0, 0.0)),
    ratio=0.5,
    alpha=2.0,
    model=model_identity(LlamaConfig(**TINY)),
    calibration={},
)
SPECS = {
    "paged": CacheSpec(),
    "h2o": CacheSpec(policy=H2O(), ratio=0.5),
    "snapkv": CacheSpec(policy=SnapKV(window=4, kernel_size=3), budget=12),
    "h2o_naive": CacheSpec(policy=H2O(), ratio=0.5, reclaim=False),
    "headwise": CacheSpec(policy=SnapKV(window=4, kernel_size=3), profile=TINY_PROFILE),
}


# The specification attention, FutureWarnings silenced (spec_tests/conftest.py).
pytestmark = pytest.mark.usefixtures("reference_attention")


@pytest.fixture(scope="module")
def model():
    return tiny_serving_llama(max_position_embeddings=1024)


def prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (length,), generator=gen).tolist()


_SOLO: dict = {}


def solo(
    model, spec_name: str, ids: list[int], new_tokens: int, prefill_chunk: int = PREFILL_CHUNK
) -> list[int]:
    """The request's tokens run alone through ``generate`` (memoised: hypothesis repeats them)."""
    key = (id(model), spec_name, tuple(ids), new_tokens, prefill_chunk)
    if key not in _SOLO:
        spec = SPECS[spec_name]
        if spec.headwise:
            model.set_attn_implementation("kvstack")
            cache = HeadwiseCache(
                model.config, spec.profile, policy=spec.policy, prefill_chunk=prefill_chunk
            )
        elif spec.evicting:
            model.set_attn_implementation("kvstack")
            cache = TokenTableCache(
                model.config,
                policy=spec.policy,
                budget=spec.budget,
                ratio=spec.ratio,
                reclaim=spec.reclaim,
                prefill_chunk=prefill_chunk,
            )
        else:
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                past_key_values=cache,
                do_sample=False,
                max_new_tokens=new_tokens,
                pad_token_id=0,
            )
        _SOLO[key] = out[0, len(ids) :].tolist()
    return _SOLO[key]


def engine(model, spec_name: str, capacity: int, **kwargs) -> Engine:
    kwargs.setdefault("max_batch_tokens", 48)
    kwargs.setdefault("prefill_chunk", PREFILL_CHUNK)
    return Engine(model, KVArena(capacity), cache=SPECS[spec_name], **kwargs)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_every_request_gets_its_solo_tokens_and_the_arena_ends_empty(model, spec_name):
    requests = [(prompt(9 + 11 * i, seed=i), 6 + i) for i in range(5)]
    expected = [solo(model, spec_name, ids, n) for ids, n in requests]
    serving = engine(model, spec_name, 64 * BLOCK_BYTES)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert [h.output_ids for h in handles] == expected
    assert all(h.finish_reason == "length" and h.stats.tokens == len(h.output_ids) for h in handles)
    assert serving.arena.bytes_used == 0
    serving.arena.check_invariants()


def test_a_step_batches_decodes_and_prefill_of_several_requests(model):
    serving = engine(model, "paged", 64 * BLOCK_BYTES)
    first = serving.submit(prompt(10, 1), 8)
    serving.step()  # first's whole prompt, and its first token
    second = serving.submit(prompt(30, 2), 8)
    produced = serving.step()  # first decodes while second prefills its first chunk
    assert [request for request, _ in produced] == [first]
    assert second.computed == PREFILL_CHUNK and first.computed == 11
    serving.run()
    assert first.output_ids == solo(model, "paged", prompt(10, 1), 8)
    assert second.output_ids == solo(model, "paged", prompt(30, 2), 8)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_a_long_prompt_is_prefilled_over_steps_while_others_decode(model, spec_name):
    """Every cache kind takes a prompt a chunk per step (an evicting cache fixed its budgets
    from the whole prompt: ``expect_prompt``), so a long prompt does not stall the requests
    decoding beside it, and each request still gets its solo tokens."""
    serving = engine(model, spec_name, 64 * BLOCK_BYTES)
    short = serving.submit(prompt(10, 1), 12)
    serving.step()  # short's whole prompt, and its first token
    long = serving.submit(prompt(5 * PREFILL_CHUNK, 2), 4)
    steps = 0
    while long.computed < 5 * PREFILL_CHUNK:
        produced = serving.step()
        steps += 1
        assert long.computed == steps * PREFILL_CHUNK  # whole chunks, one per step
        assert [request for request, _ in produced][:1] == [short]  # short decodes meanwhile
    assert steps == 5
    serving.run()
    assert short.output_ids == solo(model, spec_name, prompt(10, 1), 12)
    assert long.output_ids == solo(model, spec_name, prompt(5 * PREFILL_CHUNK, 2), 4)
    assert serving.arena.bytes_used == 0


@pytest.mark.parametrize("spec_name", ["paged", "h2o_naive", "headwise"])
def test_a_tight_arena_preempts_the_newest_and_outputs_do_not_change(model, spec_name):
    # Short prompts, long outputs: admitted together, the requests outgrow the arena mid-decode.
    # (Caches whose blocks never shrink; an evicting cache that reclaims is admitted with its
    # whole steady size, so it never outgrows its admission.)
    requests = [(prompt(12 + i, seed=10 + i), 40) for i in range(4)]
    expected = [solo(model, spec_name, ids, n) for ids, n in requests]
    capacity = 20 * BLOCK_BYTES
    serving = engine(model, spec_name, capacity)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert serving.preemptions > 0
    assert sum(h.stats.preemptions for h in handles) == serving.preemptions
    assert [h.output_ids for h in handles] == expected
    assert serving.arena.bytes_used == 0


@pytest.mark.parametrize("spec_name", ["h2o", "snapkv"])
def test_evicting_prefills_over_steps_fit_their_admission_bytes(model, spec_name):
    """A reclaiming cache is admitted with its tables at their budget plus one layer's chunk
    in flight. Each chunk of its prefill evicts layer by layer, so a later chunk needs no more
    than that: on an arena that holds exactly two admissions, two long prompts prefill a chunk
    per step side by side and nobody is preempted (a step bound of a chunk in every layer,
    eight layers of chunks of four blocks here, preempted the newest)."""
    torch.manual_seed(0)
    deep = LlamaForCausalLM(LlamaConfig(**{**TINY, "num_hidden_layers": 8})).eval()
    deep.generation_config.eos_token_id = None
    chunk = 64  # 4 blocks per table: more than a table's slack below its budget
    requests = [(prompt(6 * chunk, seed=20 + i), 6) for i in range(3)]
    expected = [solo(deep, spec_name, ids, n, prefill_chunk=chunk) for ids, n in requests]
    probe = engine(deep, spec_name, 64 * BLOCK_BYTES, max_batch_tokens=chunk, prefill_chunk=chunk)
    admission = max(probe.admission_bytes(len(ids)) for ids, _ in requests)
    serving = engine(
        deep, spec_name, 2 * admission, max_batch_tokens=2 * chunk, prefill_chunk=chunk
    )
    handles = [serving.submit(ids, n) for ids, n in requests]
    most_running = steps = 0
    while serving.has_work() and steps < 100:  # a preempted pair could retry forever
        serving.step()
        steps += 1
        most_running = max(most_running, len(serving.running))
    assert serving.preemptions == 0
    assert most_running == 2
    assert [h.output_ids for h in handles] == expected
    assert serving.arena.bytes_used == 0


def count_paged_attention(monkeypatch, on_call=None) -> list[int]:
    """Count (and record the rows of) every attention call over tables from now on
    (``paged_attention``, and ``ragged_decode_attention``, which head-wise decodes run);
    ``on_call`` (the call's number) runs before each."""
    from kvstack import ops

    calls: list[int] = []
    real_get = ops.get

    def get(name, backend=None, **where):
        attention = real_get(name, backend, **where)
        if name not in ("paged_attention", "ragged_decode_attention"):
            return attention

        @functools.wraps(attention)  # keeps what the kernel says of itself (skips_padding)
        def counted(*args, **kwargs):
            calls.append(args[0].shape[0])
            if on_call is not None:
                on_call(len(calls))
            return attention(*args, **kwargs)

        return counted

    monkeypatch.setattr(ops, "get", get)
    return calls


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_a_decode_step_attends_every_request_in_one_call_per_layer(model, spec_name, monkeypatch):
    import kvstack.serve.attention as serve_attention

    requests = [(prompt(20 + 7 * i, 60 + i), 6) for i in range(3)]
    serving = engine(model, spec_name, 64 * BLOCK_BYTES, max_batch_tokens=64)
    handles = [serving.submit(ids, n) for ids, n in requests]
    while not all(h.output_ids for h in handles):  # every prompt in
        serving.step()
    alone = []
    real_alone = serve_attention.kvstack_attention

    def single(*args, **kwargs):
        alone.append(1)
        return real_alone(*args, **kwargs)

    calls = count_paged_attention(monkeypatch)
    monkeypatch.setattr(serve_attention, "kvstack_attention", single)
    serving.step()
    # One call per layer for the three decode tokens (their rows, or their rows' pieces).
    assert len(calls) == TINY["num_hidden_layers"] and min(calls) >= 3 and not alone
    monkeypatch.undo()
    serving.run()
    # Ragged tables (prompts of 20, 27 and 34 tokens) in one call give each its solo tokens.
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]


@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_decode_rows_split_into_pieces_give_each_request_its_solo_tokens(
    model, spec_name, monkeypatch
):
    # Pieces of 8 keys, split whenever the layers allow it (those observing weights never do):
    # ragged tables of 20 to 40 tokens become 3 to 5 pieces each, merged by log-sum-exp.
    import kvstack.serve.attention as serve_attention

    monkeypatch.setattr(serve_attention, "DECODE_PIECE", 8)
    monkeypatch.setattr(serve_attention, "MIN_PIECE_SAVING", 0.0)
    split = []
    real_merge = serve_attention.merge_pieces

    def counted(*args, **kwargs):
        split.append(1)
        return real_merge(*args, **kwargs)

    monkeypatch.setattr(serve_attention, "merge_pieces", counted)
    requests = [(prompt(20 + 7 * i, 80 + i), 6) for i in range(3)]
    serving = engine(model, spec_name, 64 * BLOCK_BYTES, max_batch_tokens=64)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]
    # H2O and SnapKV observe the weights of every decode step: their rows stay whole. A
    # head-wise cache's decodes run the ragged attention, split by its profile's work list.
    spec = SPECS[spec_name]
    assert bool(split) is (not spec.evicting)


@pytest.mark.parametrize("spec_name", ["paged", "h2o"])
def test_a_prefilled_request_keeps_only_its_decode_headroom(model, spec_name):
    # Once its prompt is in, a running request is promised one block per table of decode
    # headroom (lossless), or its tables at their budget (evicting): no more. The next request
    # is admitted exactly when the arena holds that and its own admission bytes.
    probe = engine(model, spec_name, 64 * BLOCK_BYTES)
    first_ids, second_ids = prompt(40, 1), prompt(40, 2)
    if spec_name == "paged":
        # The first request's 40 prompt tokens and its first output, and 16 tokens of
        # headroom: 4 blocks per layer.
        kept = probe.geometry.bytes_for(41 + 16)
    else:
        # Its admission bytes less the one layer's prefill chunk in flight (one block per
        # table: the chunk is 16 tokens), which it no longer needs.
        one_chunk = probe.geometry.tables * probe.geometry.block_bytes
        kept = probe.admission_bytes(len(first_ids)) - one_chunk
    capacity = kept + probe.admission_bytes(len(second_ids))
    for arena_bytes, admitted in ((capacity, True), (capacity - 1, False)):
        serving = engine(model, spec_name, arena_bytes)
        first = serving.submit(first_ids, 8)
        serving.step()
        serving.step()  # lossless: its prompt takes three 16-token chunks
        serving.step()
        assert first.output_ids  # prefilled, decoding
        second = serving.submit(second_ids, 8)
        serving.step()
        assert (second in serving.running) is admitted
        serving.run()
        assert first.output_ids == solo(model, spec_name, first_ids, 8)
        assert second.output_ids == solo(model, spec_name, second_ids, 8)
        assert serving.arena.bytes_used == 0


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@settings(
    max_examples=6,  # per cache kind
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(16, 60)), min_size=2, max_size=5),
    arrivals=st.lists(st.integers(0, 4), min_size=5, max_size=5),
    # The arena between the largest request alone (0) and all of them at once at their
    # longest (1): below 1 they cannot all run together (preemption; at 0 about one runs at a
    # time). Below 0, less than the largest alone: it is refused at submit.
    # (Tightest first: hypothesis leans on the first value.)
    tightness=st.sampled_from([0.0, 0.15, 0.35, 0.6, 1.0, -0.25]),
    max_batch_tokens=st.sampled_from([16, 32, 64]),
    seed=st.integers(0, 1000),
)
def test_random_traces_finish_with_solo_tokens_and_an_empty_arena(
    model, spec_name, lengths, arrivals, tightness, max_batch_tokens, seed
):
    longest = sum(-(-(p + n) // 16) * TINY["num_hidden_layers"] for p, n in lengths)  # blocks
    probe = engine(model, spec_name, 2 * longest * BLOCK_BYTES)  # its needs, not its arena
    needs = [max(probe.admission_bytes(p), probe.lifetime_bytes(p, n)) for p, n in lengths]
    largest, together = max(needs), sum(needs)
    if tightness < 0:
        wanted = (1 + tightness) * largest
    else:
        wanted = largest + tightness * (together - largest)
    capacity = max(4, math.ceil(wanted / BLOCK_BYTES)) * BLOCK_BYTES
    serving = engine(model, spec_name, capacity, max_batch_tokens=max_batch_tokens)
    requests = [(prompt(p, seed + i), n) for i, (p, n) in enumerate(lengths)]
    handles = drive(serving, requests, arrivals, max_steps=2000)
    for handle, ids, n in handles:
        assert handle.output_ids == solo(model, spec_name, ids, n)
    assert serving.arena.bytes_used == 0
    serving.arena.check_invariants()
    event(f"served {'none' if not handles else 'all' if len(handles) == len(lengths) else 'some'}")
    event(f"preempted: {serving.preemptions > 0}")


def drive(serving, requests, arrivals, after_step=None, max_steps: int = 3000) -> list:
    """Submit each (ids, new tokens) request at its arrival step and step until all are done;
    ``after_step()`` runs after every step. A request too large for the arena even alone must
    be refused at ``submit``, by the documented rule. Returns (handle, ids, n) of the others."""
    handles, pending = [], list(zip(arrivals, requests, strict=False))
    step = 0
    while pending or serving.has_work():
        for _, (ids, n) in [item for item in pending if item[0] <= step]:
            try:
                handles.append((serving.submit(ids, n), ids, n))
            except InvalidArgumentError:
                need = max(serving.admission_bytes(len(ids)), serving.lifetime_bytes(len(ids), n))
                assert need > serving.arena.capacity_bytes
        pending = [item for item in pending if item[0] > step]
        serving.step()
        if after_step is not None:
            after_step()
        step += 1
        assert step < max_steps, "the engine made no progress"
    return handles


def test_stream_yields_every_token_in_order(model):
    serving = engine(model, "h2o", 64 * BLOCK_BYTES)
    handles = [serving.submit(prompt(15 + 5 * i, i), 5) for i in range(3)]
    seen = {h.id: [] for h in handles}
    for request, tokens in serving.stream():
        seen[request.id] += tokens
    assert [seen[h.id] for h in handles] == [h.output_ids for h in handles]


def test_stop_ids_end_a_request_with_the_stop_token(model):
    ids = prompt(20, 3)
    tokens = solo(model, "paged", ids, 10)
    serving = engine(model, "paged", 64 * BLOCK_BYTES)
    handle = serving.submit(ids, 10, eos_token_id=tokens[3])
    serving.run()
    assert handle.output_ids == tokens[: tokens.index(tokens[3]) + 1]
    assert handle.finish_reason == "stop"


def test_seeded_sampling_does_not_depend_on_batching_or_preemption(model):
    sampling = Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    ids = prompt(12, 4)
    alone = engine(model, "paged", 64 * BLOCK_BYTES)
    reference = alone.submit(ids, 30, sampling=sampling)
    alone.run()
    crowded = engine(model, "paged", 16 * BLOCK_BYTES)
    others = [crowded.submit(prompt(12 + i, 20 + i), 30) for i in range(2)]
    handle = crowded.submit(ids, 30, sampling=sampling)
    crowded.run()
    assert crowded.preemptions > 0 and handle.stats.preemptions > 0
    assert handle.output_ids == reference.output_ids
    assert all(o.done for o in others)
    other_seed = engine(model, "paged", 64 * BLOCK_BYTES)
    differs = other_seed.submit(
        ids, 30, sampling=Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=8)
    )
    other_seed.run()
    assert differs.output_ids != reference.output_ids


def test_stats_time_and_count_each_request(model):
    serving = engine(model, "paged", 64 * BLOCK_BYTES)
    handle = serving.submit(prompt(40, 5), 6)
    serving.run()
    stats = handle.stats
    assert stats.tokens == 6 and stats.preemptions == 0
    assert 0 < stats.ttft_s and 0 < stats.tpot_s
    # 40 prompt tokens + 5 decoded ones in the cache: 3 blocks per layer, 2 layers.
    assert stats.peak_pages == 6 and stats.peak_bytes == 6 * BLOCK_BYTES


# ----------------------------------------------------------------- bad input


def test_a_prompt_that_could_never_fit_is_refused_and_nothing_changes(model):
    serving = engine(model, "paged", 8 * BLOCK_BYTES)
    kept = serving.submit(prompt(10, 1), 4)
    with pytest.raises(InvalidArgumentError, match="could never run"):
        serving.submit(prompt(100, 2), 4)
    assert serving.waiting == (kept,) and serving.running == ()
    serving.run()
    assert kept.output_ids == solo(model, "paged", prompt(10, 1), 4)


def test_cancel_returns_the_pages(model):
    # Room for one request: the second waits (FIFO) until the first is done or cancelled.
    serving = engine(model, "paged", 8 * BLOCK_BYTES)
    running = serving.submit(prompt(30, 1), 20)
    waiting = serving.submit(prompt(30, 2), 20)
    serving.step()
    assert serving.running == (running,) and serving.waiting == (waiting,)
    assert serving.arena.bytes_used > 0
    assert serving.cancel(waiting) and waiting.finish_reason == "cancelled"
    assert serving.cancel(running) and running.finish_reason == "cancelled"
    assert serving.arena.bytes_used == 0 and not serving.has_work()
    assert not serving.cancel(running)  # already finished


@pytest.mark.parametrize("spec_name", ["paged", "h2o"])
def test_an_error_mid_step_leaves_no_half_written_cache(model, spec_name, monkeypatch):
    requests = [(prompt(20 + i, 50 + i), 8) for i in range(3)]
    serving = engine(model, spec_name, 64 * BLOCK_BYTES)
    handles = [serving.submit(ids, n) for ids, n in requests]
    while not all(h.output_ids for h in handles):  # every prompt in: the next step decodes
        serving.step()  # all three in one call a layer

    def fail(call: int) -> None:
        if call == 2:  # layer 1: layer 0 stored and attended all three
            raise RuntimeError("injected")

    count_paged_attention(monkeypatch, fail)
    with pytest.raises(RuntimeError, match="injected"):
        serving.step()
    monkeypatch.undo()
    # Every request of the failed step gave its pages back and waits to recompute.
    assert serving.running == () and serving.arena.bytes_used == 0
    assert [r.id for r in serving.waiting] == [h.id for h in handles]
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, spec_name, i, n) for i, n in requests]


class _FailingSampling(Sampling):
    """Greedy, but the ``fail_at``-th token it draws raises (once)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        object.__setattr__(self, "fail_at", fail_at)

    def next_token(self, logits: torch.Tensor, index: int) -> int:
        if index == self.fail_at:
            object.__setattr__(self, "fail_at", -1)
            raise RuntimeError("sampling failed")
        return super().next_token(logits, index)


def test_a_sampling_error_leaves_no_request_half_advanced(model):
    # The second request's sampling fails at its third token, in a step that decodes all three:
    # the first request, sampled before it, must not have taken that step's token, nor the
    # third kept K/V it never counted.
    requests = [(prompt(20 + i, 60 + i), 8) for i in range(3)]
    serving = engine(model, "paged", 64 * BLOCK_BYTES)
    handles = [
        serving.submit(ids, n, sampling=_FailingSampling(2) if i == 1 else None)
        for i, (ids, n) in enumerate(requests)
    ]
    while len(handles[1].output_ids) < 2:
        serving.step()
    assert all(len(h.output_ids) == 2 for h in handles)  # the next step decodes all three
    with pytest.raises(RuntimeError, match="sampling failed"):
        serving.step()
    assert all(len(h.output_ids) == 2 for h in handles)
    assert serving.running == () and serving.arena.bytes_used == 0
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, "paged", i, n) for i, n in requests]
    assert serving.arena.bytes_used == 0


def test_a_lone_request_that_cannot_fit_a_shared_arena_raises_instead_of_spinning(model):
    from kvstack.errors import ArenaExhausted

    class Other:  # another user of the arena (a fact memory, another engine)
        def pages_moved(self, moves) -> None:
            pass

    arena = KVArena(8 * BLOCK_BYTES)
    held = arena.allocate(Other(), "kv", 7 * BLOCK_BYTES // arena.itemsize)
    serving = Engine(model, arena, max_batch_tokens=64, prefill_chunk=PREFILL_CHUNK)
    # Alone it fits the arena; its first chunk (a block in each of 2 layers) does not fit the
    # one free block.
    handle = serving.submit(prompt(30, 1), 4)
    with pytest.raises(ArenaExhausted, match="request 0 needs .*another user of the arena"):
        serving.step()
    assert serving.waiting == (handle,) and serving.running == ()
    assert arena.bytes_used == 7 * BLOCK_BYTES  # only the other user's
    arena.free(held)
    serving.run()
    assert handle.output_ids == solo(model, "paged", prompt(30, 1), 4)


def test_a_bad_headwise_spec_is_refused_and_the_arena_untouched(model):
    from kvstack.calibrate import ProfileError
    from kvstack.policies import StreamingLLM

    for extra in ({"budget": 8}, {"ratio": 0.5}, {"reclaim": False}):
        with pytest.raises(InvalidArgumentError, match="a profile gives every head"):
            CacheSpec(profile=TINY_PROFILE, **extra)
    with pytest.raises(InvalidArgumentError, match="HeadProfile.*got dict"):
        CacheSpec(profile={"budgets": HEADWISE_BUDGETS})
    arena = KVArena(64 * BLOCK_BYTES)
    deeper = LlamaConfig(**{**TINY, "num_hidden_layers": 3})
    other = HeadProfile(
        budgets=((0.5, 0.5),) * 3,
        mean=((0.5, 0.5),) * 3,
        std=((0.0, 0.0),) * 3,
        ratio=0.5,
        alpha=2.0,
        model=model_identity(deeper),
        calibration={},
    )
    with pytest.raises(ProfileError, match="num_hidden_layers=3.*this model has.*=2"):
        Engine(model, arena, cache=CacheSpec(profile=other))
    with pytest.raises(InvalidArgumentError, match="per-head.*StreamingLLM"):
        Engine(model, arena, cache=CacheSpec(policy=StreamingLLM(), profile=TINY_PROFILE))
    assert arena.bytes_used == 0 and not arena.pages


def test_bad_arguments_are_refused(model):
    with pytest.raises(InvalidArgumentError, match="dtype"):
        Engine(model, KVArena(64 * BLOCK_BYTES, dtype=torch.float16))
    with pytest.raises(InvalidArgumentError, match="fixed capacity"):
        Engine(model, KVArena.private())
    with pytest.raises(InvalidArgumentError, match="prefill_chunk"):
        Engine(model, KVArena(64 * BLOCK_BYTES), max_batch_tokens=8, prefill_chunk=16)
    with pytest.raises(InvalidArgumentError, match="budget"):
        Engine(model, KVArena(64 * BLOCK_BYTES), cache=CacheSpec(policy=H2O(), budget=0))
    with pytest.raises(InvalidArgumentError, match="exactly one"):
        Engine(model, KVArena(64 * BLOCK_BYTES), cache=CacheSpec(policy=H2O(), budget=8, ratio=0.5))
    with pytest.raises(InvalidArgumentError, match="give a policy"):
        CacheSpec(ratio=0.5)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        Sampling(temperature=-1.0)
    serving = engine(model, "paged", 64 * BLOCK_BYTES)
    for bad in ([], [1.5], [-1], [256], torch.zeros(2, 3, dtype=torch.long), "hello"):
        with pytest.raises(InvalidArgumentError, match="input_ids"):
            serving.submit(bad, 4)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens"):
        serving.submit([1, 2], 0)
    for bad in (2.0, "2", [2, 2.5]):
        with pytest.raises(InvalidArgumentError, match="eos_token_id must be token ids"):
            serving.submit([1, 2], 4, eos_token_id=bad)
    with pytest.raises(InvalidArgumentError, match="request=5; expected a handle"):
        serving.cancel(5)
    assert not serving.has_work()
    with pytest.raises(InvalidArgumentError, match="rule=5; expected a batch rule"):
        Engine(model, KVArena(64 * BLOCK_BYTES), rule=5)
    for bad, match in ((0, "swap_bytes=0"), ("lots", "swap_bytes='lots'"), (-1, "swap_bytes")):
        with pytest.raises(InvalidArgumentError, match=match):
            Engine(model, KVArena(64 * BLOCK_BYTES), swap_bytes=bad)


@pytest.mark.parametrize("name", TINY_HYBRIDS)
@pytest.mark.parametrize("spec_name", ["paged", "h2o"])
def test_hybrid_models_serve_each_request_its_solo_tokens(name, spec_name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(tiny_hybrid_config(name)).eval()
    hybrid.generation_config.eos_token_id = None
    requests = [(prompt(8 + 9 * i, seed=30 + i, vocab=120), 6 + 2 * i) for i in range(3)]
    expected = []
    for ids, n in requests:
        if SPECS[spec_name].evicting:
            hybrid.set_attn_implementation("kvstack")
            spec = SPECS[spec_name]
            cache = TokenTableCache(
                hybrid.config, policy=spec.policy, ratio=spec.ratio, prefill_chunk=16
            )
        else:
            hybrid.set_attn_implementation("eager")
            cache = DynamicCache(config=hybrid.config)
        with torch.inference_mode():
            out = hybrid.generate(
                torch.tensor([ids]), past_key_values=cache, do_sample=False, max_new_tokens=n
            )
        expected.append(out[0, len(ids) :].tolist())
    serving = Engine(
        hybrid, KVArena("4MiB"), cache=SPECS[spec_name], max_batch_tokens=48, prefill_chunk=16
    )
    assert serving.hybrid
    decode_batches = []
    forward_decodes = serving._forward_decodes

    def counted(requests):
        decode_batches.append(len(requests))
        return forward_decodes(requests)

    serving._forward_decodes = counted
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert [h.output_ids for h in handles] == expected
    assert serving.arena.bytes_used == 0
    # Decode tokens of the three requests share one forward pass (their states gathered into
    # one batch), except on FalconH1, whose layers are attention and state at once.
    assert (max(decode_batches, default=0) == 3) is (name != "falcon_h1")


def dynamic_cache_tokens(hybrid, requests) -> list[list[int]]:
    """Each request's greedy tokens alone under ``generate`` with ``DynamicCache``."""
    hybrid.set_attn_implementation("eager")
    expected = []
    for ids, n in requests:
        with torch.inference_mode():
            out = hybrid.generate(
                torch.tensor([ids]),
                past_key_values=DynamicCache(config=hybrid.config),
                do_sample=False,
                max_new_tokens=n,
            )
        expected.append(out[0, len(ids) :].tolist())
    return expected


def _tiny_hybrid(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(tiny_hybrid_config(name)).eval()
    hybrid.generation_config.eos_token_id = None
    return hybrid


def test_a_hybrid_on_a_tight_arena_is_preempted_and_keeps_its_tokens():
    hybrid = _tiny_hybrid("jamba")
    requests = [(prompt(8 + 3 * i, seed=40 + i, vocab=120), 40) for i in range(4)]
    expected = dynamic_cache_tokens(hybrid, requests)
    serving = Engine(hybrid, KVArena("96KiB"), max_batch_tokens=48, prefill_chunk=16)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert serving.preemptions > 0 and serving.state_bytes > 0
    assert [h.output_ids for h in handles] == expected
    assert serving.arena.bytes_used == 0


def test_an_evicting_hybrid_preempted_on_a_tight_arena_keeps_its_solo_tokens():
    # An evicting request replays its outputs after a preemption, one decode step each; in a
    # batched decode (several requests' rows in one forward pass) those replay rows must not
    # be sampled.
    hybrid = _tiny_hybrid("jamba")
    spec = CacheSpec(policy=H2O(), ratio=0.5, reclaim=False)
    requests = [(prompt(8 + 3 * i, seed=40 + i, vocab=120), 40) for i in range(4)]
    solo = []
    for ids, new_tokens in requests:
        alone = Engine(hybrid, KVArena("4MiB"), cache=spec, max_batch_tokens=48, prefill_chunk=16)
        handle = alone.submit(ids, new_tokens)
        alone.run()
        solo.append(handle.output_ids)
    serving = Engine(hybrid, KVArena("96KiB"), cache=spec, max_batch_tokens=48, prefill_chunk=16)
    handles = [serving.submit(ids, n) for ids, n in requests]
    serving.run()
    assert serving.preemptions > 0
    assert [h.output_ids for h in handles] == solo
    assert serving.arena.bytes_used == 0


# ----------------------------------------------------------------- layouts (hybrid models)


@pytest.mark.parametrize("name", ["jamba", "qwen3_next"])
def test_state_bytes_from_the_config_are_what_a_request_holds(name):
    hybrid = _tiny_hybrid(name)
    serving = Engine(hybrid, KVArena("1MiB"), max_batch_tokens=48, prefill_chunk=16)
    predicted = serving.state_bytes
    handle = serving.submit(prompt(10, 1, vocab=120), 2)
    serving.step()
    assert predicted > 0 and handle.cache.stats()["bytes_used_state"] == predicted


@pytest.mark.parametrize("layout", ["kvstack", "padded_unified", "fixed_dual"])
def test_every_layout_serves_hybrid_requests_their_solo_tokens(layout):
    from kvstack.reference import arena_layouts
    from kvstack.serve.layouts import hybrid_geometry

    hybrid = _tiny_hybrid("jamba")
    requests = [(prompt(6 + 5 * i, seed=70 + i, vocab=120), 12) for i in range(4)]
    expected = dynamic_cache_tokens(hybrid, requests)
    # Tight: fixed_dual's state pool then holds two requests' states, and every layout waits or
    # preempts.
    capacity = 56 * 1024
    serving = Engine(
        hybrid, KVArena(capacity), max_batch_tokens=48, prefill_chunk=16, layout=layout
    )
    geometry = hybrid_geometry(hybrid.config, 4)
    block = {
        "kvstack": 16,
        "padded_unified": arena_layouts.vllm_attention_block_size(geometry),
        "fixed_dual": 1,
    }[layout]
    assert serving.spec.block_size == block
    handles = [serving.submit(ids, n) for ids, n in requests]
    most_running = 0
    while serving.has_work():
        serving.step()
        most_running = max(most_running, len(serving.running))
        states = sum(r.cache.stats()["bytes_used_state"] for r in serving.running)
        if layout == "fixed_dual":  # the state pool never lends to the KV pool, nor back
            assert states <= serving.layout.state_pool_bytes
            assert sum(r.cache.stats()["bytes_used"] for r in serving.running) - states <= (
                serving.layout.kv_pool_bytes
            )
    assert [h.output_ids for h in handles] == expected
    assert serving.arena.bytes_used == 0
    assert most_running < len(requests)
    if layout == "fixed_dual":
        assert arena_layouts.sglang_pool_split(capacity, geometry).state_slots == 2
        assert most_running == 2


def test_padded_unified_charges_every_state_page_one_attention_block():
    from kvstack.reference import arena_layouts
    from kvstack.serve.layouts import hybrid_geometry

    hybrid = _tiny_hybrid("qwen3_next")
    geometry = hybrid_geometry(hybrid.config, 4)
    padded = Engine(hybrid, KVArena("4MiB"), layout="padded_unified")
    exact = Engine(hybrid, KVArena("4MiB"))
    block = arena_layouts.vllm_attention_block_size(geometry)
    page = arena_layouts.vllm_page_bytes(geometry)
    # 40 prompt tokens and 16 of decode headroom: two 32-token blocks per attention layer (a
    # headroom in tokens, not a whole extra enlarged block); each state layer's page padded to
    # one attention-layer block.
    assert block == 32
    assert (
        padded.admission_bytes(40)
        == geometry.attention_layers * 2 * block * (geometry.kv_token_bytes)
        + geometry.state_layers * page
    )
    # kvstack: four 16-token blocks for the 56 tokens, exact state pages.
    assert (
        exact.admission_bytes(40)
        == geometry.attention_layers * 4 * 16 * (geometry.kv_token_bytes)
        + geometry.state_bytes_per_sequence
    )


def test_a_layout_of_a_hybrid_system_is_refused_for_a_model_without_states(model):
    with pytest.raises(InvalidArgumentError, match="layout 'fixed_dual'"):
        Engine(model, KVArena("1MiB"), layout="fixed_dual")
    with pytest.raises(InvalidArgumentError, match="layout must be one of"):
        Engine(model, KVArena("1MiB"), layout="unified")


def test_headwise_decodes_of_several_requests_run_one_ragged_call_per_layer(model, monkeypatch):
    """The head-wise requests of a step share their profile's plan for each layer: one ragged
    decode attention call per layer takes all of them, with that plan's work list."""
    from kvstack import ops
    from kvstack.head_groups import group_heads, plan_ahead_of_time, work_list

    op = ops.operations()["ragged_decode_attention"]
    calls = []
    for backend, implementation in list(op.implementations.items()):

        def spy(*args, _run=implementation, **kwargs):
            calls.append((args[0].shape[0], args[5], args[6]))  # rows, members, work
            return _run(*args, **kwargs)

        monkeypatch.setitem(op.implementations, backend, spy)
    requests = [(prompt(20 + 7 * i, 90 + i), 6) for i in range(3)]
    serving = engine(model, "headwise", 64 * BLOCK_BYTES, max_batch_tokens=64)
    handles = [serving.submit(ids, n) for ids, n in requests]
    while not all(h.output_ids for h in handles):  # every prompt in
        serving.step()
    calls.clear()
    serving.step()
    assert [rows for rows, _, _ in calls] == [3] * TINY["num_hidden_layers"]
    groups = group_heads(TINY_PROFILE.budgets, 1, "sorted")
    plan = plan_ahead_of_time(groups, torch.get_num_threads())  # the CPU's workers
    for row, (_, members, work) in enumerate(calls):
        assert members.tolist() == [list(group.heads) for group in groups[row]]
        assert work.tolist() == [list(split) for split in work_list(plan[row])]
    serving.run()
    assert [h.output_ids for h in handles] == [solo(model, "headwise", i, n) for i, n in requests]


def test_a_headwise_request_is_admitted_with_its_compressed_prompt_not_its_whole_prompt(model):
    """Tangram's budget reservation: a head-wise request is admitted with each head's table at
    its budget (and the decode token it appends before it would evict), one prefill chunk in
    flight and decode headroom, so there is no compress-then-reclaim pass; a lossless request
    of the same prompt needs every token's blocks."""
    serving = engine(model, "headwise", 64 * BLOCK_BYTES)
    cache = serving._probe  # a HeadwiseCache on the engine's arena
    head_block = BLOCK_BYTES // 2  # one KV head's 16 tokens
    prompt_tokens = 300
    steady = sum(
        -(-(cache.head_budget(layer.layer_idx, head, prompt_tokens) + 1) // 16)
        for layer in cache.paged_layers
        for head in range(2)
    )
    in_flight = 2 * -(-PREFILL_CHUNK // 16)  # one layer's chunk, in both heads' tables
    headroom = 2 * 2 * 1  # 16 more tokens: one block per layer and head
    assert serving.admission_bytes(prompt_tokens) == (steady + in_flight + headroom) * head_block
    lossless = engine(model, "paged", 64 * BLOCK_BYTES).admission_bytes(prompt_tokens)
    assert serving.admission_bytes(prompt_tokens) < 0.7 * lossless
    # Its decode tokens are all kept: its lifetime grows with its outputs.
    assert (
        serving.lifetime_bytes(prompt_tokens, 64)
        == serving.admission_bytes(prompt_tokens) + 2 * 2 * 4 * head_block
    )
