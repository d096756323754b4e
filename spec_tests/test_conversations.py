"""The fact-memory evaluation set (``bench/conversations.py``).

It must be reproducible (same seed, same set; another seed, another set), large enough (>= 100
questions, >= 25 per category), answerable by copying (every answer is in one of its question's
facts, every fact is in the turn it names) and consistent with its own timeline (sessions and
dated events in order). ``turns_before`` must give the context a memory would store with a fact,
and scoring must be SQuAD-style whole-word matching.
"""

from __future__ import annotations

from collections import Counter
from datetime import date

import pytest

from kvstack.bench import conversations
from kvstack.bench.conversations import (
    CATEGORIES,
    EvaluationSet,
    Question,
    accuracy,
    generate_conversations,
    normalize_answer,
    score,
)
from kvstack.errors import InvalidArgumentError


@pytest.fixture(scope="module")
def evaluation_set() -> EvaluationSet:
    return generate_conversations()


def all_turns(evaluation_set: EvaluationSet) -> list[str]:
    return [turn for session in evaluation_set.sessions for turn in session.turns]


def question(answers: list[str], category: str = "single_hop", qid: str = "q") -> Question:
    return Question(qid, "?", answers, category, ["s0.t0"])


def test_the_same_seed_gives_the_same_set_and_another_seed_another():
    assert generate_conversations(0) == generate_conversations(0)
    assert generate_conversations(7) == generate_conversations(7)
    assert generate_conversations(0) != generate_conversations(1)
    assert generate_conversations(0).questions != generate_conversations(1).questions


def test_the_default_set_is_large_enough_in_every_category(evaluation_set):
    counts = Counter(q.category for q in evaluation_set.questions)
    assert set(counts) == set(CATEGORIES)
    assert sum(counts.values()) >= 100
    assert all(count >= 25 for count in counts.values()), counts
    assert len({q.id for q in evaluation_set.questions}) == len(evaluation_set.questions)
    # One question, one answer: two questions with the same words would be ambiguous.
    assert len({q.text for q in evaluation_set.questions}) == len(evaluation_set.questions)


def test_questions_name_existing_facts_and_enough_of_them(evaluation_set):
    fact_ids = {fact.id for fact in evaluation_set.facts}
    assert len(fact_ids) == len(evaluation_set.facts)
    for q in evaluation_set.questions:
        assert q.category in CATEGORIES
        assert set(q.fact_ids) <= fact_ids, q
        assert len(set(q.fact_ids)) == len(q.fact_ids)
        if q.category == "single_hop":
            assert len(q.fact_ids) == 1, q
        if q.category == "multi_hop":
            assert len(q.fact_ids) >= 2, q
        assert [f.id for f in evaluation_set.facts_of(q)] == q.fact_ids


def test_every_answer_can_be_copied_from_a_fact_of_its_question(evaluation_set):
    for q in evaluation_set.questions:
        texts = [fact.text.lower() for fact in evaluation_set.facts_of(q)]
        assert q.answers and all(answer.strip() for answer in q.answers), q
        # The canonical answer is verbatim; so is every other, except a date written another way.
        assert any(q.answers[0].lower() in text for text in texts), q
        day = _parse_written_date(q.answers[0])
        for answer in q.answers[1:]:
            if day is None:
                assert any(answer.lower() in text for text in texts), (answer, q)
            else:
                month = conversations.MONTHS[day.month - 1]
                assert answer in (day.isoformat(), f"{month} {day.day}, {day.year}"), q
        # Scoring accepts the fact's own words for every answer form.
        assert score(q.answers[0], q)


def _parse_written_date(text: str) -> date | None:
    """ "3 May 2024" -> date(2024, 5, 3); anything else -> None."""
    parts = text.split()
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in conversations.MONTHS:
        return None
    return date(int(parts[2]), conversations.MONTHS.index(parts[1]) + 1, int(parts[0]))


def test_facts_sit_in_the_turns_they_name(evaluation_set):
    for fact in evaluation_set.facts:
        session = evaluation_set.sessions[fact.session]
        assert session.index == fact.session
        assert fact.date == session.date
        assert fact.id == f"s{fact.session}.t{fact.turn}"
        assert 0 <= fact.turn < len(session.turns)
        assert fact.text in session.turns[fact.turn]
        assert len(fact.text.split()) <= 25


@pytest.mark.parametrize("people", [2, 10])
def test_nobody_states_a_fact_about_themselves(people):
    # With 2 people every session's speakers are named in its facts: the other one says them.
    evaluation_set = generate_conversations(people=people, sessions=4)
    for fact in evaluation_set.facts:
        speaker = evaluation_set.sessions[fact.session].turns[fact.turn].split(":", 1)[0]
        assert not fact.text.startswith((f"{speaker}'s", f"{speaker} ")), fact
        assert f" {speaker} " not in f" {fact.text} ", fact


def test_turns_are_lines_of_two_speakers_per_session(evaluation_set):
    for session in evaluation_set.sessions:
        speakers = {turn.split(": ", 1)[0] for turn in session.turns}
        assert len(speakers) == 2, session.index
        assert all(s in conversations.CAST for s in speakers)
        # Filler between the facts: more turns than facts.
        facts_here = [f for f in evaluation_set.facts if f.session == session.index]
        assert len(session.turns) > 2 * len(facts_here)


