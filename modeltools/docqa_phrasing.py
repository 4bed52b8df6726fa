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

Training can also compose its phrasings (``templates="composed"``): half of the facts
and questions from the training templates, half built from parts (a verb phrase, an
adverb, a tail; a question frame and a phrase for its subject, "the team of Mira",
"whoever runs the Falcon team"), thousands of frames where the templates give eight. A
model that answers them cannot rely on a frame it memorised: it must read a value by its
type (a city, a number, a team, a person) and its subject. The composed phrasings never
produce a held-out template, and never use a word that a held-out template has and the
training templates lack (``HELDOUT_FACT_WORDS``, ``HELDOUT_QUESTION_WORDS``; held-out
question frames and subject phrases are left out of the parts too): the held-out
templates stay phrasings the model has never read.

Invariants:
- Every template states exactly the fact it is for, with the subject written before
  the value, and each sentence names its subject (no pronouns): a document still states
  each fact once. (A composed generic relation, "is linked to", states it by the value's
  type alone: a person's document has at most one city, one age and one team, a team's
  one city and one leader.)
- Distractor sentences name no person, team, city or number.
- The plain style's random stream is untouched: the varied style draws from the
  generator only where it is asked for; so are the "train" and "heldout" template
  splits' streams by the composed one.
"""

from __future__ import annotations

import random
import re

STYLES = ("plain", "varied")
TEMPLATE_SPLITS = ("train", "heldout")
# what ``templates`` may be: a split, or training's composed phrasings
TEMPLATE_CHOICES = (*TEMPLATE_SPLITS, "composed")

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
    if templates_split == "composed":
        return composed_question(kind, subject, rng)
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
    if split == "composed":
        clauses = [composed_fact(PERSON_FACTS, k, name, values, rng) for k in keys]
        return _composed_sentences(clauses, name, rng)
    clauses = [pick(PERSON_FACTS[k], split, rng).format(n=name, **values) for k in keys]
    return _sentences(clauses, rng.choice(HEADERS), rng)


def team_document(name: str, city: str, leader: str, split: str, rng: random.Random) -> str:
    keys = ["city", "leader"]
    rng.shuffle(keys)
    if split == "composed":
        values = {"t": name, "c": city, "l": leader}
        clauses = [composed_fact(TEAM_FACTS, k, f"the {name} team", values, rng) for k in keys]
        return _composed_sentences(clauses, f"the {name} team", rng)
    clauses = [pick(TEAM_FACTS[k], split, rng).format(t=name, c=city, l=leader) for k in keys]
    return _sentences(clauses, rng.choice(HEADERS), rng)


# -- composed phrasings (training only) -------------------------------------------------


def _words(text: str) -> set[str]:
    """Lower-case words of ``text``, slots and the possessive "'s" left out."""
    return set(re.findall(r"[a-z]+", re.sub(r"\{\w+\}|'s\b", " ", text).lower()))


def _heldout_words(lists: list[tuple[str, ...]]) -> frozenset[str]:
    """Words of the held-out templates of ``lists`` that no training template has."""
    held, trained = set(), set()
    for templates in lists:
        for i, t in enumerate(templates):
            (held if i % 5 == 4 else trained).update(_words(t))
    return frozenset(held - trained)


# The composed parts use none of these (checked by the tests): each is what makes a
# held-out template a phrasing of its own ("calls", "resident", "can ... be found", ...)
HELDOUT_FACT_WORDS = _heldout_words([*PERSON_FACTS.values(), *TEAM_FACTS.values()])
HELDOUT_QUESTION_WORDS = _heldout_words(list(QUESTIONS.values()))

# Fact parts: a verb phrase with its value's slot, after the subject ("'s ..." joins it
# as a possessive); an adverb before it, a tail after it, each now and then.
COMPOSED_PERSON_FACTS = {
    "city": (
        "lives in {c}",
        "resides in {c}",
        "is living in {c}",
        "has a house in {c}",
        "has a flat in {c}",
        "keeps a flat in {c}",
        "owns a house in {c}",
        "has an apartment in {c}",
        "rents a room in {c}",
        "stays in {c}",
        "settled in {c}",
        "has settled in {c}",
        "relocated to {c}",
        "dwells in {c}",
        "makes a home in {c}",
        "has an address in {c}",
        "is registered in {c}",
        "is at home in {c}",
        "lives in the city of {c}",
        "lives just outside {c}",
        "lives in central {c}",
        "has been living in {c}",
        "went to live in {c}",
        "is settled in {c}",
        "shares a flat in {c}",
        "lives with friends in {c}",
        "commutes from {c}",
        "lives on the edge of {c}",
        "is from {c}",
        "bought a house in {c}",
        "'s flat is in {c}",
        "'s house is in {c}",
        "'s address is in {c}",
        "'s city is {c}",
    ),
    "age": (
        "is {a} years old",
        "is {a}",
        "is aged {a}",
        "turned {a}",
        "just turned {a}",
        "is {a} years of age",
        "has an age of {a}",
        "reached the age of {a}",
        "is {a} this year",
        "recently turned {a}",
        "is {a} years young",
        "counts {a} years",
        "has reached {a}",
        "is at age {a}",
        "is already {a}",
        "is {a} in years",
        "had a birthday and is {a}",
        "was born {a} years ago",
        "is {a} and counting",
        "'s age is {a}",
        "'s age is listed as {a}",
        "'s age is {a} years",
    ),
    "team": (
        "works in the {t} team",
        "is in the {t} team",
        "is on the {t} team",
        "is a member of the {t} team",
        "joined the {t} team",
        "works for the {t} team",
        "is part of the {t} team",
        "serves on the {t} team",
        "moved to the {t} team",
        "transferred to the {t} team",
        "is employed by the {t} team",
        "was hired into the {t} team",
        "works with the {t} team",
        "sits in the {t} team",
        "is a {t} team member",
        "is an analyst in the {t} team",
        "is an engineer on the {t} team",
        "is a developer in the {t} team",
        "has a seat in the {t} team",
        "helps out in the {t} team",
        "signed up with the {t} team",
        "was moved into the {t} team",
        "'s team is the {t} team",
        "'s team is {t}",
    ),
}
COMPOSED_TEAM_FACTS = {
    "city": (
        "is based in {c}", "has its office in {c}", "works out of {c}", "sits in {c}",
        "operates from {c}", "is headquartered in {c}", "has its base in {c}", "meets in {c}",
        "works in {c}", "has offices in {c}", "is housed in {c}", "keeps its office in {c}",
        "moved its office to {c}", "relocated to {c}", "has its home in {c}",
        "runs its work from {c}", "has a building in {c}", "uses an office in {c}",
        "is set up in {c}", "gathers in {c}", "is centred in {c}", "rents space in {c}",
        "has a workspace in {c}", "is registered in {c}", "moved to {c}",
        "'s office is in {c}", "'s base is {c}", "'s home is {c}", "'s city is {c}",
        "'s offices are in {c}",
    ),
    "leader": (
        "is led by {l}", "is headed by {l}", "reports to {l}", "has {l} as its lead",
        "is run by {l}", "has {l} in charge", "answers to {l}", "is directed by {l}",
        "is chaired by {l}", "is supervised by {l}", "is overseen by {l}",
        "is guided by {l}", "works under {l}", "has {l} as its head", "has {l} as its leader",
        "has {l} as its boss", "is steered by {l}", "follows {l}", "is captained by {l}",
        "is under {l}", "takes orders from {l}", "has {l} at its head",
        "is in the hands of {l}", "'s lead is {l}", "'s leader is {l}", "'s head is {l}",
        "'s boss is {l}", "'s chief is {l}",
    ),
}  # fmt: skip
# Relations that say nothing of the kind of fact: only the value's type tells it
GENERIC_FACTS = (
    "is listed with {v}", "is linked to {v}", "is associated with {v}", "is tied to {v}",
    "is recorded with {v}", "is noted with {v}", "goes with {v}", "is filed under {v}",
)  # fmt: skip
_GENERIC_VALUE = {"city": "{c}", "age": "age {a}", "team": "the {t} team", "leader": "{l}"}
ADVERBS = ("currently ", "still ", "also ", "already ", "usually ")
TAILS = (
    " these days", " at the moment", " for a while", " since last year",
    " according to the records", " as far as anyone knows", " for some time",
    " as of this month", " by all accounts", " since the spring",
)  # fmt: skip
EXTRA_HEADERS = ("Memo: ", "HR update: ", "From the directory: ", "Profile: ", "Fact sheet: ")
EXTRA_DISTRACTORS = (
    "The canteen serves soup on Mondays.",
    "Everyone should update their passwords.",
    "The lifts are serviced every spring.",
    "Lunch is served at noon.",
    "The wifi password changed yesterday.",
    "Plants on the third floor need water.",
)

# Question parts: a frame asking for a kind of value, {x} the phrase naming whose value
# ({xp} its possessive, for phrases that have one); the phrases of each question kind
CITY_OF_PERSON = (
    "Where does {x} live?",
    "In which city does {x} live?",
    "What city does {x} live in?",
    "Which city is {x} living in?",
    "Where does {x} reside?",
    "Which city does {x} call home?",
    "Where is {x} based?",
    "Where is {x} living?",
    "In what city does {x} live?",
    "Where has {x} settled?",
    "Which city is {x} in?",
    "What city is {x} from?",
    "What town does {x} live in?",
    "Where does {x} have a flat?",
    "Where does {x} stay?",
    "Which city does {x} live in?",
    "{x} lives where?",
    "{x} lives in which city?",
    "Do you know where {x} lives?",
    "Any idea where {x} lives?",
    "Where is {x} living these days?",
    "What is the city of {x}?",
    "Which place does {x} live in?",
    "Where did {x} settle?",
    "In which town does {x} reside?",
    "What city has {x} moved to?",
    "Where's {x} living?",
    "What is {xp} city?",
    "Which city is {xp} address in?",
    "Where is {xp} flat?",
    "Where is {xp} house?",
    "Give the city where {x} lives.",
    "State the city {x} lives in.",
    "Say where {x} lives.",
    "Give {xp} city.",
    "State {xp} city.",
    "Please give the city of {x}.",
)
CITY_OF_TEAM = (
    "Where is {x} based?",
    "In which city is {x}?",
    "What city is {x} based in?",
    "Where does {x} work?",
    "Where is {x} located?",
    "Which city hosts {x}?",
    "Where is the office of {x}?",
    "In what city does {x} sit?",
    "Where does {x} operate from?",
    "Where is {x} headquartered?",
    "What city is {x} in?",
    "Where does {x} meet?",
    "Which city is {x} based in?",
    "Where does {x} sit?",
    "In which city does {x} work?",
    "Where are the offices of {x}?",
    "Where does {x} have its office?",
    "Which city does {x} work out of?",
    "{x} is based where?",
    "{x} sits in which city?",
    "Do you know where {x} is based?",
    "Any idea where {x} is based?",
    "What is the base of {x}?",
    "Where is {xp} office?",
    "What is {xp} city?",
    "Which city is {xp} base?",
    "Where are {xp} offices?",
    "Give the city where {x} is based.",
    "State where {x} is based.",
    "Say which city {x} is in.",
    "Give the base of {x}.",
    "Give {xp} city.",
    "State {xp} base.",
    "Please give the city of {x}.",
)
AGE_OF = (
    "How old is {x}?",
    "What is the age of {x}?",
    "What age is {x}?",
    "How many years old is {x}?",
    "What is {xp} age?",
    "How old is {x} now?",
    "Give the age of {x}.",
    "Do you know how old {x} is?",
    "What's the age of {x}?",
    "At what age is {x}?",
    "Which age does {x} have?",
    "Any idea how old {x} is?",
    "What age has {x} reached?",
    "How old is {x} these days?",
    "Do you know {xp} age?",
    "What's {xp} age?",
    "State the age of {x}.",
    "Say how old {x} is.",
    "Give {xp} age.",
    "State {xp} age.",
    "Say {xp} age.",
    "Please give the age of {x}.",
    "Give the number of years {x} has.",
)
TEAM_OF = (
    "Which team does {x} work in?",
    "What team is {x} on?",
    "Which team is {x} a member of?",
    "What team does {x} belong to?",
    "What is {xp} team?",
    "Which team has {x}?",
    "Which team is {x} part of?",
    "Which team does {x} work for?",
    "What team does {x} work in?",
    "Which team did {x} join?",
    "What team is {x} with?",
    "For which team does {x} work?",
    "{x} is on which team?",
    "{x} is part of which team?",
    "Do you know which team {x} is on?",
    "Any idea what team {x} is on?",
    "What team does {x} work for?",
    "Which team employs {x}?",
    "What team has {x} joined?",
    "Which team does {x} sit in?",
    "What team is {x} a part of?",
    "Which team counts {x} as a member?",
    "What is the team of {x}?",
    "Give the team of {x}.",
    "State the team of {x}.",
    "Say the team of {x}.",
    "Which is the team of {x}?",
    "Please give the team of {x}.",
    "Say which team {x} is on.",
    "State which team {x} is part of.",
    "Give {xp} team.",
    "State {xp} team.",
    "Which team is {x} in?",
    "What team is {x} in?",
    "In which team does {x} work?",
    "What team does {x} play for?",
    "What is the team {x} plays for?",
    "{x} plays for which team?",
)
LEADER_OF = (
    "Who leads {x}?", "Who is the lead of {x}?", "Who heads {x}?", "Who runs {x}?",
    "Who manages {x}?", "Who is the head of {x}?", "Who does {x} report to?",
    "Who directs {x}?", "Who is the leader of {x}?", "Who is the boss of {x}?",
    "Who supervises {x}?", "Who oversees {x}?", "Who chairs {x}?",
    "Who is at the head of {x}?", "Who is the manager of {x}?", "{x} is led by whom?",
    "{x} reports to whom?", "Do you know who leads {x}?", "Any idea who runs {x}?",
    "Who is the chief of {x}?", "Who's the leader of {x}?", "Who guides {x}?",
    "Whom does {x} answer to?",
    "Give the leader of {x}.", "State who leads {x}.", "Say who runs {x}.",
    "Give the head of {x}.", "State the boss of {x}.", "Please give the leader of {x}.",
    "Who is {xp} head?", "Who is {xp} boss?", "Who is {xp} chief?", "Who is {xp} manager?",
    "Give {xp} leader.", "State {xp} head.",
)  # fmt: skip
PERSON_REFS = (("{s}", "{s}'s"),)
TEAM_REFS = (("the {s} team", "the {s} team's"),)
TEAM_OF_PERSON_REFS = tuple(
    (ref, None)
    for ref in (
        "the team of {s}", "{s}'s team", "the team {s} is part of", "the team {s} is a member of",
        "the team {s} belongs to", "the team {s} joined", "the team {s} is in",
        "the team employing {s}", "the team with {s} in it",
        "the team {s} plays for",
    )
)  # fmt: skip
LEADER_REFS = tuple(
    (ref, None)
    for ref in (
        "the leader of the {s} team", "the {s} team's leader", "the head of the {s} team",
        "the person who leads the {s} team", "whoever runs the {s} team",
        "the lead of the {s} team", "the {s} team's head", "the person in charge of the {s} team",
        "the manager of the {s} team", "the boss of the {s} team", "the {s} team's boss",
        "the chief of the {s} team", "the one who heads the {s} team",
    )
)  # fmt: skip
COMPOSED_QUESTIONS = {
    "person_city": (CITY_OF_PERSON, PERSON_REFS),
    "person_age": (AGE_OF, PERSON_REFS),
    "person_team": (TEAM_OF, PERSON_REFS),
    "team_city": (CITY_OF_TEAM, TEAM_REFS),
    "team_leader": (LEADER_OF, TEAM_REFS),
    "team_of_person_city": (CITY_OF_TEAM, TEAM_OF_PERSON_REFS),
    "team_of_person_leader": (LEADER_OF, TEAM_OF_PERSON_REFS),
    "leader_age": (AGE_OF, LEADER_REFS),
    "leader_city": (CITY_OF_PERSON, LEADER_REFS),
}


def _normal(text: str) -> str:
    """``text`` compared as a phrasing: case and final punctuation ignored."""
    return text.lower().rstrip("?.")


def heldout_facts(lists: dict[str, tuple[str, ...]], key: str, values: dict[str, str]) -> set:
    """The held-out templates of ``lists[key]`` with ``values`` filled in."""
    return {_normal(t.format(**values)) for i, t in enumerate(lists[key]) if i % 5 == 4}


def heldout_questions(subject: str) -> set[str]:
    """Every held-out question template (of any kind) about ``subject``."""
    return {
        _normal(t.format(s=subject))
        for templates in QUESTIONS.values()
        for i, t in enumerate(templates)
        if i % 5 == 4
    }


def composed_fact(
    lists: dict[str, tuple[str, ...]], key: str, subject: str, values: dict, rng: random.Random
) -> str:
    """A fact clause for training: a training template of ``lists[key]`` (person or
    team facts), or a verb phrase of the composed parts (now and then a relation that
    names no kind of fact) with an adverb and a tail; never a held-out template."""
    composed = COMPOSED_PERSON_FACTS if lists is PERSON_FACTS else COMPOSED_TEAM_FACTS
    values = {**values, "n": subject}
    held = heldout_facts(lists, key, values)
    while True:
        r = rng.random()
        if r < 0.4:
            clause = pick(lists[key], "train", rng).format(**values)
        else:
            if r < 0.5:
                core = rng.choice(GENERIC_FACTS).replace("{v}", _GENERIC_VALUE[key])
            else:
                core = rng.choice(composed[key])
            core = core.format(**values)
            if not core.startswith(("'s", "is ")) and rng.random() < 0.2:
                core = rng.choice(ADVERBS) + core
            if rng.random() < 0.2:
                core += rng.choice(TAILS)
            clause = subject + core if core.startswith("'s") else f"{subject} {core}"
        if _normal(clause) not in held:
            return clause


def _composed_sentences(clauses: list[str], subject: str, rng: random.Random) -> str:
    """As ``_sentences``, with more headers and distractors, and two clauses of the same
    subject joined by "and" or ", and"."""
    prefix = subject + " "
    joinable = len(clauses) == 2 and all(c.startswith(prefix) for c in clauses)
    if joinable and rng.random() < 0.4:
        joint = rng.choice((" and ", ", and "))
        clauses = [clauses[0] + joint + clauses[1].removeprefix(prefix)]
    sentences = [c[0].upper() + c[1:] + "." for c in clauses]
    distractors = (*DISTRACTORS, *EXTRA_DISTRACTORS)
    for distractor in rng.sample(distractors, rng.choice((0, 0, 1, 2))):
        sentences.insert(rng.randint(0, len(sentences)), distractor)
    return rng.choice((*HEADERS, *EXTRA_HEADERS)) + " ".join(sentences) + "\n"


def composed_question(kind: str, subject: str, rng: random.Random) -> str:
    """A question of ``kind`` for training: a training template, or a frame asking for
    the kind's value with a phrase naming whose (now and then lower-case, or without
    its question mark, as typed into a chat); never a held-out template."""
    held = heldout_questions(subject)
    frames, refs = COMPOSED_QUESTIONS[kind]
    while True:
        if rng.random() < 0.4:
            text = pick(QUESTIONS[kind], "train", rng).format(s=subject)
        else:
            ref, possessive = rng.choice(refs)
            usable = [f for f in frames if possessive is not None or "{xp}" not in f]
            frame = rng.choice(usable)
            text = frame.format(x=ref, xp=possessive or "").format(s=subject)
            text = text[0].upper() + text[1:]
            if not frame.startswith("{") and rng.random() < 0.1:
                text = text[0].lower() + text[1:]
            if rng.random() < 0.1:
                text = text.rstrip("?.")
        if _normal(text) not in held:
            return rng.choice(PREFIXES) + text
