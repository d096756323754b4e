"""Tangram's offline calibration: the allocation, the budgets, the profile file and its errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstack import calibrate as cal
from kvstack.errors import InvalidArgumentError
from spec_tests.tiny import tiny_llama_config


# --------------------------------------------------------------------------- allocation
@given(
    heads=st.integers(1, 4),
    n=st.integers(1, 40),
    ratio=st.sampled_from([0.1, 0.25, 0.5, 1.0]),
    floor=st.sampled_from([0.0, 0.2, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_adakv_keeps_the_layer_budget_with_every_head_at_its_floor(heads, n, ratio, floor, seed):
    scores = torch.rand(heads, n, generator=torch.Generator().manual_seed(seed))
    shares = cal.adakv_shares(scores, ratio, floor)
    counts = (shares * n).round().long()
    assert int(counts.sum()) == round(ratio * n * heads)
    assert bool((counts >= math.floor(floor * ratio * n)).all())
    assert bool((counts <= n).all())


def test_adakv_gives_the_rest_of_the_budget_to_the_highest_scores_across_heads():
    # Head 0's keys all outscore head 1's: past the floors, head 0 takes every key it has.
    scores = torch.tensor([[9.0, 8.0, 7.0, 6.0], [0.4, 0.3, 0.2, 0.1]])
    shares = cal.adakv_shares(scores, ratio=0.5, floor=0.5)  # budget 4, floor 1 each
    assert shares.tolist() == [0.75, 0.25]
    assert cal.adakv_shares(scores, ratio=0.5, floor=1.0).tolist() == [0.5, 0.5]  # all floor


def test_snapkv_scores_sum_the_window_over_each_kv_heads_query_group():
    n, window = 6, 2
    weights = torch.zeros(4, n, n)  # 4 query heads, 2 KV heads
    weights[0, n - 1, 1] = 1.0  # KV head 0 (query heads 0, 1): key 1 gets 1 + 0.5
    weights[1, n - 2, 1] = 0.5
    weights[3, n - 1, 3] = 0.25  # KV head 1: key 3
    weights[2, 0, 0] = 5.0  # a query outside the window: no vote
    scores = cal.snapkv_scores(weights, num_kv_heads=2, window=window, kernel_size=1)
    assert scores.shape == (2, n - window)
    assert scores.tolist() == [[0.0, 1.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.25]]
    pooled = cal.snapkv_scores(weights, num_kv_heads=2, window=window, kernel_size=3)
    assert pooled[0].tolist() == [1.5, 1.5, 1.5, 0.0]  # neighbours keep their context


def test_budgets_are_mean_plus_alpha_std_clipped_at_one():
    shares = torch.tensor([[[0.1, 0.5]], [[0.3, 0.9]]])  # [S=2, L=1, H=2]
    budgets, mean, std = cal.head_budgets(shares, alpha=2.0)
    assert mean[0].tolist() == pytest.approx([0.2, 0.7])
    assert std[0, 0].item() == pytest.approx(math.sqrt(0.02))
    assert budgets[0, 0].item() == pytest.approx(0.2 + 2 * math.sqrt(0.02))
    assert budgets[0, 1].item() == 1.0  # 0.7 + 2 * 0.28 clipped


def test_spearman_of_known_rankings():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert cal.spearman(a, a * 10) == pytest.approx(1.0)
    assert cal.spearman(a, -a) == pytest.approx(-1.0)
    # ties get their mean rank: ranks [0.5, 0.5, 2, 3] against [0, 1, 2, 3]
    assert cal.spearman(torch.tensor([1.0, 1.0, 3.0, 4.0]), a) == pytest.approx(0.9486833)
    assert math.isnan(cal.spearman(torch.ones(3), a[:3]))


# --------------------------------------------------------------------------- on a model
@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(num_hidden_layers=3, max_position_embeddings=256))
    return model.eval()


def _samples(count: int, tokens: int = 64) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (1, tokens), generator=generator) for _ in range(count)]


def test_a_profile_has_a_budget_per_layer_and_kv_head_and_each_layer_averages_the_ratio(
    tiny_model,
):
    samples = _samples(3)
    profile = cal.calibrate(tiny_model, samples, ratio=0.25, window=8)
    assert (profile.num_layers, profile.num_kv_heads) == (3, 2)
    shares = torch.stack(
        [cal.sample_shares(tiny_model, ids, 0.25, window=8) for ids in samples]
    )  # [S, L, H]
    n = 64 - 8
    assert shares.mul(n).sum(dim=-1).round().eq(round(0.25 * n * 2)).all()
    torch.testing.assert_close(torch.tensor(profile.mean), shares.mean(dim=0))
    assert all(0 < b <= 1 for layer in profile.budgets for b in layer)
    assert (torch.tensor(profile.budgets) >= torch.tensor(profile.mean)).all()
    assert len(profile.calibration["spearman_vs_others"]) == 3
    assert profile.model["num_hidden_layers"] == 3
    assert tiny_model.config._attn_implementation != "eager"  # restored after the eager passes


def test_a_saved_profile_loads_back_equal(tiny_model, tmp_path):
    profile = cal.calibrate(tiny_model, _samples(2), ratio=0.5, window=8)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert cal.HeadProfile.load(path, config=tiny_model.config) == profile
    assert not (tmp_path / "profile.json.tmp").exists()


# --------------------------------------------------------------------------- bad input
@pytest.fixture
def saved(tiny_model, tmp_path):
    path = tmp_path / "profile.json"
    cal.calibrate(tiny_model, _samples(2), ratio=0.5, window=8).save(path)
    return path


def test_a_profile_for_another_model_is_refused(saved):
    other = tiny_llama_config(num_hidden_layers=4)
    with pytest.raises(cal.ProfileError, match="num_hidden_layers=3.*this model has.*=4"):
        cal.HeadProfile.load(saved, config=other)
    with pytest.raises(cal.ProfileError, match="num_key_value_heads=2.*this model has.*=4"):
        cal.HeadProfile.load(
            saved, config=tiny_llama_config(num_hidden_layers=3, num_key_value_heads=4)
        )


def test_a_profile_for_another_head_size_is_refused(saved):
    with pytest.raises(cal.ProfileError, match="head_dim=16.*this model has head_dim=32"):
        cal.HeadProfile.load(saved, config=tiny_llama_config(num_hidden_layers=3, head_dim=32))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(ratio=None), "ratio=None; expected a number"),
        (lambda d: d.update(ratio=1.5), r"ratio=1.5; expected a fraction in \(0, 1\]"),
        (lambda d: d.update(alpha="2"), "alpha='2'; expected a number"),
        (lambda d: d.update(alpha=-1), "alpha=-1.0; expected a finite number"),
        (lambda d: d.update(model="llama"), "model='llama'; expected model_identity"),
        (lambda d: d["model"].pop("head_dim"), r"model\['head_dim'\]=None"),
        (lambda d: d["model"].update(num_hidden_layers=4), r"model\['num_hidden_layers'\]=4; exp"),
        (lambda d: d.update(calibration=[]), r"calibration=\[\]; expected a dict"),
        (lambda d: d["std"].pop(), r"std has \[2, 2\] heads per layer; expected 3 layers"),
    ],
)
def test_a_profile_with_a_malformed_field_is_refused(saved, edit, match):
    data = json.loads(saved.read_text())
    edit(data)
    saved.write_text(json.dumps(data))
    with pytest.raises(cal.ProfileError, match=match):
        cal.HeadProfile.load(saved)


def test_a_failed_save_leaves_the_old_profile_and_no_temporary_file(saved, monkeypatch):
    before = saved.read_text()
    profile = cal.HeadProfile.load(saved)

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cal.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        profile.save(saved)
    assert saved.read_text() == before
    assert sorted(p.name for p in saved.parent.iterdir()) == [saved.name]


@pytest.mark.parametrize("budget", [0.0, -0.1, 1.5, float("nan")])
def test_budgets_outside_zero_one_are_refused(saved, budget):
    data = json.loads(saved.read_text())
    data["budgets"][1][0] = budget
    saved.write_text(json.dumps(data))
    with pytest.raises(cal.ProfileError, match=r"budgets\[1\]\[0\] = .*expected a fraction in"):
        cal.HeadProfile.load(saved)


def test_a_truncated_or_foreign_file_is_refused(saved, tmp_path):
    text = saved.read_text()
    saved.write_text(text[: len(text) // 2])
    with pytest.raises(cal.ProfileError, match="not valid JSON"):
        cal.HeadProfile.load(saved)
    foreign = tmp_path / "other.json"
    foreign.write_text(json.dumps({"budgets": [[0.5]]}))
    with pytest.raises(cal.ProfileError, match="not a kvstack head profile"):
        cal.HeadProfile.load(foreign)
    ragged = json.loads(text)
    ragged["budgets"][0] = ragged["budgets"][0][:1]
    foreign.write_text(json.dumps(ragged))
    with pytest.raises(cal.ProfileError, match="different head counts"):
        cal.HeadProfile.load(foreign)
    with pytest.raises(cal.ProfileError, match="cannot be read"):
        cal.HeadProfile.load(tmp_path / "missing.json")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(ratio=0.0), "ratio must be a fraction"),
        (dict(ratio=1.5), "ratio must be a fraction"),
        (dict(alpha=-1.0), "alpha must be"),
        (dict(window=0), "window must be"),
        (dict(kernel_size=4), "kernel_size must be"),
        (dict(floor=2.0), "floor must be"),
    ],
)
def test_bad_calibration_arguments_are_refused_before_any_forward(tiny_model, kwargs, match):
    calls = []
    handle = tiny_model.register_forward_hook(lambda *args: calls.append(1))
    try:
        arguments = {"ratio": 0.25, **kwargs}
        with pytest.raises(InvalidArgumentError, match=match):
            cal.calibrate(tiny_model, _samples(2), **arguments)
        with pytest.raises(InvalidArgumentError, match="at least 2"):
            cal.calibrate(tiny_model, _samples(1), ratio=0.25)
    finally:
        handle.remove()
    assert calls == []


def test_a_sample_too_short_for_the_window_is_refused(tiny_model):
    with pytest.raises(InvalidArgumentError, match="leaves no keys outside the observation"):
        cal.sample_shares(tiny_model, torch.zeros(1, 20, dtype=torch.long), 0.25, window=16)


# --------------------------------------------------------------------------- pilot text
class _CharTokenizer:
    """One id per character: enough for pilot_samples."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 256 for c in text]}


