"""Synthetic multi-document question answering, for training and judging the doc-QA model.

An example is a chat: a system prompt (one of ``SYSTEM_PROMPTS``), then one user message
whose content is a list of text parts — 2 to 16 short documents, each its own part (so
each is its own chunk), and the question as the last part. The answer is one entity
(a name, a team, a city or a number), nothing else; the assistant turn is the answer
followed by the end-of-turn token.

Each example describes a small random world of people and teams:

- a person's document states two of: where they live, their age, which team they work in;
- a team's document states where it is based and who leads it.

Single-hop questions ask a fact of one document. Two-hop questions follow a link from one
document into another ("the team of Mira" -> the Falcon team -> where the Falcon team is
based), and the answer is only the final entity. Every other document is a distractor
with the same kinds of facts about other people and teams. Documents are shuffled, so
the gold documents sit at every position.

Invariants:
- Deterministic: the same seed, count and arguments give the same examples.
- Each subject (person or team) has at most one document, so every answer is unique.
- Every entity name of the plain style is a single token of the doc-QA tokenizer, with
  and without a leading space (checked by ``modeltools.docqa_train.build_docqa_tokenizer``);
  the varied style (``modeltools.docqa_phrasing``) also names people and places from
  outside those lists, several tokens each.
- Train and held-out examples are disjoint: an example's combination (question kind,
  subject, link entity, answer) falls in the held-out partition (``is_heldout``) or not,
  and each split only emits its own; their random streams are also seeded apart.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from modeltools import docqa_phrasing

PEOPLE = (
    "Mira Omar Lena Tariq Bruno Hana Ivan Nadia Felix Priya Jonas Elena Kenji Amara Diego "
    "Ingrid Rafael Yara Tobias Leila Marco Freya Anil Clara Emil Zora Hugo Maya Pavel Rosa "
    "Samir Greta Luca Nina Oscar Vera Arjun Ida Karim Alba Chloe Dario Esme Farid Gina "
    "Henrik Iris Jamal Kira Lars Mina Nico Olga Pablo Rhea Stefan Tessa Umar Wanda Yusuf"
).split()
CITIES = (
    "Oslo Lima Cairo Dublin Lagos Quito Riga Porto Kyoto Accra Bern Dakar Hanoi Minsk "
    "Nairobi Perth Seoul Tunis Vienna Zagreb Austin Bergen Cusco Denver Essen Geneva Havana "
    "Izmir Jaipur Krakow Leeds Malmo Nantes Pune Quebec Rabat Turin Utrecht Valencia Boston"
).split()
TEAMS = (
    "Falcon Harbor Cedar Comet Summit Willow Granite Orbit Maple Beacon Atlas Pioneer Quartz "
    "Ember Lotus Nova Raven Tundra Vertex Zephyr Aurora Bison Coral Delta Echo Fjord Glacier "
    "Horizon Ivory Jade"
).split()
AGES = tuple(str(n) for n in range(21, 70))

SYSTEM_PROMPTS = (
    "You answer questions from the documents in the conversation. Reply with the answer only.",
    "You are the staff directory assistant. Use only the notes provided and answer with one name, "
    "team, city or number.",
    "Read the records below and answer the question with a single word.",
    "You are a careful assistant for an operations team. The documents are the only source of "
    "truth; give just the answer.",
    "Answer briefly. Facts come from the user's documents, never from memory.",
    "You help people find colleagues. Look the answer up in the documents and reply with it alone.",
)

MIN_DOCS, MAX_DOCS = 2, 16
SINGLE_HOP = ("person_city", "person_age", "person_team", "team_city", "team_leader")
TWO_HOP = ("team_of_person_city", "team_of_person_leader", "leader_age", "leader_city")
# Training only (follow-ups with ``reverse``): a value asks for its subject. Answering
# them needs each value to carry its subject, the half of binding the forward questions
# build on; asked only where the answer is unique.
REVERSE = ("city_resident", "age_holder", "team_member", "city_team", "leader_team")
QUESTIONS = {
    "person_city": "Where does {s} live?",
    "person_age": "How old is {s}?",
    "person_team": "Which team does {s} work in?",
    "team_city": "Where is the {s} team based?",
    "team_leader": "Who leads the {s} team?",
    "team_of_person_city": "Where is the team of {s} based?",
    "team_of_person_leader": "Who leads the team of {s}?",
    "leader_age": "How old is the leader of the {s} team?",
    "leader_city": "Where does the leader of the {s} team live?",
    "city_resident": "Who lives in {s}?",
    "age_holder": "Who is {s} years old?",
    "team_member": "Who works in the {s} team?",
    "city_team": "Which team is based in {s}?",
    "leader_team": "Which team is led by {s}?",
}
HELDOUT_BUCKETS = 16  # one combination in 16 is held out
_SPLIT_SEED_OFFSET = {"train": 0, "heldout": 1_000_003}


@dataclass(frozen=True)
class DocQAExample:
    system: str
    documents: tuple[str, ...]
    question: str
    answer: str
    hops: int
    kind: str
    gold: tuple[int, ...]  # indices into ``documents`` (the link document first)
    combo: tuple[str, ...]  # (kind, subject[, link], answer): what the split partitions
    # Training only: further (question, answer) turns over the same documents, each a
    # different question of the same split (either hops).
    follow_ups: tuple[tuple[str, str], ...] = ()
    # every reply as the JSON object {"answer": ...} (``reply_text``)
    json_replies: bool = False
    style: str = "plain"  # how documents and questions are phrased (``generate_example``)

    @property
    def num_docs(self) -> int:
        return len(self.documents)

    @property
    def messages(self) -> list[dict[str, Any]]:
        parts = [{"type": "text", "text": d} for d in (*self.documents, self.question)]
        return [
            {"role": "system", "content": self.system},
            {"role": "user", "content": parts},
        ]

    def conversation(self, answer_space: bool = True) -> list[dict[str, Any]]:
        """``messages`` answered, then every follow-up as a user and an assistant turn;
        the replies as ``reply_text`` writes them."""
        reply = self.reply
        turns: list[dict[str, Any]] = [
            *self.messages,
            {"role": "assistant", "content": reply(self.answer, answer_space)},
        ]
        for question, answer in self.follow_ups:
            turns.append({"role": "user", "content": question})
            turns.append({"role": "assistant", "content": reply(answer, answer_space)})
        return turns

    def reply(self, answer: str, answer_space: bool = True) -> str:
        """``reply_text`` in this example's reply format."""
        return reply_text(answer, answer_space, self.json_replies)


