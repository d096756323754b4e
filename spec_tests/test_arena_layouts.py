"""The hybrid-model layouts of ``reference/arena_layouts.py`` and the shipped length distribution.

* the state-shape formulas against the tensors transformers' ``DynamicCache`` really holds after
  a forward of a random tiny Jamba, NemotronH and Qwen3-Next;
* the checkpoint geometries (and vLLM's 528-token Qwen3.5 block) by hand;
* each layout's accounting on a case small enough to compute by hand;
* a stateful test: admit / step against a plain model of who runs, finishes and is preempted,
  with L1 (refused admission changes nothing), L2 (units held = ceil(tokens / block)) and
  L3 (no padding where there should be none) after every step;
* whole traces: every arena empty at the end, kvstack fitting at least as many sequences;
* ``kvstack.workloads``: published means, bounds, scaling, seeds, bad inputs.
"""

from __future__ import annotations

import math
import statistics
import warnings
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvstack.errors import InvalidArgumentError
from kvstack.reference import arena_layouts as L
from kvstack.reference.arena_layouts import (
    FixedDualLayout,
    HybridGeometry,
    KVStackLayout,
    PaddedUnifiedLayout,
)
from kvstack.workloads import TraceRequest, draw_trace, load_length_distribution

# A geometry small enough to count by hand: 16 bytes of K/V per token and layer, a 40-byte state
# page (conv 4 x 3 + recurrent 2 x 4 elements, 2 bytes each) in each of 3 state layers.
TINY = HybridGeometry(
    name="tiny",
    attention_layers=2,
    num_kv_heads=1,
    head_dim=4,
    kv_dtype_bytes=2,
    state_layers=3,
    conv_channels=4,
    conv_kernel=4,
    conv_window=3,
    recurrent_shape=(2, 4),
    conv_dtype_bytes=2,
    recurrent_dtype_bytes=2,
)


@dataclass(eq=False)
class Req:
    prompt_tokens: int
    output_tokens: int
    arrival_step: int = 0


# --------------------------------------------------------------------------- formulas vs HF
def _tiny_configs():
    from transformers import JambaConfig, NemotronHConfig, Qwen3NextConfig

    # Distinct sizes everywhere, so a swapped or missing factor changes a shape.
    return {
        "jamba": JambaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=8,
            mamba_d_conv=3, mamba_expand=3, vocab_size=100,
        ),
        "nemotron_h": NemotronHConfig(
            hidden_size=32,
            layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=6,
            mamba_head_dim=4, n_groups=2, ssm_state_size=8, conv_kernel=3, intermediate_size=64,
            vocab_size=100, n_routed_experts=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
        ),
        "qwen3_next": Qwen3NextConfig(
            hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
            linear_value_head_dim=10, linear_conv_kernel_dim=3, intermediate_size=64,
            moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
            num_experts_per_tok=1, vocab_size=100,
        ),
    }  # fmt: skip


def _state_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    conv, recurrent = getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)
    if conv is None or recurrent is None:
        return None
    return conv[0], recurrent[0]


@pytest.mark.parametrize("model", ["jamba", "nemotron_h", "qwen3_next"])
def test_state_shape_formulas_match_dynamic_cache(model):
    from transformers import AutoModelForCausalLM, DynamicCache

    config = _tiny_configs()[model]
    geometry = L.geometry_from_config(config, name=model)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config).eval()
    cache = DynamicCache(config=config)
    batch, length = 2, 7
    with torch.no_grad(), warnings.catch_warnings():
        # 5.24 renames past_key_values to cache= (FutureWarning); 5.17 knows only the old name
        warnings.simplefilter("ignore", FutureWarning)
        net(torch.randint(0, 100, (batch, length)), past_key_values=cache, use_cache=True)
    conv_shape, recurrent_shape = geometry.transformers_state_shapes()
    attention = states = 0
    for layer in cache.layers:
        found = _state_tensors(layer)
        if found is not None:
            states += 1
            conv, recurrent = found
            assert tuple(conv.shape) == (batch, *conv_shape), type(layer).__name__
            assert tuple(recurrent.shape) == (batch, *recurrent_shape)
        elif getattr(layer, "keys", None) is not None and layer.keys.numel():
            attention += 1
            assert tuple(layer.keys.shape) == (
                batch,
                geometry.num_kv_heads,
                length,
                geometry.head_dim,
            )
            assert layer.values.shape == layer.keys.shape
    if states == 0:
        pytest.skip(
            "this transformers version's DynamicCache keeps no conv_states/recurrent_states"
        )
    assert (attention, states) == (geometry.attention_layers, geometry.state_layers)
    assert geometry.conv_state_elements == math.prod(conv_shape)  # transformers keeps the kernel