def test_pilot_samples_are_deterministic_distinct_and_of_the_asked_length():
    texts = ["\n\n".join(f"paragraph {i} of text {t}" * 3 for i in range(6)) for t in range(3)]
    first = cal.pilot_samples(_CharTokenizer(), 5, 200, texts=texts, seed=7)
    again = cal.pilot_samples(_CharTokenizer(), 5, 200, texts=texts, seed=7)
    assert all(s.shape == (1, 200) for s in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert len({tuple(s[0].tolist()) for s in first}) > 1
    with pytest.raises(InvalidArgumentError, match="hold only"):
        cal.pilot_samples(_CharTokenizer(), 1, 10**6, texts=texts)


# --------------------------------------------------------------------------- the command
def test_calibrate_command_writes_a_profile_that_fits_smollm2(tmp_path, capsys):
    """``kvstack calibrate`` on the real model (two short pilot samples: the pipeline, not the
    figures): the profile loads against SmolLM2's config, 30 layers x 3 KV heads."""
    from kvstack.cli import main
    from kvstack.models import load_smollm2

    out = tmp_path / "profile.json"
    status = main(
        ["calibrate", "--samples", "2", "--sample-tokens", "128", "--ratio", "0.25"]
        + ["--out", str(out)]
    )
    assert status == 0
    model, _ = load_smollm2(progress=False)
    profile = cal.HeadProfile.load(out, config=model.config)
    assert (profile.num_layers, profile.num_kv_heads) == (30, 3)
    assert profile.calibration["sample_tokens"] == [128, 128]
    assert "Spearman mean" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ratio", "0"], "ratio must be a fraction"),
        (["--ratio", "0.25", "--samples", "1"], "at least 2"),
        (["--ratio", "0.25", "--sample-tokens", "16"], "sample_tokens must be"),
    ],
)
def test_calibrate_command_refuses_bad_options_before_loading_a_model(
    tmp_path, capsys, monkeypatch, argv, match
):
    import kvstack.demo
    from kvstack.cli import main

    monkeypatch.setattr(kvstack.demo, "load_model", lambda *a: pytest.fail("model loaded"))
    out = tmp_path / "profile.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", *argv, "--out", str(out)])
    assert exit_info.value.code == 2
    assert match in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "where, match",
    [("folder", "is a directory"), ("missing/profile.json", "does not exist")],
)
def test_calibrate_command_refuses_an_out_path_it_could_not_write_before_loading_a_model(
    tmp_path, capsys, monkeypatch, where, match
):
    import kvstack.demo
    from kvstack.cli import main

    monkeypatch.setattr(kvstack.demo, "load_model", lambda *a: pytest.fail("model loaded"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["calibrate", "--ratio", "0.25", "--out", str(tmp_path / where)])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "--out" in error and match in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]  # nothing written


def test_the_identity_of_a_composite_config_is_its_decoders_geometry():
    from transformers import LlavaConfig

    text = tiny_llama_config(num_hidden_layers=3)
    composite = LlavaConfig(text_config=text.to_dict())
    theirs, ours = cal.model_identity(composite), cal.model_identity(text)
    geometry = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
    assert {key: theirs[key] for key in geometry} == {key: ours[key] for key in geometry}
    assert theirs["config_sha256"] != ours["config_sha256"]  # the hash covers the whole config
