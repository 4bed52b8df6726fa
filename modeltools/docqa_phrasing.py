"""Varied phrasings of the doc-QA worlds: documents and questions in many templates, for
a model that reads its users' words and not only its own notes.

The plain style (``docqa_data.person_document``, ``QUESTIONS``) writes every fact one
way: "Staff note: Mira lives in Oslo and is 38 years old." and "Question: How old is
Mira?". The varied style draws, per fact and per question, one of several templates:
documents of one to four sentences, with or without a header, with distractor
sentences that state nothing a question asks; questions with or without the
"Question: " prefix, as a user types them into a chat.

Templates are split in two. Every fifth template of a list is held out
(``templates="heldout"``): training never sees them, so an evaluation with them
measures phrasings the model has never read. Names and cities from outside the entity lists
(``EXTRA_PEOPLE``, ``EXTRA_CITIES``) appear in the varied style only; they are several
tokens of the doc-QA tokenizer, so their answers are too.

Invariants:
- Every template states exactly the fact it is for, with the subject written before
  the value, and each sentence names its subject (no pronouns): a document still states
  each fact once.
- Distractor sentences name no person, team, city or number.
- The plain style's random stream is untouched: the varied style draws from the
  generator only where it is asked for.
"""

from __future__ import annotations

import random

STYLES = ("plain", "varied")
TEMPLATE_SPLITS = ("train", "heldout")

# People and cities outside the plain style's lists (several tokens each)
EXTRA_PEOPLE = (
    "Petra Sven Aiko Bogdan Carmen Dmitri Eliska Fatima Gustav Halima Ilse Joaquin Katya "
    "Lorenzo Marisol Niamh Orla Radek Sigrid Thiago Ulla Viktor Wen Ximena Yosef Zuzana"
).split()
EXTRA_CITIES = (
    "Tallinn Vilnius Bratislava Ljubljana Tbilisi Windhoek Montevideo Asuncion Reykjavik "
    "Tromso Galway Aarhus Graz Lyon Bilbao Sapporo"
).split()

# {n}: a person, {c}: a city, {a}: an age, {t}: a team name, {l}: a leader's name.
# Ten templates a list; the fifth and the tenth are held out (``pick``).
PERSON_FACTS = {
    "city": (
        "{n} lives in {c}",
        "{n} resides in {c}",
        "{n} has a home in {c}",
        "{n} is living in {c}",
        "{n} calls {c} home",
        "{n} is based in {c}",
        "{n} moved to {c}",
        "{n} has lived in {c} for years",
        "{n} rents a flat in {c}",
        "{n} is a resident of {c}",
    ),
    "age": (
        "{n} is {a} years old",
        "{n} is {a}",
        "{n} turned {a} this year",
        "{n} is aged {a}",
        "{n} is a person of {a} years",
        "{n} is {a} years of age",
        "{n} has an age of {a}",
        "{n} reached the age of {a}",
        "{n} celebrated birthday number {a}",
        "{n} is now {a}",
    ),
    "team": (
        "{n} works in the {t} team",
        "{n} is a member of the {t} team",
        "{n} is on the {t} team",
        "{n} joined the {t} team",
        "{n} belongs to the {t} team",
        "{n} works for the {t} team",
        "{n} is part of the {t} team",
        "{n} is with the {t} team",
        "{n} was assigned to the {t} team",
        "{n} is staffed on the {t} team",
    ),
}
TEAM_FACTS = {
    "city": (
        "the {t} team is based in {c}",
        "the {t} team has its office in {c}",
        "the {t} team works out of {c}",
        "the {t} team sits in {c}",
        "the {t} team is located in {c}",
        "the {t} team operates from {c}",
        "the {t} team is headquartered in {c}",
        "the {t} team has its base in {c}",
        "the {t} team meets in {c}",
        "the {t} team is stationed in {c}",
    ),
    "leader": (
        "the {t} team is led by {l}",
        "the {t} team is headed by {l}",
        "the {t} team reports to {l}",
        "the {t} team has {l} as its lead",
        "the {t} team is managed by {l}",
        "the {t} team is run by {l}",
        "the {t} team has {l} in charge",
        "the {t} team answers to {l}",
        "the {t} team is directed by {l}",
        "the {t} team is coordinated by {l}",
    ),
}
HEADERS = ("Staff note: ", "Team note: ", "Note: ", "Record: ", "Update: ", "Directory entry: ", "")
DISTRACTORS = (
    "The office kitchen was repainted last spring.",
    "Parking passes are renewed every month.",
    "The weekly meeting moved to the afternoon.",
    "Printers on the second floor are out of toner.",
    "Visitors sign in at the front desk.",
    "The library closes early on holidays.",
    "Expense reports are due at the end of the quarter.",
    "A new coffee machine arrived on Friday.",
    "Badges must be worn inside the building.",
    "The fire drill is planned for next week.",
)
QUESTIONS = {
    "person_city": (
        "Where does {s} live?",
        "In which city does {s} live?",
        "Which city is {s} living in?",
        "What city does {s} live in?",
        "Where is {s}'s home?",
        "Where is {s} based?",
        "What is {s}'s city?",
        "Which city does {s} call home?",
        "Where does {s} reside?",
        "In what city can {s} be found?",
    ),
    "person_age": (
        "How old is {s}?",
        "What is the age of {s}?",
        "What age is {s}?",
        "How many years old is {s}?",
        "Tell me {s}'s age.",
        "What is {s}'s age?",
        "How old is {s} now?",
        "Give the age of {s}.",
        "Do you know how old {s} is?",
        "{s} is how old?",
    ),
    "person_team": (
        "Which team does {s} work in?",
        "What team is {s} on?",
        "Which team is {s} a member of?",
        "What team does {s} belong to?",
        "Name the team of {s}.",
        "What is {s}'s team?",
        "Which team has {s}?",
        "Which team is {s} part of?",
        "Which team does {s} work for?",
        "In which team is {s}?",
    ),
    "team_city": (
        "Where is the {s} team based?",
        "In which city is the {s} team?",
        "What city is the {s} team based in?",
        "Where does the {s} team work?",
        "Where can I find the {s} team?",
        "Where is the {s} team located?",
        "Which city hosts the {s} team?",
        "Where is the office of the {s} team?",
        "In what city does the {s} team sit?",
        "What city is home to the {s} team?",
    ),
    "team_leader": (
        "Who leads the {s} team?",
        "Who is the lead of the {s} team?",
        "Who heads the {s} team?",
        "Who runs the {s} team?",
        "Who is in charge of the {s} team?",
        "Who manages the {s} team?",
        "Who is the head of the {s} team?",
        "Who does the {s} team report to?",
        "Who directs the {s} team?",
        "Who is the {s} team's leader?",
    ),
    "team_of_person_city": (
        "Where is the team of {s} based?",
        "In which city is the team of {s}?",
        "Where does the team of {s} work?",
        "What city is the team of {s} based in?",
        "Where can I find the team {s} works in?",
        "Where is {s}'s team located?",
        "In which city does {s}'s team sit?",
        "Where is the office of {s}'s team?",
        "What city hosts the team of {s}?",
        "Where is the team that {s} is on based?",
    ),
    "team_of_person_leader": (
        "Who leads the team of {s}?",
        "Who heads the team of {s}?",
        "Who is the lead of the team of {s}?",
        "Who runs the team of {s}?",
        "Who is {s}'s team lead?",
        "Who manages {s}'s team?",
        "Who is in charge of the team of {s}?",
        "Who does {s}'s team report to?",
        "Who is the head of {s}'s team?",
        "Who leads the team that {s} is on?",
    ),
    "leader_age": (
        "How old is the leader of the {s} team?",
        "What is the age of the leader of the {s} team?",
        "How old is the person who leads the {s} team?",
        "What age is the head of the {s} team?",
        "Tell me the age of the {s} team's lead.",
        "How old is the {s} team's leader?",
        "What is the age of the person in charge of the {s} team?",
        "How old is whoever runs the {s} team?",
        "What age is the lead of the {s} team?",
        "How many years old is the head of the {s} team?",
    ),
    "leader_city": (
        "Where does the leader of the {s} team live?",
        "In which city does the leader of the {s} team live?",
        "Where does the person who leads the {s} team live?",
        "What city does the head of the {s} team live in?",
        "Where is the {s} team's lead living?",
        "Where does the {s} team's leader live?",
        "In what city does the person in charge of the {s} team live?",
        "Where is the home of the {s} team's head?",
        "Which city does the lead of the {s} team live in?",
        "Where does whoever runs the {s} team live?",
    ),
}
# Question prefixes of the varied style, weighted: mostly none, as typed into a chat
PREFIXES = ("", "", "", "Question: ", "Q: ")