def reply_text(answer: str, answer_space: bool = True, as_json: bool = False) -> str:
    """What the assistant says for ``answer``: with ``answer_space`` the entity as the
    documents write it, after a space (" Oslo"). Byte-level BPE keeps a space with the
    word after it, so " Oslo" is the token the documents hold and "Oslo" another one;
    answering with the documents' token makes answering a copy. ``as_json``: the same
    text as the value of an object's "answer" (``{"answer": " Oslo"}``), the reply a
    JSON schema ``{"answer": string}`` asks for."""
    text = " " + answer if answer_space else answer
    return '{"answer": "' + text + '"}' if as_json else text


@dataclass
class _Person:
    name: str
    facts: dict[str, str]  # two of city, age, team


@dataclass
class _Team:
    name: str
    city: str
    leader: str


def is_heldout(combo: Sequence[str]) -> bool:
    digest = hashlib.sha256("/".join(combo).encode()).digest()
    return digest[0] % HELDOUT_BUCKETS == 0


def person_document(p: _Person, rng: random.Random) -> str:
    phrases = {
        "city": f"lives in {p.facts.get('city')}",
        "age": f"is {p.facts.get('age')} years old",
        "team": f"works in the {p.facts.get('team')} team",
    }
    keys = [k for k in ("city", "age", "team") if k in p.facts]
    rng.shuffle(keys)
    return f"Staff note: {p.name} {phrases[keys[0]]} and {phrases[keys[1]]}.\n"


def team_document(t: _Team, rng: random.Random) -> str:
    phrases = [f"is based in {t.city}", f"is led by {t.leader}"]
    rng.shuffle(phrases)
    return f"Team note: the {t.name} team {phrases[0]} and {phrases[1]}.\n"


