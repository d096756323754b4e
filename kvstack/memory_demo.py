"""``kvstack memory``: a fact memory built from a conversation file, questions answered with the
facts' K/V injected, and each question's time to first token against prefilling the facts' text.

The conversation file is JSON (``kvstack memory --write-example FILE`` writes one, the evaluation
set of ``kvstack.bench.conversations``):

    {"sessions":  [{"date": "2024-05-03", "turns": ["Maya: ...", "Tom: ...", ...]}, ...],
     "facts":     [{"session": 0, "turn": 1, "text": "Maya's dog is named Biscuit."}, ...],
     "questions": [{"text": "What is the name of Maya's dog?", "answers": ["Biscuit"]}, ...]}

Each fact is added with the turns before it as context (``context_turns`` of them); each
question retrieves ``k`` facts and is answered twice over the same token ids, facts injected and
facts prefilled; the first is printed with its answer.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvstack.errors import InvalidArgumentError

SYSTEM = "Answer the question with a short phrase taken from the notes."
ANSWER_TOKENS = 12


def _field(record: Any, name: str, kind: type, where: str) -> Any:
    if not isinstance(record, dict) or not isinstance(record.get(name), kind):
        raise InvalidArgumentError(f"{where}: expected a {kind.__name__} field {name!r}")
    return record[name]


def load_conversation(path: str | Path) -> Any:
    """The conversation file at ``path`` as an ``EvaluationSet``; errors name the entry."""
    from kvstack.bench.conversations import EvaluationSet, Fact, Question, Session

    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise InvalidArgumentError(
            f"conversation file {str(path)!r} cannot be read: {error}"
        ) from None
    sessions = []
    for index, entry in enumerate(_field(record, "sessions", list, str(path))):
        where = f"{path}: sessions[{index}]"
        turns = _field(entry, "turns", list, where)
        if not all(isinstance(t, str) for t in turns):
            raise InvalidArgumentError(f"{where}: every turn must be a string")
        sessions.append(Session(index, str(entry.get("date", "")), turns))
    facts = []
    for index, entry in enumerate(_field(record, "facts", list, str(path))):
        where = f"{path}: facts[{index}]"
        session, turn = _field(entry, "session", int, where), _field(entry, "turn", int, where)
        text = _field(entry, "text", str, where)
        if not (0 <= session < len(sessions) and 0 <= turn < len(sessions[session].turns)):
            raise InvalidArgumentError(f"{where}: session {session}, turn {turn} does not exist")
        facts.append(Fact(f"s{session}.t{turn}", text, session, turn, sessions[session].date))
    questions = []
    for index, entry in enumerate(_field(record, "questions", list, str(path))):
        where = f"{path}: questions[{index}]"
        text = _field(entry, "text", str, where)
        answers = entry.get("answers", [])
        # A bare string would be read as its letters, and any answer holding one would score.
        if not isinstance(answers, list) or not all(isinstance(a, str) and a for a in answers):
            raise InvalidArgumentError(
                f"{where}: answers={answers!r}; expected a list of non-empty strings"
            )
        category = entry.get("category", "")
        if not isinstance(category, str):
            raise InvalidArgumentError(f"{where}: category={category!r}; expected a string")
        questions.append(Question(f"q{index}", text, answers, category, []))
    if not facts or not questions:
        raise InvalidArgumentError(f"{path}: expected at least one fact and one question")
    return EvaluationSet(sessions, facts, questions)


def write_example(path: str | Path) -> None:
    """The evaluation set of ``kvstack.bench.conversations`` (seed 0) as a conversation file."""
    from kvstack.bench.conversations import generate_conversations

    conversation = asdict(generate_conversations(seed=0))
    conversation["facts"] = [
        {"session": f["session"], "turn": f["turn"], "text": f["text"]}
        for f in conversation["facts"]
    ]
    conversation["questions"] = [
        {"text": q["text"], "answers": q["answers"], "category": q["category"]}
        for q in conversation["questions"]
    ]
    Path(path).write_text(json.dumps(conversation, indent=1))


def run_memory_demo(
    conversation: str | Path | None = None,
    *,
    questions: int = 10,
    k: int = 5,
    context_turns: int = 5,
    store: str | Path | None = None,
    model: Any = None,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Build the memory, answer ``questions`` questions, print a line each and a summary;
    returns the summary (median TTFTs, their ratio, accuracy where answers are given)."""
    from transformers import DynamicCache

    from kvstack.bench.conversations import generate_conversations, score
    from kvstack.facts.memory import FactMemory
    from kvstack.models import load_smollm2
    from kvstack.transformers_compat import cache_keyword

    evaluation = (
        generate_conversations(seed=0) if conversation is None else load_conversation(conversation)
    )
    if model is None:
        model, tokenizer = load_smollm2()
    model.set_attn_implementation("sdpa")
    memory = FactMemory(model, tokenizer, path=store, context_turns=context_turns)
    if len(memory) == 0:
        started = time.perf_counter()
        memory.add_many(
            [f.text for f in evaluation.facts],
            [evaluation.turns_before(f, context_turns) for f in evaluation.facts],
        )
        print(
            f"{len(memory)} facts encoded (w = {context_turns}) in "
            f"{time.perf_counter() - started:.1f} s"
        )
        if store is not None:
            memory.save()
    else:
        # A store answers for the conversation it was built from: facts from another file
        # would be retrieved and injected as if they were this one's.
        stored = [fact.text for fact in memory.facts.values()]
        if stored != [f.text for f in evaluation.facts]:
            raise InvalidArgumentError(
                f"store={str(store)!r} holds {len(stored)} facts that are not this conversation's "
                f"{len(evaluation.facts)}; give a new --store directory to build one for it"
            )
        print(f"{len(memory)} facts reopened from {store}")
    k = min(k, len(memory))
    rows, ttfts = [], {"inject": [], "prefill": []}
    for question in evaluation.questions[:questions]:
        header = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nNotes:\n"
        tail = f"Question: {question.text}<|im_end|>\n<|im_start|>assistant\n"
        fact_ids = memory.retrieve(question.text, k)
        with torch.inference_mode():
            start = time.perf_counter()
            cache, ids = memory.build_cache(header, fact_ids, tail)
            model(ids[:, cache.get_seq_length() :], **{cache_keyword(model): cache})
            ttfts["inject"].append(time.perf_counter() - start)
            start = time.perf_counter()
            model(ids, **{cache_keyword(model): DynamicCache(config=model.config)})
            ttfts["prefill"].append(time.perf_counter() - start)
            cache, ids = memory.build_cache(header, fact_ids, tail)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                out = model.generate(
                    ids,
                    past_key_values=cache,
                    max_new_tokens=ANSWER_TOKENS,
                    do_sample=False,
                    pad_token_id=tokenizer.eos_token_id,
                )
        answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        correct = score(answer, question) if question.answers else None
        rows.append(correct)
        mark = {True: "right", False: "wrong", None: ""}[correct]
        print(
            f"[{ttfts['inject'][-1] * 1e3:5.0f} ms injected | {ttfts['prefill'][-1] * 1e3:5.0f} "
            f"ms prefilled, {ids.shape[1]} tokens] {question.text} -> {answer!r} {mark}"
        )
    summary = {
        "ttft_inject_s": statistics.median(ttfts["inject"]),
        "ttft_prefill_s": statistics.median(ttfts["prefill"]),
    }
    summary["ttft_speedup"] = summary["ttft_prefill_s"] / summary["ttft_inject_s"]
    scored = [r for r in rows if r is not None]
    summary["accuracy"] = sum(scored) / len(scored) if scored else None
    accuracy = "" if summary["accuracy"] is None else f"; {summary['accuracy']:.0%} answered right"
    print(
        f"median time to first token with {k} facts: {summary['ttft_inject_s'] * 1e3:.0f} ms "
        f"injected, {summary['ttft_prefill_s'] * 1e3:.0f} ms prefilled "
        f"({summary['ttft_speedup']:.1f}x){accuracy}"
    )
    return summary


__all__ = ["load_conversation", "run_memory_demo", "write_example"]
