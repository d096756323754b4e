"""A synthetic multi-session conversation set for evaluating a fact memory, built offline.

Scope: a memory (InferScale-style) stores the facts stated across many chat sessions; later, a
question is answered from the facts it retrieves. This module makes the conversations, the facts
they state and the questions, in three LoCoMo-like categories:

* ``single_hop``: one fact answers it ("Alice's dog is named Biscuit." -> "What is the name of
  Alice's dog?" -> Biscuit).
* ``multi_hop``: two facts chained through an entity ("Alice's dog is named Biscuit." +
  "Biscuit's favourite toy is a red ball." -> "What is the favourite toy of Alice's dog?").
* ``temporal``: dated events ("On 3 May 2024 Alice moved to Lisbon."): when something happened,
  where someone lived before a move, where they live now (the later of two moves wins).

Every value (pet, job, city, name ...) is drawn without replacement from its pool, so no two
facts answer one question differently, except the moves that a temporal question asks about.
Every answer appears verbatim in the text of one of its question's facts (the first answer of
a date question; the others are the same date written another way), so that a small model can
answer by copying. Sessions are chats between two members of the cast who are not named in the
session's facts; filler chit-chat sits between the facts, so that the turns before a fact are
the kind of context a memory would store with it.

Scoring is SQuAD-style: prediction and answers are normalised (lowercase, no punctuation, no
articles, single spaces) and a prediction is correct iff some answer occurs in it as whole words.

Everything is decided by ``seed`` through one ``random.Random(seed)``: no network, no model.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from datetime import date, timedelta

from kvstack.errors import InvalidArgumentError

CATEGORIES = ("single_hop", "multi_hop", "temporal")

CAST = (
    "Alice", "Bob", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiroshi", "Ines", "Jonas",
    "Keiko", "Liam", "Maya", "Nikhil", "Olga", "Pablo",
)  # fmt: skip
# People the cast talk about (relatives, friends): never speakers, never cast names.
RELATIVE_NAMES = (
    "Marco", "Nora", "Tobias", "Yara", "Felix", "Leila", "Oscar", "Priya", "Rafael", "Sofia",
    "Theo", "Uma", "Victor", "Wen", "Zara", "Anders", "Bianca", "Cyrus", "Dalia", "Emil", "Freya",
    "Gustavo", "Hana", "Ivan", "Jada", "Kofi", "Lucia", "Mateo", "Nadia", "Omar", "Petra",
    "Quentin",
)  # fmt: skip
RELATIONS = ("cousin", "neighbour", "best friend", "flatmate", "colleague", "mentor")
SPECIES = ("dog", "cat", "parrot", "rabbit", "hamster", "tortoise")
PET_NAMES = (
    "Biscuit", "Pepper", "Mochi", "Waffles", "Noodle", "Pickles", "Ziggy", "Clover", "Sprout",
    "Pumpkin", "Nugget", "Marble", "Tofu", "Juniper", "Pretzel", "Domino",
)  # fmt: skip
TOYS = (
    "a red ball", "a squeaky duck", "a rope knot", "a tennis ball", "a rubber bone",
    "a feather wand", "a plush carrot", "a wooden bell", "a cardboard box", "a knitted mouse",
    "a blue frisbee", "a tiny mirror", "a chew stick", "a jingle ball", "a paper bag",
    "a plastic ring",
)  # fmt: skip
JOBS = (
    "pharmacist", "architect", "firefighter", "librarian", "pilot", "carpenter", "dentist",
    "journalist", "electrician", "florist", "plumber", "translator", "veterinarian", "baker",
    "surveyor", "geologist", "nurse", "accountant", "chef", "lawyer", "photographer", "teacher",
    "engineer", "optician", "beekeeper", "cartographer", "locksmith", "tailor", "zookeeper",
    "economist", "paramedic", "astronomer",
)  # fmt: skip
HOBBIES = (
    "rock climbing", "birdwatching", "pottery", "origami", "chess", "knitting", "gardening",
    "fencing", "kayaking", "calligraphy", "archery", "salsa dancing", "sudoku", "surfing",
    "woodcarving", "juggling",
)  # fmt: skip
FOODS = (
    "lasagne", "sushi", "paella", "falafel", "ramen", "goulash", "pierogi", "tacos", "risotto",
    "moussaka", "dumplings", "couscous", "pad thai", "borscht", "ceviche", "gnocchi",
)  # fmt: skip
INSTRUMENTS = (
    "cello", "violin", "trumpet", "banjo", "harp", "flute", "saxophone", "accordion", "clarinet",
    "ukulele", "oboe", "trombone", "harmonica", "piano", "mandolin", "bassoon",
)  # fmt: skip
CAR_MAKES = (
    "Volvo", "Fiat", "Toyota", "Skoda", "Subaru", "Peugeot", "Kia", "Mazda", "Renault", "Honda",
    "Citroen", "Opel", "Saab", "Lancia", "Dacia", "Nissan",
)  # fmt: skip
CAR_COLOURS = ("green", "silver", "black", "white", "yellow", "orange", "grey", "purple")
CITIES = (
    "Lisbon", "Porto", "Oslo", "Bergen", "Krakow", "Vienna", "Zurich", "Lyon", "Seville",
    "Dublin", "Tallinn", "Riga", "Ghent", "Bologna", "Valencia", "Gdansk", "Leipzig", "Malmo",
    "Aarhus", "Turku", "Split", "Ljubljana", "Brno", "Graz", "Utrecht", "Bordeaux", "Naples",
    "Salzburg", "Cork", "Galway", "Toulouse", "Nantes", "Granada", "Bilbao", "Bruges", "Basel",
    "Geneva", "Munich", "Hamburg", "Prague", "Budapest", "Athens", "Milan", "Florence", "Verona",
    "Marseille", "Helsinki", "Vilnius",
)  # fmt: skip
# (what the fact says happened, how the question asks about it)
MILESTONES = (
    ("ran a marathon", "run a marathon"), ("passed a driving test", "pass a driving test"),
    ("started learning Japanese", "start learning Japanese"),
    ("climbed Mount Etna", "climb Mount Etna"), ("got married", "get married"),
    ("graduated from university", "graduate from university"),
    ("bought a sailboat", "buy a sailboat"), ("opened a bakery", "open a bakery"),
    ("published a novel", "publish a novel"), ("learned to swim", "learn to swim"),
    ("sang in a choir concert", "sing in a choir concert"),
    ("planted an orchard", "plant an orchard"),
    ("finished a triathlon", "finish a triathlon"), ("started a podcast", "start a podcast"),
    ("built a treehouse", "build a treehouse"), ("visited Antarctica", "visit Antarctica"),
)  # fmt: skip
# Every fact is one sentence starting with a capital, so a lead-in must end a sentence.
LEAD_INS = (
    "", "Oh, did you hear?", "Quick update:", "Guess what!", "News from the group chat:",
    "Something worth remembering:", "I almost forgot to tell you.", "Fun fact:",
)  # fmt: skip
# Filler names no entity of any pool, so it never supplies or contradicts an answer.
OPENERS = ("Hey, how have you been?", "Hi! Long time no see.", "Morning! Got a minute?")
FILLER = (
    "Oh nice, good to know.", "Ha, that sounds about right.", "Really? I had no idea.",
    "The weather has been strange lately.", "I'm making tea, do you want some?",
    "Work has been hectic this week.", "I finally finished that book I was reading.",
    "Did you watch the match last night?", "The people next door are renovating again.",
    "I should really go to bed earlier.", "That reminds me, I need to buy groceries.",
    "Wow, time flies.", "We should all meet up soon.", "I have been trying to drink more water.",
    "Traffic was terrible this morning.", "I can't believe it's already this late.",
    "Honestly, same here.", "That is lovely to hear.", "I keep forgetting to water my plants.",
    "Let's plan something for the weekend.", "My phone battery dies so fast these days.",
    "I tried a new recipe yesterday and it was a disaster.", "Makes sense to me.",
    "I've been meaning to ask about that.",
)  # fmt: skip
CLOSERS = ("Anyway, I have to run. Talk soon!", "Okay, catch you later!", "Good night!")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)  # fmt: skip
MAX_PEOPLE = min(
    len(CAST), len(RELATIVE_NAMES) // 2, len(PET_NAMES), len(TOYS), len(JOBS) // 2, len(HOBBIES),
    len(FOODS), len(INSTRUMENTS), len(CAR_MAKES), len(CITIES) // 3, len(MILESTONES),
)  # fmt: skip


@dataclass(frozen=True)
class Fact:
    """One sentence stated in turn ``turn`` of session ``session`` (dated ``date``, ISO)."""

    id: str  # "s<session>.t<turn>"
    text: str
    session: int
    turn: int
    date: str


@dataclass(frozen=True)
class Session:
    """One chat: ``turns`` are lines "Speaker: words", oldest first; ``date`` is ISO."""

    index: int
    date: str
    turns: list[str]


@dataclass(frozen=True)
class Question:
    """``answers``: acceptable short answers, the first canonical (verbatim in a fact);
    ``fact_ids``: the facts it needs (one for single-hop, two for multi-hop)."""

    id: str
    text: str
    answers: list[str]
    category: str
    fact_ids: list[str]


@dataclass(frozen=True)
class EvaluationSet:
    """The conversation (``sessions`` in date order), the ``facts`` it states in (session, turn)
    order, and the ``questions`` over them."""

    sessions: list[Session]
    facts: list[Fact]
    questions: list[Question]

    def turns_before(self, fact: Fact, w: int) -> list[str]:
        """The ``w`` turns just before ``fact``'s turn, oldest first, reaching back into earlier
        sessions when needed; fewer only at the very start of the conversation."""
        if w < 0:
            raise InvalidArgumentError(f"w must be >= 0, got {w}")
        earlier = [turn for session in self.sessions[: fact.session] for turn in session.turns]
        earlier += self.sessions[fact.session].turns[: fact.turn]
        return earlier[max(0, len(earlier) - w) :]

    def facts_of(self, question: Question) -> list[Fact]:
        by_id = {fact.id: fact for fact in self.facts}
        return [by_id[fact_id] for fact_id in question.fact_ids]


@dataclass(frozen=True)
class _Draft:
    """A fact before its session is known. Dated facts get their date from the session, so
    ``text`` holds a "{date}" placeholder for them."""

    key: str
    text: str
    speaker_to_avoid: str | None  # the cast member the fact is about: someone else says it
    after: str | None = None  # a fact that must be stated in an earlier session


@dataclass(frozen=True)
class _QuestionDraft:
    id: str
    text: str
    category: str
    fact_keys: list[str]
    answers: list[str]  # empty for a date question: the date of fact_keys[-1] answers it


def _with_article(noun: str) -> str:
    return f"an {noun}" if noun[0] in "aeiou" else f"a {noun}"


def _written(day: date) -> str:
    return f"{day.day} {MONTHS[day.month - 1]} {day.year}"


def _date_answers(day: date) -> list[str]:
    # The first form is the one in the fact; the others accept a model that reformats it.
    return [_written(day), f"{MONTHS[day.month - 1]} {day.day}, {day.year}", day.isoformat()]


def _drafts(rng: random.Random, people: int) -> tuple[list[_Draft], list[_QuestionDraft]]:
    """Each person's 15 facts and 17 questions (9 single-hop, 3 multi-hop, 5 temporal); keys
    are "<person>.<name>", e.g. "alice.pet"."""
    cast = rng.sample(CAST, people)
    relatives = iter(rng.sample(RELATIVE_NAMES, 2 * people))
    jobs = iter(rng.sample(JOBS, 2 * people))
    cities = iter(rng.sample(CITIES, 3 * people))
    pets, toys = rng.sample(PET_NAMES, people), rng.sample(TOYS, people)
    hobbies, foods = rng.sample(HOBBIES, people), rng.sample(FOODS, people)
    instruments, makes = rng.sample(INSTRUMENTS, people), rng.sample(CAR_MAKES, people)
    milestones = rng.sample(MILESTONES, people)
    house_numbers = rng.sample(range(32, 400), people)  # above 31: never a day of a date

    facts: list[_Draft] = []
    questions: list[_QuestionDraft] = []
    for i, who in enumerate(cast):
        species, pet, toy, hobby, food = rng.choice(SPECIES), pets[i], toys[i], hobbies[i], foods[i]
        job, relative_job = next(jobs), next(jobs)
        car, make = f"{rng.choice(CAR_COLOURS)} {makes[i]}", makes[i]
        relation_a, relation_b = rng.sample(RELATIONS, 2)
        relative_a, relative_b = next(relatives), next(relatives)
        first_city, second_city, birthplace = next(cities), next(cities), next(cities)
        happened, asked = milestones[i]
        # (name, text, whether it names who); the second fact of a multi-hop chain names only the
        # linking entity, never who. "{date}" is filled in from the session that states it.
        person_facts = [
            ("pet", f"{who}'s {species} is named {pet}.", True),
            ("job", f"{who} works as {_with_article(job)}.", True),
            ("hobby", f"{who}'s favourite hobby is {hobby}.", True),
            ("food", f"{who}'s favourite food is {food}.", True),
            ("instrument", f"{who} plays the {instruments[i]}.", True),
            ("car", f"{who} drives a {car}.", True),
            ("house", f"{who}'s house number is {house_numbers[i]}.", True),
            ("relative_a", f"{who}'s {relation_a} is called {relative_a}.", True),
            ("relative_b", f"{who}'s {relation_b} is called {relative_b}.", True),
            ("pet.toy", f"{pet}'s favourite toy is {toy}.", False),
            ("relative_a.job", f"{relative_a} works as {_with_article(relative_job)}.", False),
            ("relative_b.born", f"{relative_b} was born in {birthplace}.", False),
            ("move.first", f"On {{date}} {who} moved to {first_city}.", True),
            ("move.second", f"On {{date}} {who} moved to {second_city}.", True),
            ("milestone", f"On {{date}} {who} {happened}.", True),
        ]
        # (name, category, text, the facts it needs, answers; none: the date of the last fact)
        person_questions = [
            ("pet", "single_hop", f"What is the name of {who}'s {species}?", ["pet"], [pet]),
            ("job", "single_hop", f"What is {who}'s job?", ["job"], [job]),
            ("hobby", "single_hop", f"What is {who}'s favourite hobby?", ["hobby"], [hobby]),
            ("food", "single_hop", f"What is {who}'s favourite food?", ["food"], [food]),
            ("instrument", "single_hop", f"Which instrument does {who} play?", ["instrument"],
             [instruments[i]]),
            ("car", "single_hop", f"What car does {who} drive?", ["car"], [car, make]),
            ("house", "single_hop", f"What is {who}'s house number?", ["house"],
             [str(house_numbers[i])]),
            ("relative_a", "single_hop", f"What is the name of {who}'s {relation_a}?",
             ["relative_a"], [relative_a]),
            ("relative_b", "single_hop", f"What is the name of {who}'s {relation_b}?",
             ["relative_b"], [relative_b]),
            ("pet.toy", "multi_hop", f"What is the favourite toy of {who}'s {species}?",
             ["pet", "pet.toy"], [toy, toy.removeprefix("a ")]),
            ("relative_a.job", "multi_hop", f"What is the job of {who}'s {relation_a}?",
             ["relative_a", "relative_a.job"], [relative_job]),
            ("relative_b.born", "multi_hop", f"In which city was {who}'s {relation_b} born?",
             ["relative_b", "relative_b.born"], [birthplace]),
            ("move.first", "temporal", f"When did {who} move to {first_city}?", ["move.first"], []),
            ("move.second", "temporal", f"When did {who} move to {second_city}?", ["move.second"],
             []),
            ("milestone", "temporal", f"When did {who} {asked}?", ["milestone"], []),
            ("city.before", "temporal", f"Where did {who} live before moving to {second_city}?",
             ["move.first", "move.second"], [first_city]),
            ("city.now", "temporal", f"In which city does {who} live now?",
             ["move.first", "move.second"], [second_city]),
        ]  # fmt: skip
        key = who.lower()
        for name, text, names_who in person_facts:
            # The second move must be stated in a later session than the first (see below).
            after = f"{key}.move.first" if name == "move.second" else None
            facts.append(_Draft(f"{key}.{name}", text, who if names_who else None, after))
        for name, category, text, needed, answers in person_questions:
            keys = [f"{key}.{fact_name}" for fact_name in needed]
            questions.append(_QuestionDraft(f"{key}.{name}", text, category, keys, answers))
    return facts, questions


def _speaker(speakers: list[str], position: int, avoid: str | None) -> str:
    """Speakers alternate, except that nobody states a fact about themselves."""
    speaker = speakers[position % 2]
    return speakers[(position + 1) % 2] if speaker == avoid else speaker


def generate_conversations(seed: int = 0, people: int = 10, sessions: int = 20) -> EvaluationSet:
    """The set for ``seed``: ``people`` cast members (15 facts and 17 questions each: 9
    single-hop, 3 multi-hop, 5 temporal) over ``sessions`` chats 5-21 days apart, from early
    2024. The defaults give 150 facts and 170 questions."""
    if not 2 <= people <= MAX_PEOPLE:
        raise InvalidArgumentError(f"people must be in [2, {MAX_PEOPLE}], got {people}")
    if sessions < 2:
        raise InvalidArgumentError(f"sessions must be >= 2 (moves need two), got {sessions}")
    rng = random.Random(seed)
    drafts, question_drafts = _drafts(rng, people)
    cast = sorted({d.speaker_to_avoid for d in drafts if d.speaker_to_avoid})

    # Facts spread evenly over the sessions in a seeded order; an ordered pair (two moves) goes
    # to two distinct sessions, so the later event also has the later date.
    ordered = {d.key for d in drafts if d.after} | {d.after for d in drafts if d.after}
    free = [d.key for d in drafts if d.key not in ordered]
    rng.shuffle(free)
    session_of = {key: i * sessions // len(free) for i, key in enumerate(free)}
    for d in drafts:
        if d.after:
            session_of[d.after], session_of[d.key] = sorted(rng.sample(range(sessions), 2))

    days = [date(2024, 1, 1) + timedelta(days=rng.randrange(60))]
    for _ in range(sessions - 1):
        days.append(days[-1] + timedelta(days=rng.randint(5, 21)))

    fact_of: dict[str, Fact] = {}
    event_day: dict[str, date] = {}
    built: list[Session] = []
    for index, day in enumerate(days):
        here = [d for d in drafts if session_of[d.key] == index]
        rng.shuffle(here)
        unnamed = [member for member in cast if member not in {d.speaker_to_avoid for d in here}]
        speakers = rng.sample(unnamed if len(unnamed) >= 2 else cast, 2)
        turns = [f"{speakers[0]}: {rng.choice(OPENERS)}"]
        for draft in here:
            for line in rng.sample(FILLER, rng.randint(1, 3)):
                turns.append(f"{_speaker(speakers, len(turns), None)}: {line}")
            text = draft.text
            if "{date}" in text:
                # The event happened since the previous session, so dates keep the fact order.
                gap = (day - days[index - 1]).days if index else 7
                event_day[draft.key] = day - timedelta(days=rng.randrange(min(gap, 7)))
                text = text.replace("{date}", _written(event_day[draft.key]))
            turn = len(turns)
            fact_of[draft.key] = Fact(f"s{index}.t{turn}", text, index, turn, day.isoformat())
            speaker = _speaker(speakers, turn, draft.speaker_to_avoid)
            lead_in = rng.choice(LEAD_INS)
            turns.append(f"{speaker}: {lead_in} {text}" if lead_in else f"{speaker}: {text}")
        turns.append(f"{_speaker(speakers, len(turns), None)}: {rng.choice(FILLER)}")
        turns.append(f"{_speaker(speakers, len(turns), None)}: {rng.choice(CLOSERS)}")
        built.append(Session(index, day.isoformat(), turns))

    facts = sorted(fact_of.values(), key=lambda fact: (fact.session, fact.turn))
    questions = [
        Question(
            id=q.id,
            text=q.text,
            answers=q.answers or _date_answers(event_day[q.fact_keys[-1]]),
            category=q.category,
            fact_ids=[fact_of[key].id for key in q.fact_keys],
        )
        for q in question_drafts
    ]
    return EvaluationSet(built, facts, questions)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lowercase, drop punctuation and articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def score(prediction: str, question: Question) -> bool:
    """Whether some answer occurs in ``prediction`` as whole words (after normalisation), so
    that "Lisbonne" is not "Lisbon" but "She lives in Lisbon now." is."""
    padded = f" {normalize_answer(prediction)} "
    answers = (normalize_answer(answer) for answer in question.answers)
    return any(answer and f" {answer} " in padded for answer in answers)


def accuracy(predictions: dict[str, str], questions: list[Question]) -> dict[str, float]:
    """The fraction of ``questions`` answered correctly, under "overall" and per category present;
    a question without a prediction counts as wrong."""
    if not questions:
        raise InvalidArgumentError("accuracy needs at least one question")
    correct: dict[str, list[bool]] = {"overall": []}
    for question in questions:
        right = score(predictions.get(question.id, ""), question)
        correct["overall"].append(right)
        correct.setdefault(question.category, []).append(right)
    return {name: sum(marks) / len(marks) for name, marks in correct.items()}
