"""Synthetic memory tasks of any length, answers known by construction: bAbI-style state tracking and Zoology's MQAR.

**State tracking** (bAbI tasks 1-3, Weston et al. 2015, written as tokens and hidden in filler as BABILong hides
them in text). Facts of three tokens are spread over the sequence, one in each of `facts` equal stretches of random
filler at a random place in it, so that a longer sequence puts the same facts further apart; questions close it.

    qa1  `name MOVE place` facts; `WHERE name` -> the place of the name's latest move (its earlier moves are
         overwritten)
    qa2  people move (`person MOVE place`), pick up and drop objects (`person GET object`, `person DROP object`);
         `WHERE_OBJECT object` -> where the object is: where its holder is now, or where it was dropped
    qa3  the same world; `BEFORE object place` -> where the object was before it last came to that place

A person picks up an object only where it lies (or, the first time it is mentioned, anywhere) and holds one at a
time; an object moves with its holder. Each example asks `questions` questions about different names or objects; the
answer token follows each question, so that a causal model is trained and read (teacher-forced) at the token before
it. Examples are drawn again until they hold enough answerable questions.

**MQAR** (Arora et al., Zoology, 2023): the `spread` layout of `diagnose_recall.py`, reused: `pairs` key-value pairs
open the sequence, random filler follows, and every key is asked once in a random order at the end; read at longer
lengths, only the filler grows.

Every batch is `(ids (B, T), answer_positions (Q,), answers (B, Q))`: `ids[:, answer_positions] == answers`, and
the prediction read for an answer is the model's output at the position before it.
"""

import random
from dataclasses import asdict, dataclass

import torch


# ---- state tracking: one vocabulary for the three tasks ---------------------------------------------------------------

PAD, MOVE, GET, DROP, WHERE, WHERE_OBJECT, BEFORE = range(7)
NUM_NAMES, NUM_OBJECTS, NUM_PLACES, NUM_FILLER = 8, 8, 16, 64
FIRST_NAME = 7
FIRST_OBJECT = FIRST_NAME + NUM_NAMES
FIRST_PLACE = FIRST_OBJECT + NUM_OBJECTS
FIRST_FILLER = FIRST_PLACE + NUM_PLACES
STATE_VOCAB_SIZE = FIRST_FILLER + NUM_FILLER  # 103
TASKS = ("qa1", "qa2", "qa3")
QUESTION_TOKENS = {"qa1": 3, "qa2": 3, "qa3": 4}  # marker, name or object (qa3: and a place), answer


@dataclass(frozen=True)
class StateTrackingSettings:
    """What a state-tracking example holds. qa1's defaults are those of issue 62's first measurement (8 names, 16
    places, 16 facts), with 4 questions an example (more answers to learn from per token read); qa2 and qa3 use 4
    people and 4 objects, as bAbI's stories do, and 24 facts, so that objects are carried, with 2 questions."""

    task: str = "qa1"
    facts: int = 16
    names: int = 8  # qa1: names; qa2, qa3: people
    objects: int = 4
    places: int = 16
    questions: int = 2

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"no state-tracking task {self.task!r}: choose one of {', '.join(TASKS)}")
        if not (1 <= self.names <= NUM_NAMES and 1 <= self.objects <= NUM_OBJECTS and 2 <= self.places <= NUM_PLACES):
            raise ValueError(f"at most {NUM_NAMES} names, {NUM_OBJECTS} objects and {NUM_PLACES} places")
        if self.questions > (self.names if self.task == "qa1" else self.objects):
            raise ValueError("each question asks about a different name or object: too many questions")

    def shortest(self) -> int:
        """The shortest sequence: every fact with no filler, then the questions."""
        return 3 * self.facts + self.questions * QUESTION_TOKENS[self.task]

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT_STATE_SETTINGS = {
    "qa1": StateTrackingSettings("qa1", facts=16, names=8, places=16, questions=4),
    "qa2": StateTrackingSettings("qa2", facts=24, names=4, objects=4, places=16, questions=2),
    "qa3": StateTrackingSettings("qa3", facts=24, names=4, objects=4, places=16, questions=2),
}


def _qa1_story(rng: random.Random, settings: StateTrackingSettings):
    """Facts (token triples) and the questions (tokens before the answer, answer) a qa1 story asks, or None."""
    facts, where = [], {}
    for _ in range(settings.facts):
        name, place = rng.randrange(settings.names), rng.randrange(settings.places)
        facts.append((FIRST_NAME + name, MOVE, FIRST_PLACE + place))
        where[name] = place
    if len(where) < settings.questions:
        return None
    asked = rng.sample(sorted(where), settings.questions)
    return facts, [((WHERE, FIRST_NAME + name), FIRST_PLACE + where[name]) for name in asked]