def _world(
    rng: random.Random, num_docs: int, names: Sequence[str] = PEOPLE, cities: Sequence[str] = CITIES
) -> tuple[list[_Person], list[_Team]]:
    """A world of ``num_docs`` subjects, its people named from ``names`` and its places
    from ``cities``."""
    num_teams = min(max(1, round(num_docs * rng.uniform(0.3, 0.6))), num_docs - 1)
    num_people = num_docs - num_teams
    people_names = rng.sample(names, num_people)
    team_names = rng.sample(TEAMS, num_teams)
    absent_people = [n for n in names if n not in people_names]
    absent_teams = [n for n in TEAMS if n not in team_names]
    rng.shuffle(absent_people)
    rng.shuffle(absent_teams)
    free_leaders = list(people_names)
    rng.shuffle(free_leaders)
    teams = []
    for name in team_names:
        if free_leaders and rng.random() < 0.6:
            leader = free_leaders.pop()
        else:
            leader = absent_people.pop()
        teams.append(_Team(name, rng.choice(cities), leader))
    people = []
    for name in people_names:
        kinds = rng.sample(("city", "age", "team"), 2)
        facts = {}
        for k in kinds:
            if k == "city":
                facts[k] = rng.choice(cities)
            elif k == "age":
                facts[k] = rng.choice(AGES)
            else:
                facts[k] = rng.choice(team_names) if rng.random() < 0.7 else absent_teams[0]
        people.append(_Person(name, facts))
    return people, teams


def _candidates(people: list[_Person], teams: list[_Team]) -> list[tuple[str, str, str, list]]:
    """(kind, subject, answer, [gold subjects, link first]) of every answerable question."""
    person_by = {p.name: p for p in people}
    team_by = {t.name: t for t in teams}
    out: list[tuple[str, str, str, list]] = []
    for p in people:
        for fact, kind in (("city", "person_city"), ("age", "person_age"), ("team", "person_team")):
            if fact in p.facts:
                out.append((kind, p.name, p.facts[fact], [p.name]))
        team = team_by.get(p.facts.get("team", ""))
        if team is not None:
            out.append(("team_of_person_city", p.name, team.city, [p.name, team.name], team.name))
            out.append(
                ("team_of_person_leader", p.name, team.leader, [p.name, team.name], team.name)
            )
    for t in teams:
        out.append(("team_city", t.name, t.city, [t.name]))
        out.append(("team_leader", t.name, t.leader, [t.name]))
        leader = person_by.get(t.leader)
        if leader is not None:
            for fact, kind in (("age", "leader_age"), ("city", "leader_city")):
                if fact in leader.facts:
                    out.append(
                        (kind, t.name, leader.facts[fact], [t.name, leader.name], leader.name)
                    )
    return out


def _reverse_candidates(
    people: list[_Person], teams: list[_Team]
) -> list[tuple[str, str, str, list]]:
    """(kind, value, subject, [subject]) of every reverse question with a unique answer."""
    by_value: dict[tuple[str, str], list[str]] = {}
    for p in people:
        for fact, kind in (
            ("city", "city_resident"),
            ("age", "age_holder"),
            ("team", "team_member"),
        ):
            if fact in p.facts:
                by_value.setdefault((kind, p.facts[fact]), []).append(p.name)
    for t in teams:
        by_value.setdefault(("city_team", t.city), []).append(t.name)
        by_value.setdefault(("leader_team", t.leader), []).append(t.name)
    return [(k, v, names[0], names) for (k, v), names in by_value.items() if len(names) == 1]