# --------------------------------------------------------------------------- real checkpoints
def test_checkpoint_values_against_config_defaults():
    from transformers import JambaConfig, NemotronHConfig, Qwen3NextConfig

    # Jamba-1.5-Mini and Qwen3-Next-80B are the classes' defaults; NemotronH's defaults are not
    # Nemotron-H-8B's, which is why arena_layouts sets every field.
    for cls, values in ((JambaConfig, L.JAMBA_1_5_MINI), (Qwen3NextConfig, L.QWEN3_NEXT_80B_A3B)):
        defaults = cls()
        assert {k: getattr(defaults, k) for k in values} == values, cls.__name__
    assert NemotronHConfig().num_hidden_layers != 52


def test_checkpoint_geometries_by_hand():
    jamba = L.jamba_1_5_mini()
    assert (jamba.attention_layers, jamba.state_layers) == (4, 28)
    assert jamba.kv_token_bytes == 2 * 8 * 128 * 2
    assert jamba.state_page_bytes == 8192 * 4 * 2 + 8192 * 16 * 2  # transformers: kernel 4
    assert jamba.serving().state_page_bytes == 8192 * 3 * 2 + 8192 * 16 * 2
    nemo = L.nemotron_h_8b().serving()
    assert (nemo.attention_layers, nemo.state_layers) == (4, 24)
    assert nemo.state_page_bytes == (8192 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4
    qwen = L.qwen3_next_80b_a3b().serving()
    assert (qwen.attention_layers, qwen.state_layers, qwen.kv_token_bytes) == (12, 36, 2048)
    assert qwen.state_page_bytes == (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 2
    assert [L.vllm_attention_block_size(g) for g in (jamba.serving(), nemo, qwen)] == [
        80,
        1040,
        544,
    ]


def test_vllm_rule_reproduces_the_528_token_qwen3_5_block():
    qwen35 = L.qwen3_5_9b().serving()
    # 16 * cdiv(8192 * 3 * 2 + 32 * 128 * 128 * 4, 16 * 4096) = 16 * cdiv(2,146,304, 65,536)
    assert qwen35.state_page_bytes == 2_146_304
    assert L.vllm_attention_block_size(qwen35) == 528
    # bf16 SSM state (vLLM's "auto" without the Qwen3.5 hook) would give 272 tokens
    assert L.vllm_attention_block_size(replace(qwen35, recurrent_dtype_bytes=2)) == 272


# --------------------------------------------------------------------------- hand-computed
def test_padded_unified_page_and_accounting_by_hand():
    assert L.vllm_attention_block_size(TINY) == 16  # 16 * cdiv(40, 16 * 16)
    assert L.vllm_attention_block_size(TINY, alignment=1) == 3  # cdiv(40, 16)
    layout = PaddedUnifiedLayout(TINY, 8192)
    assert (layout.block_size, layout.page_bytes) == (16, 256)
    assert layout.admit(Req(20, 5))
    s = layout.stats()
    assert s["reserved_kv_bytes"] == 2 * 2 * 256  # 2 blocks x 2 layers
    assert s["reserved_state_bytes"] == 3 * 256  # every state padded to P
    assert s["live_kv_bytes"] == 20 * 16 * 2 and s["live_state_bytes"] == 3 * 40
    assert s["state_padding_bytes"] == 3 * (256 - 40)  # L3
    assert s["unused_bytes"] == 8192 - 640 - 120
    assert len(layout.arena.pages) == 4 + 3


def test_fixed_dual_split_and_accounting_by_hand():
    split = L.sglang_pool_split(10_000, TINY, ratio=0.9)
    # state pool: int(10000 * 0.9 / 1.9) = 4736 bytes -> 39 requests of 3 x 40 bytes
    assert (split.state_slots, split.state_pool_bytes) == (39, 4680)
    # the rest, 5320 bytes, in 32-byte token cells (16 bytes x 2 attention layers)
    assert (split.kv_tokens, split.kv_pool_bytes) == (166, 5312)
    layout = FixedDualLayout(TINY, 10_000)
    assert layout.admit(Req(20, 5))
    s = layout.stats()
    assert (s["reserved_kv_bytes"], s["reserved_state_bytes"]) == (640, 120)
    assert s["kv_slack_bytes"] == 0 and s["state_padding_bytes"] == 0  # L3: token slots, exact
    assert s["free_kv_pool_bytes"] == 5312 - 640 and s["free_state_pool_bytes"] == 4680 - 120
    assert s["waste"] == (10_000 - 760) / 10_000
    layout.step()
    assert layout.stats()["reserved_kv_bytes"] == 21 * 32  # one token slot per decoded token


def test_kvstack_accounting_by_hand():
    layout = KVStackLayout(TINY, 8192)
    assert layout.admit(Req(20, 13))
    s = layout.stats()
    assert s["reserved_kv_bytes"] == 2 * 16 * 16 * 2  # 2 blocks of 16 tokens, 2 layers
    assert s["reserved_state_bytes"] == s["live_state_bytes"] == 3 * 40  # exact (L3)
    for _ in range(12):  # tokens 21 .. 32: still two blocks
        layout.step()
    assert layout.stats()["reserved_kv_bytes"] == 1024
    layout.step()  # token 33 starts the third block; then the request has finished
    assert layout.stats()["running"] == 0 and not layout.arena.pages


def test_kvstack_per_layer_pages_hold_the_same_bytes():
    fused, per_layer = KVStackLayout(TINY, 8192), KVStackLayout(TINY, 8192, layer_axis=False)
    for layout in (fused, per_layer):
        assert layout.admit(Req(20, 13))
    assert (len(fused.arena.pages), len(per_layer.arena.pages)) == (2 + 1, 2 * 2 + 3)
    assert fused.stats() == per_layer.stats()


def test_preemption_takes_the_youngest_and_resumes_it():
    layout = KVStackLayout(TINY, 512 + 512 + 2 * 120)  # room for exactly two blocks
    old, young = Req(16, 4), Req(16, 4)
    assert layout.admit(old) and layout.admit(young)
    result = layout.step()  # both need a second block; only the youngest can give way
    assert result.preempted == [young] and list(layout.running) == [old]
    assert layout.generated[young] == 0
    for _ in range(3):
        result = layout.step()
    assert result.finished == [old]
    assert layout.admit(young)  # resumes with what it had generated (nothing yet) as prompt
    assert layout.running[young].prompt == 16


def test_a_second_preemption_keeps_the_tokens_generated_before_the_first():
    layout = KVStackLayout(TINY, 3 * 512 + 2 * 120)  # three blocks, two states
    first, second = Req(12, 40), Req(10, 40)
    assert layout.admit(first) and layout.admit(second)
    for _ in range(6):  # first takes the free block at step 4 (its token 16)
        assert layout.step().preempted == []
    assert layout.step().preempted == [second]  # its token 16 needs a block: none left
    assert layout.generated[second] == 6
    assert layout.admit(second) and layout.running[second].prompt == 16
    assert layout.step().preempted == [second]  # again, before decoding anything new
    assert layout.generated[second] == 6  # still the 6 from before, not 0
    assert layout.admit(second) and layout.running[second].remaining == 34


# --------------------------------------------------------------------------- all or nothing
class _Holder:
    def pages_moved(self, moves):
        pass


@pytest.mark.parametrize("cls", [KVStackLayout, PaddedUnifiedLayout])
def test_refused_admission_changes_nothing_after_state_pages_fit(cls):
    # One element at offset 0 makes every aligned KV run start one page up: the total free
    # passes the quick check, the state pages are placed, the KV does not fit even after
    # compaction, and the state pages must be given back (L1).
    probe = cls(TINY, 8192)
    kv, state = probe.kv_page_elements, probe.state_page_elements
    kv_pages = 2 * probe.kv_pages_per_block  # the request below needs two blocks per layer
    # [dummy | gap to the first aligned slot | kv_pages - 1 aligned slots | half a slot | states]
    capacity_elements = kv * kv_pages + probe.state_pages_per_sequence * state + kv // 2
    layout = cls(TINY, 2 * capacity_elements)
    layout.arena.allocate(_Holder(), "kv", 1)
    before = (set(layout.arena.pages), dict(layout.arena.used), list(layout.arena.free_extents))
    stats = layout.stats()
    assert not layout.admit(Req(2 * layout.block_size, 1))  # needs two blocks per layer
    after = (set(layout.arena.pages), dict(layout.arena.used), list(layout.arena.free_extents))
    assert after == before and layout.stats() == stats and not layout.running
    layout.arena.check_invariants()


def test_fixed_dual_refusal_changes_nothing():
    layout = FixedDualLayout(TINY, 1000)  # int(1000 * .9 / 1.9) // 120 = 3 state slots
    assert layout.split.state_slots == 3
    for _ in range(3):
        assert layout.admit(Req(4, 4))
    stats = layout.stats()
    assert not layout.admit(Req(4, 4))  # no state slot, though the KV pool has room
    assert layout.stats() == stats and stats["free_kv_pool_bytes"] > 0


# --------------------------------------------------------------------------- stateful
class LayoutMachine(RuleBasedStateMachine):
    """One layout driven by admit/step against a plain model: which requests run (in
    admission order), when each finishes, that preemption takes the youngest first."""

    @initialize(
        name=st.sampled_from(L.LAYOUTS),
        capacity=st.sampled_from([3000, 6000, 12000]),
    )
    def setup(self, name, capacity):
        self.layout = L.make_layout(name, TINY, capacity)
        # [request, prompt at admission, admitted step, remaining, generated before admission]
        self.model: list[list] = []
        self.generated: dict = {}
        self.waiting: list[Req] = []

    @rule(prompt=st.integers(1, 40), output=st.integers(1, 40), again=st.booleans())
    def admit(self, prompt, output, again):
        request = self.waiting.pop(0) if again and self.waiting else Req(prompt, output)
        before = (
            set(getattr(self.layout.arena, "pages", ())),
            dict(self.layout.arena.used),
            self.layout.stats(),
        )
        if self.layout.admit(request):
            done = self.generated.pop(request, 0)
            self.model.append(
                [request, request.prompt_tokens + done, self.layout.step_count,
                 request.output_tokens - done, done]
            )  # fmt: skip
        else:  # L1
            after = (
                set(self.layout.arena.pages),
                dict(self.layout.arena.used),
                self.layout.stats(),
            )
            assert after == before
            if request not in self.waiting:
                self.waiting.insert(0, request)

    @rule()
    def step(self):
        result = self.layout.step()
        now = self.layout.step_count
        order = [entry[0] for entry in self.model]
        # The youngest go first, in that order.
        assert result.preempted == list(reversed(order))[: len(result.preempted)]
        gone = set(map(id, result.preempted))
        expected = {id(e[0]) for e in self.model if id(e[0]) not in gone and e[2] + e[3] == now}
        assert set(map(id, result.finished)) == expected
        for entry in self.model:
            if id(entry[0]) in gone:
                self.generated[entry[0]] = entry[4] + now - 1 - entry[2]
                self.waiting.insert(0, entry[0])
        self.model = [e for e in self.model if id(e[0]) not in gone | expected]

    @invariant()
    def holdings(self):
        layout, g = self.layout, TINY
        assert [e[0] for e in self.model] == list(layout.running)
        tokens = 0
        for (_, prompt, admitted, _, _), seq in zip(
            self.model, layout.running.values(), strict=True
        ):
            held = prompt + layout.step_count - admitted
            tokens += held
            assert seq.units == math.ceil(held / layout.block_size)  # L2
            if not isinstance(layout, FixedDualLayout):
                assert len(seq.kv_pages) == seq.units * layout.kv_pages_per_block
                assert len(seq.state_pages) == layout.state_pages_per_sequence
        assert layout.total_tokens == tokens
        assert layout.generated == self.generated  # tokens generated before a preemption
        s = layout.stats()
        running = len(layout.running)
        if isinstance(layout, PaddedUnifiedLayout):  # L3: padded by exactly P - state
            assert s["reserved_state_bytes"] == running * g.state_layers * layout.page_bytes
        else:
            assert s["reserved_state_bytes"] == s["live_state_bytes"]
        assert (
            0
            <= s["kv_slack_bytes"]
            < max(1, running) * g.attention_layers * (layout.block_size * g.kv_token_bytes)
        )
        layout.arena.check_invariants()


TestLayoutMachine = LayoutMachine.TestCase


# --------------------------------------------------------------------------- whole traces
def _small_trace(n=60, seed=3):
    return draw_trace(n, seed=seed, max_context=2048, arrival_rate=0.5)


@pytest.mark.parametrize("name", L.LAYOUTS)
def test_a_finished_trace_leaves_the_arena_empty(name):
    geometry = L.jamba_1_5_mini().serving()
    layout = L.make_layout(name, geometry, 150 * 2**20)
    result = L.run_trace(layout, _small_trace())
    assert result.finished == 60 and not layout.running and result.saturated
    layout.close()
    assert not layout.arena.pages and sum(layout.arena.used.values()) == 0  # L4
    layout.arena.check_invariants()


def test_kvstack_fits_at_least_as_many_sequences():
    geometry = L.qwen3_next_80b_a3b().serving()
    trace = _small_trace(n=80)
    results = {n: L.run_trace(L.make_layout(n, geometry, 400 * 2**20), trace) for n in L.LAYOUTS}
    best = results["kvstack"].max_sequences
    assert all(r.saturated for r in results.values())
    assert best >= results["padded_unified"].max_sequences
    assert best >= results["fixed_dual"].max_sequences
    assert results["kvstack"].peak["waste"] < results["padded_unified"].peak["waste"]


def test_padding_only_where_the_rule_demands_it():
    # A state page of exactly 16 tokens of one layer's K/V: vLLM's block is 16 tokens and
    # nothing is padded; one byte more and the block doubles, with the state padded.
    exact = replace(TINY, conv_channels=4, conv_window=4, recurrent_shape=(8, 14))
    assert exact.state_page_bytes == 256 == 16 * exact.kv_token_bytes
    layout = PaddedUnifiedLayout(exact, 8192)
    assert layout.block_size == 16 and layout.admit(Req(3, 3))
    assert layout.stats()["state_padding_bytes"] == 0
    over = replace(exact, conv_channels=5)  # 264 bytes
    assert PaddedUnifiedLayout(over, 8192).block_size == 32
    for cls in (KVStackLayout, FixedDualLayout):
        other = cls(over, 8192)
        assert other.admit(Req(3, 3)) and other.stats()["state_padding_bytes"] == 0


# --------------------------------------------------------------------------- bad input
def test_bad_inputs_name_the_argument():
    with pytest.raises(InvalidArgumentError, match="layout must be one of"):
        L.make_layout("paged", TINY, 1000)
    with pytest.raises(InvalidArgumentError, match="recurrent_shape"):
        replace(TINY, recurrent_shape=())
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        replace(TINY, head_dim=0)
    with pytest.raises(InvalidArgumentError, match="model_type='llama'"):
        from transformers import LlamaConfig

        L.geometry_from_config(LlamaConfig(), name="x")
    with pytest.raises(InvalidArgumentError, match="expected at least one of each"):
        FixedDualLayout(TINY, 100)
    with pytest.raises(InvalidArgumentError, match="ratio must be a positive number"):
        L.sglang_pool_split(1000, TINY, ratio=0)
    layout = KVStackLayout(TINY, 8192)
    request = Req(4, 4)
    assert layout.admit(request)
    with pytest.raises(InvalidArgumentError, match="already running"):
        layout.admit(request)
    with pytest.raises(InvalidArgumentError, match="request.output_tokens"):
        layout.admit(Req(4, 0))
    with pytest.raises(InvalidArgumentError, match="does not fit an empty kvstack layout"):
        L.run_trace(KVStackLayout(TINY, 1024), [Req(200, 1)])


# --------------------------------------------------------------------------- workloads
def test_length_distribution_matches_published_means_and_bounds():
    dist = load_length_distribution("sharegpt")
    pairs = dist.sample(20_000, seed=0)
    prompts, outputs = [p for p, _ in pairs], [o for _, o in pairs]
    assert statistics.fmean(prompts) == pytest.approx(dist.published_prompt_mean, rel=0.03)
    assert statistics.fmean(outputs) == pytest.approx(dist.published_output_mean, rel=0.03)
    assert min(prompts) >= 4 and max(prompts) <= 1024 and min(outputs) >= 4
    assert max(p + o for p, o in pairs) <= 2048
    assert dist.sample(50, seed=1) == dist.sample(50, seed=1) != dist.sample(50, seed=2)


def test_scaled_trace_fits_max_context_and_arrivals_are_poisson():
    trace = draw_trace(2000, seed=5, max_context=300, arrival_rate=2.0)
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in trace)
    assert max(r.prompt_tokens + r.output_tokens for r in trace) <= 300
    steps = [r.arrival_step for r in trace]
    assert steps == sorted(steps) and steps[-1] / len(trace) == pytest.approx(0.5, rel=0.1)
    same_lengths = draw_trace(2000, seed=5, max_context=300)
    assert [(r.prompt_tokens, r.output_tokens) for r in same_lengths] == [
        (r.prompt_tokens, r.output_tokens) for r in trace
    ]
    assert all(r.arrival_step == 0 for r in same_lengths)
    assert TraceRequest(0, 0, 1, 1) != TraceRequest(0, 0, 1, 1)  # two requests, not one


def test_workload_bad_inputs():
    dist = load_length_distribution()
    with pytest.raises(InvalidArgumentError, match="name must be one of"):
        load_length_distribution("alpaca")
    with pytest.raises(InvalidArgumentError, match="n must be"):
        dist.sample(-1, seed=0)
    with pytest.raises(InvalidArgumentError, match="seed must be an int"):
        dist.sample(1, seed=1.5)
    with pytest.raises(InvalidArgumentError, match="max_context must be an integer >= 2"):
        dist.sample(1, seed=0, max_context=1)
    with pytest.raises(InvalidArgumentError, match="arrival_rate must be a positive"):
        draw_trace(1, seed=0, arrival_rate=0)