def _carrying_story(rng: random.Random, settings: StateTrackingSettings):
    """A qa2 or qa3 story: facts, and per object where it is and the places it has been, in order (no repeats in a
    row)."""
    person_at, holding, holder, object_at = {}, {}, {}, {}
    history = {}  # object -> places it has been, consecutive places distinct
    facts = []
    for _ in range(settings.facts):
        moves = list(range(settings.names))
        gets = [
            (p, o)
            for p in person_at
            if p not in holding
            for o in range(settings.objects)
            if o not in holder and object_at.get(o, person_at[p]) == person_at[p]
        ]
        drops = list(holding.items())
        kind = rng.choices(("move", "get", "drop"), weights=(2, 2 if gets else 0, 1 if drops else 0))[0]
        if kind == "move":
            person, place = rng.choice(moves), rng.randrange(settings.places)
            facts.append((FIRST_NAME + person, MOVE, FIRST_PLACE + place))
            person_at[person] = place
            if person in holding:
                carried = holding[person]
                object_at[carried] = place
                if history[carried][-1] != place:
                    history[carried].append(place)
        elif kind == "get":
            person, carried = rng.choice(gets)
            facts.append((FIRST_NAME + person, GET, FIRST_OBJECT + carried))
            holding[person], holder[carried] = carried, person
            object_at[carried] = person_at[person]
            history.setdefault(carried, [person_at[person]])
        else:
            person, carried = rng.choice(drops)
            facts.append((FIRST_NAME + person, DROP, FIRST_OBJECT + carried))
            del holding[person], holder[carried]
    return facts, object_at, history


def _qa2_story(rng: random.Random, settings: StateTrackingSettings):
    facts, object_at, _ = _carrying_story(rng, settings)
    if len(object_at) < settings.questions:
        return None
    asked = rng.sample(sorted(object_at), settings.questions)
    return facts, [((WHERE_OBJECT, FIRST_OBJECT + o), FIRST_PLACE + object_at[o]) for o in asked]


def _qa3_story(rng: random.Random, settings: StateTrackingSettings):
    facts, _, history = _carrying_story(rng, settings)
    moved = sorted(o for o, places in history.items() if len(places) >= 2)
    if len(moved) < settings.questions:
        return None
    questions = []
    for carried in rng.sample(moved, settings.questions):
        places = history[carried]
        # a place the object came to, at its last arrival there: the place before it is the answer
        arrivals = [i for i in range(1, len(places)) if places[i] not in places[i + 1 :]]
        i = rng.choice(arrivals)
        questions.append(((BEFORE, FIRST_OBJECT + carried, FIRST_PLACE + places[i]), FIRST_PLACE + places[i - 1]))
    return facts, questions


STORIES = {"qa1": _qa1_story, "qa2": _qa2_story, "qa3": _qa3_story}


def state_tracking_batch(settings: StateTrackingSettings, seed: int, batch_size: int, length: int):
    """`batch_size` examples of `length` tokens, the same for the same seed: (ids, answer_positions, answers)."""
    if length < settings.shortest():
        raise ValueError(f"{settings.task} with {settings.facts} facts needs at least {settings.shortest()} tokens")
    rng = random.Random(seed)
    filler = torch.Generator().manual_seed(seed)
    ids = FIRST_FILLER + torch.randint(0, NUM_FILLER, (batch_size, length), generator=filler)
    question_length = QUESTION_TOKENS[settings.task]
    story_end = length - settings.questions * question_length
    stretch = story_end // settings.facts  # each fact lies somewhere in its own stretch of filler
    answer_positions = torch.tensor([story_end + (q + 1) * question_length - 1 for q in range(settings.questions)])
    answers = torch.empty(batch_size, settings.questions, dtype=torch.long)
    for row in range(batch_size):
        story = None
        while story is None:
            story = STORIES[settings.task](rng, settings)
        facts, questions = story
        for index, fact in enumerate(facts):
            start = index * stretch + rng.randrange(stretch - 2)
            ids[row, start : start + 3] = torch.tensor(fact)
        for q, (asked, answer) in enumerate(questions):
            start = story_end + q * question_length
            ids[row, start : start + question_length] = torch.tensor([*asked, answer])
            answers[row, q] = answer
    return ids, answer_positions, answers


# ---- MQAR: diagnose_recall's `spread` layout ------------------------------------------------------------------------

ZOOLOGY_GRID = ((64, 4), (128, 8), (256, 16), (512, 64))  # (sequence length, pairs) as Zoology trains them


def mqar_vocab_size() -> int:
    from diagnose_recall import VOCAB_SIZE

    return VOCAB_SIZE


def mqar_answer_batch(seed: int, batch_size: int, length: int, pairs: int):
    """MQAR examples in the form of `state_tracking_batch`: the answers are the values' tokens."""
    from diagnose_recall import FIRST_VALUE, mqar_batch

    ids, query_positions, values, _ = mqar_batch(
        torch.Generator().manual_seed(seed), batch_size, "spread", pairs, length
    )
    return ids, query_positions + 1, FIRST_VALUE + values
