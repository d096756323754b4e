"""The long-context retrieval set of the quality benchmark (``bench/quality.py``), built offline.

Three kinds of item, each a context, a question placed after it, and a short answer that appears
verbatim in the context (scoring: an answer string appears in the model's output, any case):

* ``passkey``: "The pass key is NNNNN. Remember it." hidden at a given depth in filler text
  (real, varied paragraphs from ``data/quality/filler.txt``, in a seeded order); the answer is
  the five-digit number.
* ``needle``: "The special magic word for <city> is <word>." hidden the same way; the answer is
  the word.
* ``qa``: a short factual passage about a fictional company, person or place
  (``data/quality/passages.txt``) among other such passages (distractors of the same form) and
  filler paragraphs; the question asks for one attribute (a year, a name, a colour ...).

Everything is decided by ``seed``: item *i* of a kind draws from
``random.Random(f"{seed}/{kind}/{i}")``, so an item does not change when the counts of other
kinds change. Lengths are set in words (tokenizer-independent): contexts of
``MIN_WORDS``-``MAX_WORDS`` words, which SmolLM2's tokenizer turns into 695-1317 tokens with the
chat template, question and answer prefix (the spec test checks 600-1500 with the real
tokenizer). Depths of the fact (its word offset / the context's words) are spread evenly over
``[0.05, 0.95]`` per kind, in a seeded order, so they depend on the count of that kind.

Held-out texts for the NLL figure (``heldout_*.txt``) share no text with the items.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from kvstack.errors import InvalidArgumentError

DATA_DIR = Path(__file__).resolve().parent / "data" / "quality"
KINDS = ("passkey", "needle", "qa")
DEFAULT_COUNTS = {"passkey": 20, "needle": 20, "qa": 24}
MIN_WORDS, MAX_WORDS = 520, 1000
SEED = 0

CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Toronto", "Krakow", "Lima", "Tbilisi", "Hanoi", "Dublin",
    "Marrakesh", "Oslo", "Santiago", "Bergen", "Adelaide", "Quito", "Tallinn", "Seville",
    "Winnipeg", "Valletta", "Kyoto", "Reykjavik", "Bordeaux", "Cusco", "Zanzibar",
)  # fmt: skip
MAGIC_WORDS = (
    "pineapple", "saxophone", "volcano", "umbrella", "kangaroo", "marmalade", "telescope",
    "cinnamon", "harpoon", "dragonfly", "avalanche", "trampoline", "pretzel", "flamingo",
    "accordion", "cactus", "igloo", "lollipop", "tornado", "walrus", "xylophone", "zeppelin",
    "porcupine", "kaleidoscope",
)  # fmt: skip


@dataclass(frozen=True)
class QualityItem:
    """One question over a long context. ``answers``: accepted strings (the first is canonical)."""

    id: str
    kind: str
    context: str
    question: str
    answer_prefix: str  # opens the assistant turn, so that the answer comes first
    answers: tuple[str, ...]
    depth: float  # word offset of the fact / words in the context

    @property
    def answer(self) -> str:
        return self.answers[0]

    @property
    def prompt(self) -> str:
        """The user turn: the context, then the question."""
        return f"{self.context}\n\n{self.question}"

    def is_correct(self, output: str) -> bool:
        """``output``: the generated text after ``answer_prefix``."""
        text = output.lower()
        return any(answer.lower() in text for answer in self.answers)


@dataclass(frozen=True)
class Question:
    question: str
    answer_prefix: str  # the answer's opening words, restating the question (a cloze)
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Passage:
    text: str
    questions: tuple[Question, ...]


# --------------------------------------------------------------------------- source texts
def filler_paragraphs() -> list[str]:
    return _paragraphs((DATA_DIR / "filler.txt").read_text())


def passages() -> list[Passage]:
    """``passages.txt``: blocks separated by blank lines; a block is the passage's text line(s)
    followed by question triples: ``Q: question``, ``P: answer prefix``, ``A: answer [| alias]``."""
    result = []
    for block in _paragraphs((DATA_DIR / "passages.txt").read_text(), join=False):
        text_lines, tags, fields = [], [], []
        for line in block:
            if line[:3] in ("Q: ", "P: ", "A: "):
                tags.append(line[0])
                fields.append(line[3:].strip())
            else:
                text_lines.append(line)
        if not tags or "".join(tags) != "QPA" * (len(tags) // 3):
            raise InvalidArgumentError(
                f"passages.txt: expected Q:, P:, A: lines after the passage {block[0][:60]!r}"
            )
        questions = tuple(
            Question(q, prefix, tuple(a.strip() for a in answers.split("|") if a.strip()))
            for q, prefix, answers in zip(fields[::3], fields[1::3], fields[2::3], strict=True)
        )
        result.append(Passage(" ".join(text_lines), questions))
    return result


def heldout_texts() -> dict[str, str]:
    """Name -> text of each held-out text (``heldout_<name>.txt``), sorted by name."""
    return {
        path.stem.removeprefix("heldout_"): path.read_text().strip()
        for path in sorted(DATA_DIR.glob("heldout_*.txt"))
    }


def _paragraphs(text: str, *, join: bool = True) -> list:
    blocks = [b.strip().splitlines() for b in re.split(r"\n\s*\n", text) if b.strip()]
    return [" ".join(line.strip() for line in b) for b in blocks] if join else blocks


def _sentences(paragraph: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", paragraph.strip())


def _words(text: str) -> int:
    return len(text.split())


# --------------------------------------------------------------------------- assembly
def _haystack(
    rng: random.Random, words: int, fact: str, depth: float, exclude: tuple[str, ...]
) -> tuple[str, float]:
    """Filler paragraphs in a seeded order, cut to ~``words`` words at a sentence end, with
    ``fact`` inserted at the sentence boundary nearest ``depth``. Returns (text, actual depth)."""
    paragraphs = [
        p for p in filler_paragraphs() if not any(e.lower() in p.lower() for e in exclude)
    ]
    rng.shuffle(paragraphs)
    kept: list[list[str]] = []  # paragraphs as sentence lists
    total = 0
    for paragraph in paragraphs:
        sentences = []
        for sentence in _sentences(paragraph):
            if total >= words:
                break
            sentences.append(sentence)
            total += _words(sentence)
        if sentences:
            kept.append(sentences)
        if total >= words:
            break
    if total < words:
        raise InvalidArgumentError(f"filler.txt holds fewer than words={words} words")
    # Sentence boundaries as (paragraph, index), each with its word offset; pick the nearest.
    boundaries, offset = [], 0
    for p, sentences in enumerate(kept):
        for s, sentence in enumerate(sentences):
            boundaries.append((abs(offset - depth * total), p, s, offset))
            offset += _words(sentence)
    _, p, s, at = min(boundaries)
    kept[p].insert(s, fact)
    return "\n\n".join(" ".join(sentences) for sentences in kept), at / (total + _words(fact))


def _depths(rng: random.Random, count: int) -> list[float]:
    depths = [0.05 + 0.9 * i / max(count - 1, 1) for i in range(count)]
    rng.shuffle(depths)
    return depths


def _passkey_items(seed: int, count: int, words: tuple[int, int]) -> list[QualityItem]:
    depths = _depths(random.Random(f"{seed}/passkey/depths"), count)
    items = []
    for i in range(count):
        rng = random.Random(f"{seed}/passkey/{i}")
        key = str(rng.randint(10000, 99999))
        length = rng.randint(*words)
        fact = f"The pass key is {key}. Remember it."
        context, depth = _haystack(rng, length, fact, depths[i], exclude=(key,))
        items.append(
            QualityItem(
                id=f"passkey-{i:02d}",
                kind="passkey",
                context=context,
                # Without "number only" and "five-digit" SmolLM2 often defines a pass key.
                question="What is the pass key? Answer with the number only.",
                answer_prefix="The five-digit pass key is",
                answers=(key,),
                depth=depth,
            )
        )
    return items


def _needle_items(seed: int, count: int, words: tuple[int, int]) -> list[QualityItem]:
    depths = _depths(random.Random(f"{seed}/needle/depths"), count)
    pairs = [(c, w) for c in CITIES for w in MAGIC_WORDS]
    random.Random(f"{seed}/needle/pairs").shuffle(pairs)
    items, used_cities = [], set()
    for city, word in pairs:
        if len(items) == count:
            break
        if city in used_cities or any(word == it.answer for it in items):
            continue
        used_cities.add(city)
        i = len(items)
        rng = random.Random(f"{seed}/needle/{i}")
        length = rng.randint(*words)
        fact = f"The special magic word for {city} is {word}."
        context, depth = _haystack(rng, length, fact, depths[i], exclude=(word, city))
        items.append(
            QualityItem(
                id=f"needle-{i:02d}",
                kind="needle",
                context=context,
                question=f"What is the special magic word for {city}? Answer with the word only.",
                answer_prefix=f"The special magic word for {city} is",
                answers=(word,),
                depth=depth,
            )
        )
    if len(items) < count:
        raise InvalidArgumentError(f"at most {len(items)} needle items, got count={count}")
    return items


def _qa_items(seed: int, count: int, words: tuple[int, int]) -> list[QualityItem]:
    all_passages = passages()
    filler = filler_paragraphs()
    questions = [(p, q) for p, passage in enumerate(all_passages) for q in passage.questions]
    if count > len(questions):
        raise InvalidArgumentError(f"at most {len(questions)} qa items, got count={count}")
    random.Random(f"{seed}/qa/questions").shuffle(questions)
    depths = _depths(random.Random(f"{seed}/qa/depths"), count)
    items = []
    for i, (target, question) in enumerate(questions[:count]):
        rng = random.Random(f"{seed}/qa/{i}")
        length = rng.randint(*words)
        # Distractors: about half the context is other fictional passages, the rest filler.
        others = [p.text for j, p in enumerate(all_passages) if j != target]
        rng.shuffle(others)
        pool = list(filler)
        rng.shuffle(pool)
        chosen, total = [], _words(all_passages[target].text)
        while total < length:
            source = others if (len(chosen) % 2 == 0 and others) or not pool else pool
            chosen.append(source.pop())
            total += _words(chosen[-1])
        # Put the target at the paragraph boundary nearest the drawn depth.
        offsets, offset = [], 0
        for paragraph in chosen:
            offsets.append(offset)
            offset += _words(paragraph)
        offsets.append(offset)
        at = min(range(len(offsets)), key=lambda k: abs(offsets[k] - depths[i] * total))
        chosen.insert(at, all_passages[target].text)
        items.append(
            QualityItem(
                id=f"qa-{i:02d}",
                kind="qa",
                context="\n\n".join(chosen),
                question=question.question,
                answer_prefix=question.answer_prefix,
                answers=question.answers,
                depth=offsets[at] / total,
            )
        )
    return items


def build_items(
    counts: dict[str, int] | None = None,
    *,
    seed: int = SEED,
    words: tuple[int, int] = (MIN_WORDS, MAX_WORDS),
) -> list[QualityItem]:
    """The items, in kind order (passkey, needle, qa); same arguments, same items.

    ``counts``: items per kind (default ``DEFAULT_COUNTS``); ``words``: the range the context
    lengths are drawn from, in words."""
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    low, high = words
    if not 0 < low <= high:
        raise InvalidArgumentError(f"words must be (low, high) with 0 < low <= high, got {words!r}")
    unknown = set(counts) - set(KINDS)
    if unknown:
        raise InvalidArgumentError(f"counts names unknown kinds {sorted(unknown)}; kinds: {KINDS}")
    for kind, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgumentError(f"counts[{kind!r}] must be an integer >= 0, got {n!r}")
    builders = {"passkey": _passkey_items, "needle": _needle_items, "qa": _qa_items}
    return [item for kind in KINDS for item in builders[kind](seed, counts.get(kind, 0), words)]


def check_sources() -> None:
    """Every QA answer appears in its own passage and in no other passage or filler paragraph
    (so a distractor cannot supply it), and no item text leaks into the held-out texts."""
    all_passages = passages()
    filler = filler_paragraphs()
    for p, passage in enumerate(all_passages):
        for q in passage.questions:
            canonical = q.answers[0].lower()
            if canonical not in passage.text.lower():
                raise AssertionError(
                    f"answer {q.answers[0]!r} of {q.question!r} not in its passage"
                )
            if canonical in q.answer_prefix.lower():
                raise AssertionError(f"answer prefix of {q.question!r} gives the answer away")
            for other in [o.text for j, o in enumerate(all_passages) if j != p] + filler:
                if re.search(rf"\b{re.escape(canonical)}\b", other.lower()):
                    raise AssertionError(
                        f"answer {q.answers[0]!r} of {q.question!r} also in: {other[:60]!r}"
                    )