def pick(templates: tuple[str, ...], templates_split: str, rng: random.Random) -> str:
    """One template of the split: every fifth template (the fifth, the tenth) is held
    out, training draws among the others."""
    held = templates_split == "heldout"
    return rng.choice([t for i, t in enumerate(templates) if (i % 5 == 4) == held])


def question(kind: str, subject: str, templates_split: str, rng: random.Random) -> str:
    text = pick(QUESTIONS[kind], templates_split, rng).format(s=subject)
    return rng.choice(PREFIXES) + text


def _sentences(clauses: list[str], header: str, rng: random.Random) -> str:
    """Clauses as one to several sentences, distractors among them; a header before."""
    if len(clauses) == 2 and rng.random() < 0.4:
        # "X lives in Oslo and is 38" keeps one subject for both clauses
        second = clauses[1].split(" ", 1)[1] if not clauses[1].startswith("the ") else None
        if second is not None:
            clauses = [f"{clauses[0]} and {second}"]
    sentences = [c[0].upper() + c[1:] + "." for c in clauses]
    for distractor in rng.sample(DISTRACTORS, rng.choice((0, 0, 1, 2))):
        sentences.insert(rng.randint(0, len(sentences)), distractor)
    return header + " ".join(sentences) + "\n"


def person_document(name: str, facts: dict[str, str], split: str, rng: random.Random) -> str:
    keys = [k for k in ("city", "age", "team") if k in facts]
    rng.shuffle(keys)
    values = {"c": facts.get("city"), "a": facts.get("age"), "t": facts.get("team")}
    clauses = [pick(PERSON_FACTS[k], split, rng).format(n=name, **values) for k in keys]
    return _sentences(clauses, rng.choice(HEADERS), rng)


def team_document(name: str, city: str, leader: str, split: str, rng: random.Random) -> str:
    keys = ["city", "leader"]
    rng.shuffle(keys)
    clauses = [pick(TEAM_FACTS[k], split, rng).format(t=name, c=city, l=leader) for k in keys]
    return _sentences(clauses, rng.choice(HEADERS), rng)
