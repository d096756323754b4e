"""The tiers benchmark's quick run on SmolLM2: every figure is there, the tiered runs make
DynamicCache's tokens, the resumed turn agrees with the re-prefilled one, and the README table
renders from what it measured."""

from __future__ import annotations

import statistics

import pytest

from kvstack.bench.tiers import kv_bytes_of, measure, readme_tables


@pytest.fixture(scope="module")
def quick_run():
    return measure(True, lambda message: None)


def test_the_quick_run_measures_every_figure_and_its_tiered_tokens_are_exact(quick_run):
    figures = quick_run.figures
    assert set(figures) == {
        "tiers.decode_speed_ratio.device25",
        "tiers.decode_speed_ratio.device25_over_dynamic",
        "tiers.decode_speed_ratio.device25_page4",
        "tiers.decode_speed_ratio.device25_page16",
        "tiers.decode_speed_ratio.device25_fetch_when_read",
        "tiers.decode_speed_ratio.segments_over_gathered",
        "tiers.device_kv_fraction.device25",
        "tiers.overlap_fraction",
        "tiers.bytes_per_token.lru",
        "tiers.bytes_per_token.cost",
        "tiers.bytes_per_token.attention",
        "tiers.hit_rate.lru",
        "tiers.hit_rate.cost",
        "tiers.hit_rate.attention",
        "tiers.device_attention_share.lru",
        "tiers.device_attention_share.cost",
        "tiers.device_attention_share.attention",
        "tiers.tokens_equal_dynamic",
        "tiers.resume_speedup",
        "tiers.resume_tokens_equal",
        "tiers.recompute.decode_speed_ratio.cost_vs_lru",
        "tiers.recompute.tokens_per_step.cost",
        "tiers.recompute.tokens_per_step.lru",
        "tiers.recompute.dropped_fraction",
        "tiers.recompute.tokens_equal_dynamic",
        "tiers.scheduler_bytes_ratio",
        "tiers.scheduler_bytes_ratio.vs_round_robin",
        "tiers.scheduler_bytes_ratio.first_trace",
        "tiers.engine.bytes_per_token.page_aware",
        "tiers.engine.bytes_per_token.fifo",
        "tiers.engine.bytes_per_token.round_robin",
        "tiers.engine.swaps.page_aware",
        "tiers.engine.swaps.fifo",
        "tiers.engine.swaps.round_robin",
        "tiers.engine.swap_over_recompute",
        "tiers.engine.tokens_equal_recompute",
        "tiers.engine.adaptive_chunking.step_p95_ratio",
        "tiers.engine.adaptive_chunking.tpot_p95_ratio",
        "tiers.engine.adaptive_chunking.throughput_ratio",
        "tiers.ttft_ratio.cost_vs_lru",
        "tiers.turns.ttft_ratio.lru_vs_reprefill",
        "tiers.turns.ttft_ratio.cost_vs_reprefill",
        "tiers.turns.history_tokens_computed.reprefill",
        "tiers.turns.history_tokens_computed.lru",
        "tiers.turns.history_tokens_computed.cost",
        "tiers.turns.tokens_equal_reprefill",
    }
    assert figures["tiers.tokens_equal_dynamic"].value == 1.0
    assert figures["tiers.recompute.tokens_equal_dynamic"].value == 1.0
    # Half the KV is dropped: every decode step recomputes some of it, under either rule.
    assert 0 < figures["tiers.recompute.dropped_fraction"].value < 1
    for policy in ("cost", "lru"):
        assert figures[f"tiers.recompute.tokens_per_step.{policy}"].value > 0
    assert figures["tiers.resume_tokens_equal"].value == 1.0
    # With a quarter of the KV on device, decode must read pages from host or disk.
    assert figures["tiers.bytes_per_token.cost"].value > 0
    assert 0 < figures["tiers.hit_rate.cost"].value < 1
    runs = quick_run.workload["runs"]
    kv = quick_run.workload["kv_bytes"]
    device = runs["device25_cost"]["bytes_used"]["device"] + runs["device25_cost"]["tail_bytes"]
    assert device <= 0.25 * kv  # the tails count in the quarter
    assert figures["tiers.device_kv_fraction.device25"].value == device / kv
    assert runs["all_device"]["device_hit_rate"] == 1.0
    # The overlap figure's run fills no block while it decodes (its description says so): it
    # stores no page, so it demotes none.
    assert runs["device25_cost"]["bytes_demoted_in_decode"] == 0
    assert "device25_cost run" in figures["tiers.overlap_fraction"].description
    assert "demotes none" in figures["tiers.overlap_fraction"].description
    # Every page is read at every step: where the rules put pages cannot change the bytes.
    assert (
        figures["tiers.bytes_per_token.attention"].value
        == figures["tiers.bytes_per_token.lru"].value
    )
    assert runs["all_device"]["device_attention_share"] == pytest.approx(1.0)
    for policy in ("lru", "cost", "attention"):
        assert 0 < figures[f"tiers.device_attention_share.{policy}"].value < 1
    # The engine runs: the arena is tight enough that requests are swapped out and back, every
    # rule's requests make the recomputing engine's tokens, and each byte out comes back.
    assert figures["tiers.engine.tokens_equal_recompute"].value == 1.0
    engine = quick_run.workload["engine"]
    for name, run in engine["runs"].items():
        assert run["bytes_in"] == run["bytes_out"], name
        assert figures[f"tiers.engine.swaps.{name}"].value == run["swaps"]
    assert engine["runs"]["round_robin"]["swaps"] > 0
    # The headline ratio sums every trace's bytes and tokens; the first trace is the runs'.
    traces = engine["scheduler_traces"]
    assert (
        len(traces) == 2 and traces["0"]["fifo"]["bytes_in"] == engine["runs"]["fifo"]["bytes_in"]
    )

    def per_token(name):
        return sum(t[name]["bytes_in"] for t in traces.values()) / sum(
            t[name]["output_tokens"] for t in traces.values()
        )

    assert figures["tiers.scheduler_bytes_ratio"].value == pytest.approx(
        per_token("page_aware") / per_token("fifo")
    )
    assert engine["recompute_preemptions"] > 0
    # The p95 ratios are medians of each interleaved round's ratio, not ratios of pooled p95s.
    for figure, key in (("step_p95_ratio", "step_seconds_p95"), ("tpot_p95_ratio", "tpot_p95_s")):
        ratios = engine["adaptive_p95_ratios_of_rounds"][key]
        assert len(ratios) == engine["repeats"]
        assert figures[f"tiers.engine.adaptive_chunking.{figure}"].value == statistics.median(
            ratios
        )
    # The multi-turn runs: the store is too small for every conversation, so both rules drop
    # pages, reuse some, and every turn still makes the tokens of re-prefilling its prompt.
    assert figures["tiers.turns.tokens_equal_reprefill"].value == 1.0
    turns = quick_run.workload["turns"]
    # The store's budget is a fraction of the K/V in the model's own dtype (fp32 here: 4 bytes).
    per_token = 30 * 2 * 3 * 64 * 4  # SmolLM2: 30 layers, 3 KV heads of 64
    assert turns["whole_kv_bytes"] == per_token * sum(turns["history_tokens"].values())
    for side in ("lru", "cost"):
        stats = turns["store_stats"][side]
        assert stats["drops"] > 0 and stats["reused_tokens"] > 0, side
        assert (
            figures[f"tiers.turns.history_tokens_computed.{side}"].value
            < figures["tiers.turns.history_tokens_computed.reprefill"].value
        )


def test_kv_bytes_count_every_layer_k_and_v():
    class Config:
        hidden_size, num_attention_heads, num_key_value_heads, num_hidden_layers = 576, 9, 3, 30

    class Model:
        config = Config()

        def parameters(self):
            import torch

            yield torch.zeros(1)

    assert kv_bytes_of(Model(), 10) == 30 * 2 * 10 * 3 * 64 * 4


def test_the_readme_table_renders_from_the_results(quick_run):
    results = {
        "figures": {name: f.record() for name, f in quick_run.figures.items()},
        "workload": quick_run.workload,
    }
    table = readme_tables(results)["tiers"]
    assert "`tiers.decode_speed_ratio.device25`" in table and "Decode tokens/s" in table
    assert "`tiers.ttft_ratio.cost_vs_lru`" in table and "Multi-turn runs" in table
