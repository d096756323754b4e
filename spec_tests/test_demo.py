"""``kvstack demo``: the quick run's table on the real model, and every bad option's error.

The quick run (SmolLM2, a ~200-token prompt, 8 new tokens) goes through ``kvstack.cli.main`` once
for the module; the checks read what it printed, as a user would. Bad options are rejected
before anything is loaded, with an error that names the option and the value.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import pytest

from kvstack import demo
from kvstack.cli import main
from kvstack.demo import POLICY_NAMES, QUICK_NEW_TOKENS, make_policy, read_prompt
from kvstack.errors import InvalidArgumentError
from kvstack.models import smollm2_cache_dir
from kvstack.policies import EvictionPolicy

CACHES = ("DynamicCache", "PagedCache", "TokenTableCache")
TEXT_LINE = re.compile(r"^  (DynamicCache|PagedCache|TokenTableCache \([^)]*\))\s+(.*)$")


def run_demo_cli(argv: list[str]) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # capsys is function-scoped; the fixtures are not
        assert main(["demo", *argv]) == 0
    return printed.getvalue()


def table_rows(printed: str) -> dict[str, dict[str, str]]:
    """{cache class name: {column: cell}} from the printed table."""
    lines = [line for line in printed.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[cells[0].split()[0]] = dict(zip(header, cells, strict=True))
    return rows


def generated_texts(printed: str) -> dict[str, str]:
    texts = {}
    for line in printed.splitlines():
        match = TEXT_LINE.match(line)
        if match:
            texts[match.group(1).split()[0]] = match.group(2)
    return texts


@pytest.fixture(scope="module")
def quick_output() -> str:
    return run_demo_cli(["--quick"])


def test_quick_demo_prints_three_rows_with_plausible_numbers(quick_output):
    rows = table_rows(quick_output)
    assert sorted(rows) == sorted(CACHES), quick_output
    assert rows["TokenTableCache"]["cache"] == "TokenTableCache (H2O, ratio 0.5)"
    mib = {name: float(row["KV MiB"]) for name, row in rows.items()}
    live = {name: float(row["live tokens"]) for name, row in rows.items()}
    prompt_tokens = int(re.search(r", (\d+) tokens\. ", quick_output).group(1))
    budget = int(re.search(r"keeps (\d+) tokens per token table", quick_output).group(1))
    assert 100 < prompt_tokens < 400  # --quick: a short prompt
    assert budget == math.ceil(0.5 * prompt_tokens)

    # Nothing evicted: every prompt token and every fed-back new token is stored.
    stored = prompt_tokens + QUICK_NEW_TOKENS - 1
    assert live["DynamicCache"] == live["PagedCache"] == stored
    assert live["TokenTableCache"] == budget  # evicted down to the budget in every table
    # SmolLM2: 30 layers x 3 KV heads x 64 dims x 4 bytes x (K + V) per stored token.
    assert mib["DynamicCache"] == pytest.approx(stored * 30 * 3 * 64 * 4 * 2 / 2**20, abs=0.01)
    # PagedCache's private arena: its blocks plus the decode headroom it reserves at prefill,
    # rounded up to whole segments (real bytes, not only what the tables hold).
    from kvstack.arena import DEFAULT_SEGMENT_BYTES
    from kvstack.hf.paged import PREFILL_HEADROOM

    reserved = 30 * math.ceil((prompt_tokens + PREFILL_HEADROOM) / 16) * 16 * 3 * 64 * 4 * 2
    segments = math.ceil(reserved / DEFAULT_SEGMENT_BYTES)  # the quick demo's decode fits
    assert mib["DynamicCache"] <= mib["PagedCache"] <= segments * DEFAULT_SEGMENT_BYTES / 2**20
    assert 0 < mib["TokenTableCache"] < 0.6 * mib["PagedCache"]
    # Blocks: whole 16-token blocks per layer; per-head tables (H2O) hold one KV head a block.
    assert int(rows["PagedCache"]["KV memory blocks"]) == 30 * math.ceil(stored / 16)
    assert int(rows["TokenTableCache"]["KV memory blocks"]) >= 30 * 3 * math.ceil(budget / 16)
    assert rows["DynamicCache"]["KV memory blocks"] == rows["DynamicCache"]["repacks"] == "—"
    assert rows["PagedCache"]["repacks"] == "0"
    assert int(rows["TokenTableCache"]["repacks"]) > 0  # half the prompt evicted at prefill
    for row in rows.values():
        speed = float(row["tokens/s"])
        assert math.isfinite(speed) and speed > 0, row
    assert "torch.compile time is excluded" in quick_output


def test_quick_demo_paged_cache_generates_dynamic_cache_text(quick_output):
    texts = generated_texts(quick_output)
    assert sorted(texts) == sorted(CACHES), quick_output
    assert texts["PagedCache"] == texts["DynamicCache"]
    assert texts["DynamicCache"].strip("'\"")  # something was generated
    assert f"PagedCache vs DynamicCache: identical tokens ({QUICK_NEW_TOKENS} of" in quick_output


def test_demo_with_model_path_prompt_file_policy_and_budget(quick_output, tmp_path):
    # The quick run has made the converted SmolLM2 copy: an ordinary Hugging Face model dir.
    model_dir = smollm2_cache_dir()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(
        "The north pier was rebuilt in 1911 with granite from the Carrow quarry. Its lamp "
        "shows a fixed green light, and the fog bell strikes twice every twenty seconds. "
        "Keepers record the tide at six in the morning and six in the evening.\n\n"
        "Question: what light does the north pier show?",
        encoding="utf-8",
    )
    printed = run_demo_cli(
        [
            "--model-path",
            str(model_dir),
            "--prompt-file",
            str(prompt),
            "--policy",
            "streamingllm",
            "--budget",
            "24",
            "--max-new-tokens",
            "2",
        ]
    )
    rows = table_rows(printed)
    assert rows["TokenTableCache"]["cache"] == "TokenTableCache (StreamingLLM, budget 24)"
    assert f"Prompt: {prompt}, " in printed
    assert f"Loading {model_dir} ..." in printed and f"\n{model_dir.name}: 30 attention" in printed
    assert float(rows["TokenTableCache"]["live tokens"]) == 24
    # StreamingLLM keeps one table per row (all KV heads): 24 live tokens in 16-token blocks.
    blocks = int(rows["TokenTableCache"]["KV memory blocks"])
    assert 30 * 2 <= blocks < int(rows["PagedCache"]["KV memory blocks"])
    assert int(rows["TokenTableCache"]["repacks"]) > 0
    assert generated_texts(printed)["PagedCache"] == generated_texts(printed)["DynamicCache"]


def test_every_option_reaches_the_demo(monkeypatch, tmp_path):
    # Wiring only (no model): a block size other than 16 would compile new graphs in a real run.
    (tmp_path / "config.json").write_text("{}")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Some text.\n\nQuestion: what?")
    received = []
    monkeypatch.setattr(demo, "run_demo", received.append)
    argv = ["--model-path", str(tmp_path), "--policy", "snapkv", "--budget", "40"]
    argv += ["--prompt-file", str(prompt), "--max-new-tokens", "5", "--block-size", "8", "--quick"]
    assert main(["demo", *argv]) == 0
    assert received == [
        demo.DemoOptions(
            model_path=tmp_path,
            policy="snapkv",
            budget=40,
            ratio=None,
            prompt_file=prompt,
            max_new_tokens=5,
            block_size=8,
            quick=True,
        )
    ]
    assert demo.check_options(received[0]) == received[0]  # complete: nothing left to default
    defaults = demo.check_options(demo.DemoOptions())
    assert (defaults.ratio, defaults.max_new_tokens, defaults.block_size) == (0.5, 64, 16)


def test_quick_prompt_keeps_the_question():
    text, source = read_prompt(None, quick=True)
    full, _ = read_prompt(None, quick=False)
    assert len(text) < len(full) / 4
    assert text.endswith(full.rpartition("\n\n")[2]) and text.rsplit("\n\n")[-1].startswith(
        "Question:"
    )
    assert "shortened" in source


def test_every_policy_name_builds_a_policy():
    from kvstack.bench.quality import POLICIES
    from kvstack.policies import BY_NAME

    # The names the CLI offers (kept import-light in kvstack.demo) are the registry's.
    assert POLICY_NAMES == tuple(BY_NAME) == POLICIES
    for name in POLICY_NAMES:
        assert type(make_policy(name)) is BY_NAME[name], name
        assert isinstance(make_policy(name), EvictionPolicy), name


# ---------------------------------------------------------------------------------------------
# Bad options: exit status 2, a message naming the option and the value, nothing run. One rule per
# option (kvstack.demo.check_option) words the message for the CLI and the Python API alike.


def shown(text: str, parse) -> str:
    """How the rule names a command-line value: as parsed (``0.0``), or the text if unparsable."""
    try:
        return repr(parse(text))
    except ValueError:
        return repr(text)


def rejected(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as error:
        main(["demo", *argv])
    assert error.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing was loaded or run
    return captured.err


def test_unknown_policy_is_rejected(capsys):
    err = rejected(capsys, ["--policy", "lru"])
    assert "argument --policy" in err and "'lru'" in err and "h2o" in err


@pytest.mark.parametrize("value", ["0", "-3", "many", "2.5"])
def test_budget_that_is_not_a_positive_integer_is_rejected(capsys, value):
    err = rejected(capsys, ["--budget", value])
    assert "argument --budget" in err and f"budget={shown(value, int)};" in err
    assert "expected an integer >= 1" in err


def test_budget_below_what_the_policy_keeps_is_rejected(capsys):
    err = rejected(capsys, ["--policy", "streamingllm", "--budget", "3"])
    assert "budget=3" in err and ">= 5" in err and "StreamingLLM" in err


@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "nan", "half"])
def test_ratio_out_of_range_is_rejected(capsys, value):
    err = rejected(capsys, ["--ratio", value])
    assert "argument --ratio" in err and f"ratio={shown(value, float)};" in err
    assert "expected a number in (0, 1]" in err


def test_budget_and_ratio_together_are_rejected(capsys):
    err = rejected(capsys, ["--budget", "64", "--ratio", "0.5"])
    assert "budget=64 and ratio=0.5 were both given; expected one of them" in err


def test_missing_prompt_file_is_rejected(capsys, tmp_path):
    missing = tmp_path / "no-such-prompt.txt"
    err = rejected(capsys, ["--prompt-file", str(missing)])
    assert "argument --prompt-file" in err and str(missing) in err and "does not exist" in err


def test_prompt_file_that_is_a_directory_is_rejected(capsys, tmp_path):
    err = rejected(capsys, ["--prompt-file", str(tmp_path)])
    assert "argument --prompt-file" in err and str(tmp_path) in err and "not a file" in err


@pytest.mark.parametrize("content", [b"", b"  \n\n ", b"\xff\xfe caf\xe9"])
def test_empty_or_undecodable_prompt_file_is_rejected(capsys, tmp_path, content):
    path = tmp_path / "prompt.txt"
    path.write_bytes(content)
    err = rejected(capsys, ["--prompt-file", str(path)])
    assert f"prompt_file={str(path)!r}" in err and ("empty" in err or "UTF-8" in err)


def test_model_path_without_a_model_is_rejected(capsys, tmp_path):
    err = rejected(capsys, ["--model-path", str(tmp_path)])
    assert "argument --model-path" in err and str(tmp_path) in err and "config.json" in err


@pytest.mark.parametrize("option", ["--max-new-tokens", "--block-size"])
def test_sizes_below_one_are_rejected(capsys, option):
    err = rejected(capsys, [option, "0"])
    name = option.removeprefix("--").replace("-", "_")
    assert f"argument {option}" in err and f"{name}=0; expected an integer >= 1" in err


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("policy", "lru", "policy='lru'; expected one of h2o"),
        ("budget", 0, "budget=0; expected an integer >= 1"),
        ("budget", 2.5, "budget=2.5; expected an integer >= 1"),
        ("ratio", 1.5, "ratio=1.5; expected a number in (0, 1]"),
        ("ratio", float("nan"), "ratio=nan; expected a number in (0, 1]"),
        ("max_new_tokens", 0, "max_new_tokens=0; expected an integer >= 1"),
        ("block_size", True, "block_size=True; expected an integer >= 1"),
        ("prompt_file", "/no/such/prompt.txt", "prompt_file='/no/such/prompt.txt' does not exist"),
        ("model_path", "/no/such/model", "model_path='/no/such/model' is not a directory"),
    ],
)
def test_python_api_is_refused_by_the_same_rules(field, value, expected):
    with pytest.raises(InvalidArgumentError) as caught:
        demo.run_demo(demo.DemoOptions(**{field: value}), say=pytest.fail)
    assert expected in str(caught.value)


def test_python_api_refuses_a_budget_the_policy_cannot_keep_and_both_sizes():
    with pytest.raises(InvalidArgumentError, match=r"budget=3; expected an integer >= 5"):
        demo.check_options(demo.DemoOptions(policy="streamingllm", budget=3))
    with pytest.raises(InvalidArgumentError, match="were both given; expected one of them"):
        demo.check_options(demo.DemoOptions(budget=64, ratio=0.5))