def generate_example(
    rng: random.Random,
    num_docs: int,
    split: str = "train",
    hops: int | None = None,
    questions: int = 1,
    reverse: bool = False,
    style: str = "plain",
    templates: str = "train",
    json_replies: bool = False,
) -> DocQAExample:
    """One example with ``num_docs`` documents; ``hops`` 1 or 2, or None for either
    (even odds). Draws worlds until one has a question of the wanted split and hops.
    ``questions`` > 1 adds up to that many - 1 follow-ups (training conversations with
    several turns); with 1 the random stream is the one it has always been. ``reverse``
    lets follow-ups also be ``REVERSE`` questions (the first question never is).
    ``style`` "varied" writes documents and questions in ``docqa_phrasing``'s templates
    of the ``templates`` split ("train" or "heldout"; "composed": training's
    templates and phrasings composed from parts, never a held-out one), and names people
    and places from the extra lists too; "plain" (the default) draws exactly as it
    always has.
    ``json_replies``: every reply is the JSON object ``reply_text`` writes."""
    if questions < 1:
        raise ValueError(f"questions must be at least 1, got {questions}")
    if hops not in (None, 1, 2):
        raise ValueError(f"hops must be 1, 2 or None (either), got {hops!r}")
    if not MIN_DOCS <= num_docs <= MAX_DOCS:
        raise ValueError(f"num_docs must be in [{MIN_DOCS}, {MAX_DOCS}], got {num_docs}")
    if split not in _SPLIT_SEED_OFFSET:
        raise ValueError(f"split must be train or heldout, got {split!r}")
    if style not in docqa_phrasing.STYLES:
        raise ValueError(f"style must be one of {docqa_phrasing.STYLES}, got {style!r}")
    if templates not in docqa_phrasing.TEMPLATE_CHOICES:
        raise ValueError(
            f"templates must be one of {docqa_phrasing.TEMPLATE_CHOICES}, got {templates!r}"
        )
    varied = style == "varied"
    names = (*PEOPLE, *docqa_phrasing.EXTRA_PEOPLE) if varied else PEOPLE
    cities = (*CITIES, *docqa_phrasing.EXTRA_CITIES) if varied else CITIES
    want_hops = hops if hops is not None else rng.choice((1, 2))
    kinds = SINGLE_HOP if want_hops == 1 else TWO_HOP
    while True:
        people, teams = _world(rng, num_docs, names, cities)
        cands = []
        for c in _candidates(people, teams):
            if c[0] not in kinds:
                continue
            combo = (c[0], c[1], *c[4:], c[2])
            if is_heldout(combo) == (split == "heldout"):
                cands.append((c, combo))
        if not cands:
            continue
        # Pick a kind first, so that kinds with many candidates are not favoured.
        kind = rng.choice(sorted({c[0] for c, _ in cands}))
        (kind, subject, answer, gold_subjects, *_), combo = rng.choice(
            [x for x in cands if x[0][0] == kind]
        )
        follow_ups: tuple[tuple[str, str], ...] = ()
        if questions > 1:
            follow_ups = _follow_ups(
                rng, people, teams, split, combo, questions - 1, reverse, style, templates
            )
        if varied:
            docs = [
                (p.name, docqa_phrasing.person_document(p.name, p.facts, templates, rng))
                for p in people
            ]
            docs += [
                (t.name, docqa_phrasing.team_document(t.name, t.city, t.leader, templates, rng))
                for t in teams
            ]
        else:
            docs = [(p.name, person_document(p, rng)) for p in people]
            docs += [(t.name, team_document(t, rng)) for t in teams]
        rng.shuffle(docs)
        index = {name: i for i, (name, _) in enumerate(docs)}
        return DocQAExample(
            system=rng.choice(SYSTEM_PROMPTS),
            documents=tuple(text for _, text in docs),
            question=ask(kind, subject, rng, style, templates),
            answer=answer,
            hops=want_hops,
            kind=kind,
            gold=tuple(index[s] for s in gold_subjects),
            combo=combo,
            follow_ups=follow_ups,
            json_replies=json_replies,
            style=style,
        )


def ask(
    kind: str, subject: str, rng: random.Random, style: str = "plain", templates: str = "train"
) -> str:
    """The question of ``kind`` about ``subject``: plain, "Question: " and the one
    template (no draw from ``rng``); varied, a template of the split with or without a
    prefix (kinds the varied style has no templates for are asked plainly)."""
    if style == "varied" and kind in docqa_phrasing.QUESTIONS:
        return docqa_phrasing.question(kind, subject, templates, rng)
    return "Question: " + QUESTIONS[kind].format(s=subject)


