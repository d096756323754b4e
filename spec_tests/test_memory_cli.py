"""``kvstack memory``: the example conversation file round-trips, a file with a bad entry is
refused naming it, and the command answers questions from a saved and reopened memory."""

from __future__ import annotations

import json

import pytest

from kvstack.cli import main
from kvstack.errors import InvalidArgumentError
from kvstack.memory_demo import load_conversation


def test_the_example_conversation_file_loads_back_as_the_evaluation_set(tmp_path):
    from kvstack.bench.conversations import generate_conversations

    path = tmp_path / "conversation.json"
    assert main(["memory", "--write-example", str(path)]) == 0
    loaded, original = load_conversation(path), generate_conversations(seed=0)
    assert [f.text for f in loaded.facts] == [f.text for f in original.facts]
    assert [q.answers for q in loaded.questions] == [q.answers for q in original.questions]
    fact = loaded.facts[7]
    assert loaded.turns_before(fact, 3) == original.turns_before(original.facts[7], 3)


@pytest.mark.parametrize(
    "record,message",
    [
        ({"sessions": [], "facts": [], "questions": []}, "at least one fact"),
        ({"sessions": [{"turns": ["a"]}], "facts": [{"session": 0, "turn": 4, "text": "x"}],
          "questions": [{"text": "q"}]}, r"facts\[0\]: session 0, turn 4 does not exist"),
        ({"sessions": [{"turns": "a"}]}, r"sessions\[0\]: expected a list field 'turns'"),
        ({"facts": []}, "expected a list field 'sessions'"),
        ({"sessions": [{"turns": ["a"]}], "facts": [{"session": 0, "turn": 0, "text": "x"}],
          "questions": [{"text": "q", "answers": "Biscuit"}]},
         r"questions\[0\]: answers='Biscuit'; expected a list of non-empty strings"),
        ({"sessions": [{"turns": ["a"]}], "facts": [{"session": 0, "turn": 0, "text": "x"}],
          "questions": [{"text": "q", "answers": ["a"], "category": 3}]},
         r"questions\[0\]: category=3; expected a string"),
    ],
)  # fmt: skip
def test_a_bad_conversation_file_is_refused_naming_the_entry(tmp_path, record, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(record))
    with pytest.raises(InvalidArgumentError, match=message):
        load_conversation(path)
    path.write_text("{not json")
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        load_conversation(path)


def test_memory_answers_questions_and_reopens_its_store(tmp_path, capsys):
    path, store = tmp_path / "conversation.json", tmp_path / "store"
    path.write_text(
        json.dumps(
            {
                "sessions": [
                    {"date": "2024-05-03", "turns": ["Tom: Hi!", "Maya: My dog is Biscuit."]},
                    {"date": "2024-05-09", "turns": ["Maya: I moved to Lisbon."]},
                ],
                "facts": [
                    {"session": 0, "turn": 1, "text": "Maya's dog is named Biscuit."},
                    {"session": 1, "turn": 0, "text": "Maya lives in Lisbon."},
                ],
                "questions": [{"text": "What is Maya's dog called?", "answers": ["Biscuit"]}],
            }
        )
    )
    args = ["memory", "--conversation", str(path), "-k", "2", "--store", str(store)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "2 facts encoded (w = 5)" in first and "What is Maya's dog called? ->" in first
    assert "median time to first token with 2 facts" in first
    assert main(args) == 0  # the second run reopens the saved memory instead of encoding
    assert "2 facts reopened from" in capsys.readouterr().out
    # The same store with another conversation's facts is refused, and left as it was.
    files = {f.name: f.read_bytes() for f in store.iterdir()}
    record = json.loads(path.read_text())
    record["facts"][1]["text"] = "Maya lives in Porto."
    other = tmp_path / "other.json"
    other.write_text(json.dumps(record))
    with pytest.raises(InvalidArgumentError, match="not this conversation's 2; give a new"):
        main(["memory", "--conversation", str(other), "-k", "2", "--store", str(store)])
    assert {f.name: f.read_bytes() for f in store.iterdir()} == files
