"""The kvpress comparison's plumbing: the worker protocol, its errors, and the figures' arithmetic.

The real run needs kvpress's own venv (``make kvpress-env``); here the worker runs with this
venv's python and a stand-in ``kvpress`` package whose presses do nothing, on a tiny Llama, so
the test checks the pipe, the configurations and the error path in seconds.
"""

from __future__ import annotations

import stat
import sys
import textwrap

import pytest
import torch

from kvstack.bench import kvpress as bench
from kvstack.errors import KVStackError
from spec_tests.tiny import tiny_llama_config

FAKE_KVPRESS = """
import contextlib
from dataclasses import dataclass

__version__ = "stand-in"


@dataclass
class _NoOpPress:
    compression_ratio: float = 0.0

    def __call__(self, model):
        return contextlib.nullcontext()


SnapKVPress = TOVAPress = StreamingLLMPress = ObservedAttentionPress = _NoOpPress
"""


@pytest.fixture
def worker_python(tmp_path):
    """A python that finds the stand-in kvpress first (the driver clears PYTHONPATH)."""
    package = tmp_path / "fake" / "kvpress"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_KVPRESS)
    wrapper = tmp_path / "python"
    wrapper.write_text(
        textwrap.dedent(f"""\
            #!/bin/sh
            PYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"
            """)
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


@pytest.fixture
def tiny_model_dir(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(eos_token_id=255)
    directory = tmp_path / "tiny"
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def test_the_worker_answers_every_configuration_and_survives_a_bad_request(
    worker_python, tiny_model_dir
):
    worker = bench.KVPressWorker(worker_python)
    try:
        loaded = worker.ask(
            op="load", model_dir=str(tiny_model_dir), threads=1, prompts=[[1, 2, 3, 4, 5, 6]]
        )
        assert loaded["versions"]["kvpress"] == "stand-in"
        assert loaded["torch_threads"] == 1
        replies = {
            config: worker.ask(op="generate", config=config, prompt=0, new_tokens=4)
            for config in ("dynamic", *bench.SAME_PRESS.values())
        }
        for config, reply in replies.items():
            assert len(reply["tokens"]) == 4, config
            assert reply["seconds"] > 0, config
        # The stand-in presses change nothing, so every configuration generates dynamic's tokens
        # (the eager one included: the switch of attention implementation worked).
        assert {tuple(reply["tokens"]) for reply in replies.values()} == {
            tuple(replies["dynamic"]["tokens"])
        }
        with pytest.raises(KVStackError, match="'h2o'"):
            worker.ask(op="generate", config="h2o", prompt=0, new_tokens=4)
        again = worker.ask(op="generate", config="dynamic", prompt=0, new_tokens=4)
        assert again["tokens"] == replies["dynamic"]["tokens"]
    finally:
        worker.close()
    assert worker.process.returncode == 0


def test_a_missing_kvpress_python_names_the_make_target(tmp_path):
    with pytest.raises(KVStackError, match="make kvpress-env"):
        bench.KVPressWorker(tmp_path / "no" / "python")


def test_a_worker_that_dies_is_reported_not_waited_on(tmp_path):
    wrapper = tmp_path / "python"
    wrapper.write_text("#!/bin/sh\nexit 3\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    worker = bench.KVPressWorker(wrapper)
    with pytest.raises(KVStackError, match="exited"):
        worker.ask(op="load", model_dir="x", threads=1, prompts=[])


def test_each_ratio_is_the_median_of_the_same_round_ratios():
    seconds = {
        "dynamic": [1.0, 2.0, 3.0],
        "kvpress:dynamic": [1.0, 1.0, 3.0],
        **{policy: [2.0, 2.0, 9.0] for policy in bench.SAME_PRESS},
        **{f"kvpress:{press}": [1.0, 4.0, 3.0] for press in bench.SAME_PRESS.values()},
    }
    figures = bench._figures(seconds)
    for policy in bench.SAME_PRESS:
        figure = figures[f"kvpress.kvstack_over_kvpress.{policy}"]
        assert figure.value == pytest.approx(2.0)  # rounds: 2, 0.5, 3 -> median 2
        assert figure.target == ("<=", 1.0)
        assert figure.met() is False
    assert figures["kvpress.dynamic_here_over_worker"].value == pytest.approx(1.0)  # 1, 2, 1
    assert figures["kvpress.seconds.kvpress.snapkv"].value == pytest.approx(3.0)