def _follow_ups(
    rng: random.Random,
    people: list[_Person],
    teams: list[_Team],
    split: str,
    asked: tuple[str, ...],
    count: int,
    reverse: bool,
    style: str = "plain",
    templates: str = "train",
) -> tuple[tuple[str, str], ...]:
    """Up to ``count`` further questions of ``split`` about the same world, none asked
    twice, kinds drawn evenly among those left."""
    left: dict[str, list[tuple[str, str]]] = {}
    extra = _reverse_candidates(people, teams) if reverse else []
    for c in [*_candidates(people, teams), *extra]:
        combo = (c[0], c[1], *c[4:], c[2])
        if combo != asked and is_heldout(combo) == (split == "heldout"):
            left.setdefault(c[0], []).append((c[1], c[2]))
    out = []
    while left and len(out) < count:
        kind = rng.choice(sorted(left))
        subject, answer = left[kind].pop(rng.randrange(len(left[kind])))
        if not left[kind]:
            del left[kind]
        out.append((ask(kind, subject, rng, style, templates), answer))
    return tuple(out)


def generate(
    seed: int,
    count: int,
    num_docs: int | tuple[int, int] = 8,
    split: str = "train",
    hops: int | None = None,
) -> list[DocQAExample]:
    """``count`` examples; ``num_docs`` fixed or a (low, high) range, inclusive."""
    return list(itertools.islice(iter_examples(seed, num_docs, split, hops), count))


def iter_examples(
    seed: int,
    num_docs: int | tuple[int, int] = 8,
    split: str = "train",
    hops: int | None = None,
) -> Iterator[DocQAExample]:
    if split not in _SPLIT_SEED_OFFSET:
        raise ValueError(f"split must be train or heldout, got {split!r}")
    rng = random.Random(f"docqa/{split}/{seed + _SPLIT_SEED_OFFSET[split]}")
    low, high = (num_docs, num_docs) if isinstance(num_docs, int) else num_docs
    while True:
        yield generate_example(rng, rng.randint(low, high), split, hops)


# The relation each question kind's answer is stated with, as it reads in a document.
_ANSWER_RELATION = {
    "person_city": r"lives in (\w+)",
    "leader_city": r"lives in (\w+)",
    "team_city": r"is based in (\w+)",
    "team_of_person_city": r"is based in (\w+)",
    "person_age": r"is (\d+) years old",
    "leader_age": r"is (\d+) years old",
    "person_team": r"works in the (\w+) team",
    "team_leader": r"is led by (\w+)",
    "team_of_person_leader": r"is led by (\w+)",
}


def relation_chance(ex: DocQAExample) -> float:
    """The accuracy of guessing at random among the distinct values the example's
    documents state with the relation its answer is stated with (every city someone
    "lives in", for "Where does Mira live?"): what a model that reads relations but
    does not bind them to their subjects scores."""
    values = {m.group(1) for d in ex.documents for m in re.finditer(_ANSWER_RELATION[ex.kind], d)}
    return 1.0 / len(values) if ex.answer in values else 0.0


def answer_matches(text: str, answer: str) -> bool:
    """Exact match of a generated reply: the doc-QA model replies with the entity as the
    documents write it, after a space (" Oslo"), so surrounding whitespace is ignored."""
    return text.strip() == answer


def entity_words() -> list[str]:
    """Every word that can be an answer or a subject."""
    return [*PEOPLE, *CITIES, *TEAMS, *AGES]


def tokenizer_texts(seed: int = 0, count: int = 3000) -> list[str]:
    """Text to train the tokenizer on: rendered training conversations (answers
    included), so entity names, cities and numbers become single tokens."""
    texts = []
    for ex in generate(seed, count, (MIN_DOCS, MAX_DOCS), "train"):
        body = "".join(ex.documents) + ex.question
        texts.append(f"{ex.system}\n{body}\n{ex.answer}\n")
    # Every entity, with and without a leading space, often enough to be merged.
    texts += [" ".join(entity_words()) + "\n" + "\n".join(entity_words()) + "\n"] * 40
    return texts