def test_session_dates_increase_and_dated_events_follow_them(evaluation_set):
    days = [date.fromisoformat(session.date) for session in evaluation_set.sessions]
    assert [s.index for s in evaluation_set.sessions] == list(range(len(days)))
    assert days == sorted(set(days))  # strictly increasing
    for q in evaluation_set.questions:
        day = _parse_written_date(q.answers[0])
        if day is None:
            continue
        assert q.category == "temporal"
        (fact,) = evaluation_set.facts_of(q)
        # The event happened before it was told, and after the previous session.
        assert day <= date.fromisoformat(fact.date)
        if fact.session > 0:
            assert day > days[fact.session - 1]


def test_before_and_now_questions_follow_the_order_of_the_moves(evaluation_set):
    asked = [q for q in evaluation_set.questions if q.id.endswith((".city.before", ".city.now"))]
    assert len(asked) == 2 * 10
    for q in asked:
        first, second = evaluation_set.facts_of(q)
        assert first.session < second.session
        expected = first if q.id.endswith(".before") else second
        assert q.answers[0] in expected.text
        assert q.answers[0] not in (second if expected is first else first).text


def test_turns_before_gives_the_w_preceding_turns_oldest_first(evaluation_set):
    turns = all_turns(evaluation_set)
    offsets = [0]
    for session in evaluation_set.sessions:
        offsets.append(offsets[-1] + len(session.turns))
    for fact in evaluation_set.facts:
        position = offsets[fact.session] + fact.turn
        for w in (0, 1, 3, 8, 40):
            before = evaluation_set.turns_before(fact, w)
            assert len(before) == min(w, position)
            assert before == turns[position - len(before) : position]
    assert evaluation_set.turns_before(evaluation_set.facts[0], 0) == []
    # A fact early in a later session reaches back into the previous one.
    second_session_fact = next(f for f in evaluation_set.facts if f.session == 1)
    reaching_back = evaluation_set.turns_before(second_session_fact, second_session_fact.turn + 2)
    assert reaching_back[:2] == evaluation_set.sessions[0].turns[-2:]
    with pytest.raises(InvalidArgumentError):
        evaluation_set.turns_before(evaluation_set.facts[0], -1)


def test_normalize_answer_is_squad_style():
    assert normalize_answer("The  Red Ball!") == "red ball"
    assert normalize_answer("An apple, a pear; THE end.") == "apple pear end"
    assert normalize_answer("theatre") == "theatre"  # an article only as a whole word


def test_score_matches_whole_words_ignoring_case_articles_and_punctuation():
    lisbon = question(["Lisbon"])
    assert score("Lisbon", lisbon)
    assert score("She moved to LISBON.", lisbon)
    assert not score("Lisbonne", lisbon)
    assert not score("Lisbo", lisbon)
    assert not score("", lisbon)
    toy = question(["a red ball", "red ball"], "multi_hop")
    assert score("The red ball!", toy)
    assert score("It is a red, ball", toy)
    assert not score("a red balloon", toy)
    day = question(["3 May 2024", "May 3, 2024", "2024-05-03"], "temporal")
    assert score("On 3 May 2024.", day)
    assert score("may 3 2024", day)
    assert score("2024-05-03", day)
    assert not score("13 May 2024", day)
    number = question(["95"])
    assert score("House 95", number)
    assert not score("1995", number)


def test_accuracy_is_overall_and_per_category(evaluation_set):
    questions = evaluation_set.questions
    right_single_hop = {q.id: q.answers[0] for q in questions if q.category == "single_hop"}
    wrong_temporal = {q.id: "Lisbonne" for q in questions if q.category == "temporal"}
    result = accuracy({**right_single_hop, **wrong_temporal}, questions)  # multi-hop: missing
    assert set(result) == {"overall", *CATEGORIES}
    assert result["single_hop"] == 1.0
    assert result["multi_hop"] == 0.0
    assert result["temporal"] == 0.0
    assert result["overall"] == pytest.approx(len(right_single_hop) / len(questions))
    perfect = accuracy({q.id: f"I think {q.answers[-1]}." for q in questions}, questions)
    assert perfect == {"overall": 1.0, **dict.fromkeys(CATEGORIES, 1.0)}
    halves = [question(["Oslo"], "temporal", "a"), question(["Porto"], "temporal", "b")]
    assert accuracy({"a": "Oslo", "b": "Oslo"}, halves) == {"overall": 0.5, "temporal": 0.5}
    with pytest.raises(InvalidArgumentError):
        accuracy({}, [])


def test_pools_do_not_share_entities():
    # A pet, a relative or a city that is also a cast name would make questions ambiguous.
    pools = [conversations.CAST, conversations.RELATIVE_NAMES, conversations.PET_NAMES]
    pools += [conversations.CITIES, conversations.CAR_MAKES]
    words = [word for pool in pools for word in pool]
    assert len(words) == len(set(words))


def test_arguments_are_checked_and_sizes_follow_them():
    small = generate_conversations(seed=3, people=2, sessions=2)
    assert len(small.sessions) == 2
    assert Counter(q.category for q in small.questions) == {
        "single_hop": 18,
        "multi_hop": 6,
        "temporal": 10,
    }
    largest = generate_conversations(people=conversations.MAX_PEOPLE)
    assert len(largest.facts) == 15 * conversations.MAX_PEOPLE
    for bad in ({"people": 1}, {"people": conversations.MAX_PEOPLE + 1}, {"sessions": 1}):
        with pytest.raises(InvalidArgumentError):
            generate_conversations(**bad)
