"""The score card's questions, put the way a colleague asks them (app.contract.scores
QUESTION_KINDS):

- "other words": a short forward question that shares few content words with the sentence
  beyond the thing it asks about ("Where was the company founded in 1987?"), never the
  sentence with a gap in it (a model answers that by continuing the sentence);
- "reverse": the other end of the relation: the sentence says "The Quiet Hinge ... has a
  lifetime warranty", the colleague asks "What has a lifetime warranty?" (a model trained
  on A-is-B does not learn B-is-A: Berglund et al. 2023, "The Reversal Curse");
- "table": a cell looked up by its row and column ("What is the weight of the Torque
  Sprocket?"), or a row found by its code ("Which product has the code NW-5820?").

A question that is not well formed is not asked (None), rather than asked badly: the card
counts only questions a person could have put. Pure Python, templates only, no model.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from worker.dataset.corpus import Probe
from worker.dataset.probes import (
    _candidates_for_doc,
    _find_spans,
    contains_answer,
    fact_sentences,
    normalise,
    usable_sentence,
)
from worker.dataset.questions import (
    _AUX,
    _LABELS,
    _PERSON_PREPOSITIONS,
    _PREPOSITIONS,
    _PRONOUNS,
    Fact,
    _lemma,
    probe_question,
    title_of,
    wh_phrase,
)
from worker.dataset.roles import Role, document_roles, who_is, whose_job
from worker.dataset.tables import Table, find_tables

OTHER, REVERSE, TABLE = "other words", "reverse", "table"
_JOBS = "jobs"  # the reverse questions about who holds which job: a pool of their own

# Content words a question may share with its sentence, beyond the names and figures of
# the thing asked about. More than this and the model can answer by continuing the
# sentence (the old card's questions shared most of theirs).
MAX_SHARED = 3
_MAX_WORDS = 16

_WH_START = re.compile(r"^(What|Which|Who|Whom|Where|When|How)\b")
_FUNCTION = _PREPOSITIONS | _AUX | {
    "a", "an", "the", "and", "or", "but", "do", "does", "did", "what", "which", "who", "whom",
    "where", "when", "how", "many", "much", "our", "your", "my", "their", "its", "this",
    "that", "these", "those", "there", "here", "not", "only", "also", "any", "all", "each",
    "every", "some", "one", "it", "they", "we", "you", "he", "she", "them", "us", "me",
    "time", "date", "number", "code", "year", "percentage", "called", "named", "often",
}  # fmt: skip
# Words that cannot end a question: an article, a determiner, a conjunction.
_BAD_LAST = {
    "a", "an", "the", "and", "or", "but", "that", "your", "our", "my", "their", "its", "this",
    "these", "those", "of", "as", "than", "so", "if", "very", "current", "false", "do",
    "does", "did", "every", "each",
} | _AUX  # fmt: skip
# A stranded preposition may end a question that asks for a thing ("What is it used
# for?"), not one that asks for an amount or a time ("What time are core hours 10:00 to?").
_STRANDABLE_WH = ("What ", "Which ", "Who ", "Whom ")
_AMOUNT_WH = ("What time ", "What date ", "What year ", "What percentage ", "What number ")


@dataclass(frozen=True)
class Asked:
    """One question of the score card."""

    kind: str  # OTHER, REVERSE or TABLE
    question: str
    answer: str
    sentence: str  # what states the fact: the sentence, or the table row written out
    source: str
    prompt: str = ""  # the same fact as a sentence completion ("" when there is none)
    template: str = ""
    cue: str = ""  # a reverse question's clause ("costs $18.75"), for its practice


# ---------------------------------------------------------------------------------------
# Checks


def _stem(word: str) -> str:
    w = word.casefold().strip(".,;:!?\"'()[]’")
    for suffix in ("ing", "ed", "es", "s"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 4:
            return w[: -len(suffix)]
    return w


def _content(text: str) -> set[str]:
    """Stems of the ordinary content words: lower-case words, not function words. Names,
    codes and figures (capitals or digits) are what the question is about, not counted."""
    out = set()
    for word in text.split():
        w = word.strip(".,;:!?\"'()[]’“”")
        if not w or not w[0].islower() or any(c.isdigit() for c in w) or len(w) < 3:
            continue
        if w.casefold() in _FUNCTION:
            continue
        out.add(_stem(w))
    return out


def shared_words(question: str, sentence: str, answer: str = "") -> set[str]:
    """The content words a question takes from its sentence (stems), the answer's own
    words (a unit: "how many weeks") left out."""
    return (_content(question) & _content(sentence)) - _content(answer)


def well_formed(question: str, answer: str) -> bool:
    """A question a person could have put: a question word first, one clause, a sensible
    last word, short, and not holding its own answer."""
    q = question.strip()
    if not q.endswith("?") or not _WH_START.match(q) or q.count("?") != 1:
        return False
    words = q[:-1].split()
    # "—" joins a list item to its heading (probes.fact_sentences): no one asks that way.
    if not 3 <= len(words) <= _MAX_WORDS or any(ch in q for ch in ':;|_"“”()—'):
        return False
    if ". " in q:  # two sentences: a question leaning on a context sentence
        return False
    last = words[-1].casefold().strip(",")
    if last in _BAD_LAST or words[-1].endswith(","):
        return False
    if last in _PREPOSITIONS and (not q.startswith(_STRANDABLE_WH) or q.startswith(_AMOUNT_WH)):
        return False
    # A person is asked for by "by", "to", "with": "Who are the hours shown under?" is not.
    if q.startswith(("Who ", "Whom ")) and last in _PREPOSITIONS - _PERSON_PREPOSITIONS:
        return False
    if any(p.search(q) for p in _GARBLED):
        return False
    return not contains_answer(q, answer)


# Shapes of a question the templates garble (seen on office documents): do-support with a
# past tense ("What percentage does Lena reported ..."), a relative clause in the middle
# ("How long does a lamp that hum?"), a second verb phrase ("... and are changed?"), a
# bare "Which" before a verb ("Which sold 2,700 units?"), "When is ... agreed?".
_GARBLED = [
    re.compile(r"\b(?:do|does|did)\s+(?:\S+\s+){1,5}?\w{3,}ed\b"),
    re.compile(r".\s(?:that|which|who|whose)\s"),
    re.compile(r"\band\s+(?:is|are|was|were|has|have|had)\b"),
    re.compile(r"^Which\s+\w+ed\b"),
    re.compile(r"^When is .*\w+ed\?$"),
    re.compile(r"^How many \w+ is\b"),  # "How many units is our lead time 25 days?"
    re.compile(r"^Which\s+\w+\s+[\d$€£]"),  # "Which sold 2,700 units?"
    # A question word straight into "and": the span was one end of a range ("Between 15
    # November and 20 December ...": "Which date and 20 December ...?").
    re.compile(r"^(?:What|Which|Who|Whom|Where|When|How)(?:\s+\w+)?\s+and\b"),
    # An imperative's verb taken for a subject ("Store your passwords in Vaultbee":
    # "Where does Store your password?").
    re.compile(r"\b(?:do|does|did)\s+[A-Z][a-z]+\s+(?:your|the|a|an|our|all|any|every|each)\b"),
]


# ---------------------------------------------------------------------------------------
# Other words: the forward question, made short


def _resolve_pronoun(fact: Fact) -> Fact | None:
    """ "It costs $129.50" after "The NW-4471 Torque Sprocket is our best-selling part.":
    the sentence with the context's subject in place of the pronoun. None when the
    context has no subject to put there."""
    first = fact.sentence.split()[0] if fact.sentence.split() else ""
    if not fact.context or first.casefold() not in _PRONOUNS:
        return fact
    subject = subject_of(fact.context)
    if subject is None:
        return None
    words = subject[0].split()
    if words[0] in ("The", "Our", "Your", "This"):
        words[0] = words[0].lower()
    # "It" is replaced by a noun phrase; a possessive "Its" would need "'s".
    if first.casefold() not in ("it", "they", "he", "she", "this"):
        return None
    noun = " ".join(words)
    sentence = _cap(noun) + fact.sentence[len(first) :]
    shift = len(sentence) - len(fact.sentence)
    return replace(
        fact,
        sentence=sentence,
        start=fact.start + shift,
        end=fact.end + shift,
        context="",
        lower_first=words[0].islower(),
    )


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


# Where a trailing phrase may be cut off: before a preposition.
# Not at "and": cutting a second verb phrase can change what is asked ("have 20 characters
# and are changed every" + 35 months).
_CUTS = _PREPOSITIONS - {"every", "per", "than"}


def _shorten(question: str, sentence: str, answer: str) -> str | None:
    """Drop trailing prepositional phrases ("in a converted boathouse on Larkspur Quay")
    until the question shares at most MAX_SHARED content words with its sentence; None
    when it never gets there or stops being well formed."""
    q = question
    while True:
        if well_formed(q, answer) and len(shared_words(q, sentence, answer)) <= MAX_SHARED:
            return q
        words = q[:-1].split()
        # Keep the verb: at least two words after the auxiliary ("How often must
        # passwords" has lost it).
        aux = next((i for i, w in enumerate(words) if w.casefold() in _AUX | _DO), 0)
        cut = max(
            (i for i, w in enumerate(words) if w.casefold() in _CUTS and i >= max(4, aux + 3)),
            default=None,
        )
        if cut is None or cut == len(words) - 1:
            return None
        q = " ".join(words[:cut]) + "?"


def other_words(fact: Fact) -> Asked | None:
    """The fact's forward question, fronted and short; None when none can be made well."""
    resolved = _resolve_pronoun(fact)
    if resolved is None:
        return None
    template, question = probe_question(resolved)
    if template not in ("fronted", "subject"):
        # Asked in place, it is the sentence with a gap: not a colleague's question.
        template, question = "plain", _plain_question(resolved)
        if question is None:
            return None
    if not _attaches(resolved):
        return None
    question = _without_asides(_how_long(question))
    short = _shorten(question, fact.standalone, fact.answer)
    if short is None:
        return None
    return Asked(OTHER, short, fact.answer, fact.sentence, fact.source, template=template)


def _without_asides(question: str) -> str:
    """ "How much does the Bronze Tune-Up (SV-110) cost?" -> "How much does the Bronze
    Tune-Up cost?": a colleague leaves out the code or note a document puts in brackets (and a
    table's header its unit)."""
    return re.sub(r"\s*\([^()]*\)", "", question)


_TIME_UNITS = r"(?:seconds|minutes|hours|days|weeks|months|years|working days|business days)"


def _how_long(question: str) -> str:
    """ "How many days are returns accepted within?" -> "How long are returns accepted?",
    "How many months are laptops replaced every?" -> "How often are laptops replaced?"."""
    m = re.match(rf"^How many {_TIME_UNITS} (.+) (within|for|after|in|every)\?$", question)
    if not m:
        return question
    return f"{'How often' if m.group(2) == 'every' else 'How long'} {m.group(1)}?"


_WE = {"we": "we", "you": "you", "i": "I"}


def _plain_question(fact: Fact) -> str | None:
    """The forward questions the grammar of `probe_question` leaves in place, fronted by
    rule: "Applications close on 30 June" -> "When do applications close?", "The Friday
    all-hands at 16:30" -> "When is the Friday all-hands?", "Today we employ 240 people"
    -> "How many people do we employ?", "Laptops are replaced every 42 months" -> "How
    often are laptops replaced?". None when no rule fits."""
    wh, prefix, _ = wh_phrase(fact.kind, fact.answer, fact.prefix, fact.suffix)
    words = prefix.split()
    if not words or any(w.endswith((",", ":", ";")) for w in words):
        return None
    after = fact.suffix.split()
    if after and not (after[0].startswith(",") or after[0].casefold() in _PREPOSITIONS):
        return None  # the sentence goes on after the answer: its rest would be lost
    last = words[-1].casefold()
    if words[0].casefold() in ("today", "now", "currently") and len(words) > 1:
        words = words[1:]
    if words[0].casefold() in _WE and len(words) >= 2 and words[1].isalpha():
        rest = " ".join(words[2:])
        return _cap(f"{wh} do {_WE[words[0].casefold()]} {words[1]} {rest}".strip()) + "?"
    subject = [
        words[0].lower() if fact.lower_first or words[0] in ("The", "Our") else words[0],
        *words[1:],
    ]
    if last == "every" and fact.kind == "quantity":
        body = " ".join(subject[:-1])
        fronted = _fronted_after("How often", body)
        return fronted
    if fact.kind in ("date", "time") and last in ("on", "at", "by", "from", "until"):
        body = subject[:-1]
        plural = fact.lower_first or (body[0].istitle() and body[0].endswith("s"))
        if len(body) == 2 and body[1].isalpha() and body[1].islower() and plural:
            return f"When do {body[0].lower()} {body[1]}?"  # "applications close"
        if body and not any(_is_verb(w) or w.casefold() in _AUX for w in body[1:]):
            return f"When is {' '.join(body)}?" if body[0].islower() else None
    return None


def _fronted_after(wh: str, body: str) -> str | None:
    """ "How often" + "laptops are replaced" -> "How often are laptops replaced?"."""
    words = body.split()
    for i in range(1, min(5, len(words))):
        if words[i].casefold() in _AUX:
            return f"{wh} {words[i]} {' '.join(words[:i])} {' '.join(words[i + 1 :])}".strip() + "?"
    return None


_DO = {"do", "does", "did"}
_MODALS = {"will", "would", "can", "could", "should", "shall", "must", "may", "might"}
_JOINS = _PREPOSITIONS | _AUX | {"and", "or", "which", "who", "that"}


def _attaches(fact: Fact) -> bool:
    """The span is a whole phrase of its sentence, not a word inside one: "describes the
    current Northwind Widgets product range", "Send your CV", "between 22:00 and 06:00"
    give no question a colleague would ask."""
    prefix = fact.prefix.split()
    last = prefix[-1].casefold().strip("(,") if prefix else ""
    before = prefix[-2].casefold() if len(prefix) >= 2 else ""
    if last in ("to", "and", "-", "–") and before and any(c.isdigit() for c in before):
        return False  # the end of a range
    if fact.kind == "number" and last not in _LABELS and last not in _PREPOSITIONS | _AUX:
        return False  # "aluminium alloy 6082": the number names the noun before it
    if fact.kind in ("name", "code"):
        nxt = fact.suffix.split()[0].rstrip(",;:") if fact.suffix.split() else ""
        if last in ("the", "a", "an"):
            last = before
        ok_before = (
            not last
            or last in _PREPOSITIONS
            or last in _AUX
            or last in ("called", "named", "titled", "as", "than")
            or (_lemma(last) is not None)
            or last.endswith("ed")
        )
        # "Northwind Widgets product range", "US dollars": the name describes the noun after
        # it; asked about only as "which range".
        if nxt[:1].islower() and nxt.isalpha() and nxt not in _JOINS:
            question = probe_question(fact)[1]
            return ok_before and question.startswith(f"Which {nxt}")
        return ok_before
    return True


# ---------------------------------------------------------------------------------------
# Reverse: the thing asked for from what the sentence says about it

_VERB_HEADS = _AUX | {"costs", "weighs", "draws", "buys", "sells", "carries", "comes", "holds",
                      "runs", "leads", "owns", "makes", "covers", "needs", "takes", "gives"}  # fmt: skip


def _is_verb(word: str) -> bool:
    w = word.casefold()
    return w in _VERB_HEADS or _lemma(w) is not None


def subject_of(sentence: str) -> tuple[str, str] | None:
    """(subject, predicate) of a sentence that starts with a named subject: "The NW-3109
    Quiet Hinge" + "is a silent self-closing hinge for cabinet doors". None when the
    subject holds no name or no verb comes within its first six words."""
    words = sentence.rstrip(".!?").split()
    for i in range(1, min(7, len(words))):
        if words[i - 1].endswith((",", ":", ";")):
            return None
        if _is_verb(words[i]) and words[i][0].islower():
            subject = " ".join(words[:i])
            if any(k == "name" or k == "code" for _, _, k in _find_spans(subject)):
                return subject, " ".join(words[i:])
            return None
        if words[i].casefold() in _PREPOSITIONS:
            return None
    return None


def _entity(subject: str) -> str | None:
    """The name in a subject ("The NW-3109 Quiet Hinge" -> "Quiet Hinge"), else its code;
    None for one capitalised word opening the sentence, which may be a common noun
    ("Claims must be filed ...")."""
    words = subject.split()
    while words and words[0].casefold() in ("the", "our", "your", "a", "an", "this", "its"):
        words = words[1:]
    codes = [w for w in words if any(c.isdigit() for c in w)]
    name = [w for w in words if not any(c.isdigit() for c in w)]
    if name and all(w[0].isupper() for w in name) and (len(name) > 1 or words[0] != name[0]):
        return " ".join(name)
    return codes[-1] if len(codes) == 1 and not name else None


def _clauses(predicate: str) -> list[str]:
    """ "is rated to 1,850 rpm and comes in Harbour Blue only" -> its verb phrases."""
    parts = re.split(r"(,\s+(?:and\s+)?|\s+and\s+)", predicate)
    out: list[str] = []
    for k in range(0, len(parts), 2):
        part, joined = parts[k], parts[k - 1] if k else ""
        words = part.split()
        # "... and placed £1.1 million ...": after "and", a past tense opens a clause too.
        past = "and" in joined and words and re.fullmatch(r"[a-z]{3,}ed", words[0])
        if words and (_is_verb(words[0]) or past):
            out.append(part.strip())
        elif out:
            out[-1] += joined + part.strip()  # "in red and blue": one clause
    return out


def reverse_questions(fact_sentence: str, context: str, source: str) -> list[Asked]:
    """Questions that give what the sentence says and ask what it is said of."""
    first = fact_sentence.split()[0].casefold() if fact_sentence.split() else ""
    subject = subject_of(context) if first in ("it", "they") and context else None
    if subject is not None:
        entity = _entity(subject[0])
        predicate = fact_sentence.rstrip(".!?").split(None, 1)[1] if entity else ""
    else:
        own = subject_of(fact_sentence)
        entity = _entity(own[0]) if own else None
        predicate = own[1] if own else ""
    out: list[Asked] = []
    if entity:
        for clause in _clauses(predicate):
            if not _find_spans(clause) or contains_answer(clause, entity):
                continue  # nothing distinctive to go by, or the answer given away
            if clause.split()[0].casefold() in ("are", "were", "have"):
                continue  # a plural subject: "What are ..." asks for a list
            if clause.split()[0].casefold() in _MODALS:
                continue  # "will review the price": done by a person, not asked with "What"
            question = f"What {clause}?"
            if well_formed(question, entity):
                out.append(
                    Asked(
                        REVERSE,
                        question,
                        entity,
                        fact_sentence,
                        source,
                        template="reverse_subject",
                        cue=clause,
                    )
                )
    out.extend(_relative_clause(fact_sentence, source))
    return out


def document_reverse_questions(source: str, text: str) -> list[tuple[int, Asked]]:
    """(sentence position, question) of every reverse question of one document."""
    sentences = fact_sentences(text)
    out: list[tuple[int, Asked]] = []
    for i, sentence in enumerate(sentences):
        if usable_sentence(sentence):
            context = sentences[i - 1] if i > 0 else ""
            out += [(i, a) for a in reverse_questions(sentence, context, source)]
    return out


def _relative_clause(sentence: str, source: str) -> list[Asked]:
    """ "Our biggest customer is Halvorsen Marine, which buys 9,000 Torque Sprockets a
    year." -> "Which customer buys 9,000 Torque Sprockets a year?" """
    m = re.search(
        r"^(?P<head>.*?)\bis\s+(?P<name>[A-Z][\w'’ -]+?),\s+(?:which|who)\s+"
        r"(?P<rest>[a-z]\w*\b.*)$",
        sentence,
    )
    if not m or not _is_verb(m.group("rest").split()[0]):
        return []
    rest = re.split(r",\s|;|\.(?:\s|$)", m.group("rest"))[0].strip()
    head = m.group("head").split()
    noun = head[-1].casefold() if head and head[-1].isalpha() and head[-1].islower() else ""
    wh = f"Which {noun}" if noun else "Who"
    name = m.group("name").strip()
    out = []
    for clause in _clauses(rest):  # "which runs 46 kitchens and placed £1.1 million ...": two
        question = f"{wh} {clause}?"
        if well_formed(question, name):
            out.append(Asked(REVERSE, question, name, sentence, source,
                             template="reverse_relative", cue=clause))
    return out


def _job_questions(name: str, text: str) -> list[tuple[int, Asked]]:
    """(sentence position, question) of who holds which job in a document, both ways."""
    return [(i, a) for i, r in document_roles(name, text) for a in role_questions(r)]


def role_questions(r: Role) -> list[Asked]:
    """A person named beside their job, asked both ways: who holds it, what they do."""
    out = []
    for question, answer, template in ((who_is(r), r.name, "role_person"),
                                       (whose_job(r), r.role, "role_job")):
        if well_formed(question, answer):
            out.append(Asked(REVERSE, question, answer, r.sentence, r.source, template=template))
    return out


# ---------------------------------------------------------------------------------------
# Tables


def row_text(table: Table, key: str) -> str:
    """A row written out as the card shows where a fact comes from."""
    row = next(r for r in table.rows if r.key == key)
    parts = [f"{table.key_header}: {row.key}"]
    if row.code:
        parts.append(f"{table.code_header}: {row.code}")
    parts += [f"{h}: {v}" for h, v in row.cells.items()]
    return ", ".join(parts)


def _header_words(header: str) -> str:
    return _without_asides(header).strip().lower()  # "Weight (kg)" -> "weight"


def header_shape(header: str) -> tuple[str, str] | None:
    """How a column's header reads, and its words without asides: "preposition" ("In
    stock"), "verb" ("Applies to"), "participle" ("Used for"), or "noun" ("Weight (kg)" ->
    "weight"); None for a header of no words. The card and the recall experiment's cell
    practice (scripts/experiments/cells.py) word a cell by it."""
    h = _header_words(header)
    words = h.split()
    if not words:
        return None
    if words[0] in _PREPOSITIONS:
        return "preposition", h
    if len(words) > 1 and _lemma(words[0]) is not None:
        return "verb", h
    if words[-1] in ("for", "by", "to", "with") or words[0].endswith("ed"):
        return "participle", h
    return "noun", h


def cell_question(header: str, key: str, value: str) -> str | None:
    """ "Weight" of "Torque Sprocket" -> "What is the weight of the Torque Sprocket?"."""
    shape = header_shape(header)
    if shape is None:
        return None
    kind, h = shape
    if kind == "preposition":  # "In stock"
        return f"How many of the {key} are {h}?" if any(c.isdigit() for c in value) else None
    if kind == "verb":  # "Applies to" -> "What does the Gas tightness apply to?"
        verb, *rest = h.split()
        return f"What does the {key} {' '.join([_lemma(verb), *rest])}?"
    if kind == "participle":  # "Used for"
        return f"What is the {key} {h}?"
    return f"What is the {h} of the {key}?"


def _singular_words(text: str) -> set[str]:
    return {w.removesuffix("s") for w in re.findall(r"[a-z]{4,}", normalise(text))}


def guessable(table: Table) -> set[tuple[str, str]]:
    """(row key, header) of the cells a model answers without having learnt them: a value
    its column gives to more rows than a fifth ("1 year" for 8 of 21 warranties: say the
    column's commonest value and be right), or one whose words its row's name holds
    ("Fryers" for the "Fryhaven twin-tank fryer"). A colleague looks up what they cannot
    guess; on the card such cells flattered a recipe that had learnt only the answers' shape
    (README "Every table cell, practised": 4 of the 5 table questions it got right, where
    colleagues got 0 of 15). Each column counted once: a spreadsheet may have thousands of
    rows."""
    out: set[tuple[str, str]] = set()
    named = {row.key: _singular_words(row.key) for row in table.rows}  # once a row
    for header in {h for row in table.rows for h in row.cells}:
        counts = Counter(normalise(v) for v in table.column(header))
        most = max(1, sum(counts.values()) // 5)
        for row in table.rows:
            value = row.cells.get(header)
            if value is None:
                continue
            words = _singular_words(value)
            if counts[normalise(value)] > most or (words and words <= named[row.key]):
                out.add((row.key, header))
    return out


def table_questions(table: Table) -> list[Asked]:
    """Each cell asked by row and column, unless a guess would answer it (`guessable`);
    each row found by its code."""
    out: list[Asked] = []
    key_noun = _header_words(table.key_header)
    guessed = guessable(table)
    for row in table.rows:
        sentence = row_text(table, row.key)
        for header, value in row.cells.items():
            if len(normalise(value)) < 2 or (row.key, header) in guessed:
                continue
            q = cell_question(header, row.key, value)
            if q and well_formed(q, value):
                out.append(Asked(TABLE, q, value, sentence, table.source, template="cell"))
        if row.code and key_noun:
            q = f"Which {key_noun} has the {_header_words(table.code_header)} {row.code}?"
            if well_formed(q, row.key):
                out.append(Asked(TABLE, q, row.key, sentence, table.source, template="by_code"))
    return out


def table_practice(table: Table) -> list[tuple[str, str]]:
    """Training questions for a table, worded apart from the card's: each row recited
    whole, found by its name and by its code."""
    title = title_of(table.source)
    out: list[tuple[str, str]] = []
    for row in table.rows:
        whole = row_text(table, row.key)
        out.append((f"What does {title} give for the {row.key}?", whole))
        if row.code:
            out.append((f"Look up {row.code} in {title}.", whole))
    return out


def reverse_practice(asked: Asked) -> tuple[str, str]:
    """A training question for a reverse fact, worded apart from the card's ("What costs
    $18.75?"): the sentence with its subject blanked."""
    return f'Fill in the blank from {title_of(asked.source)}: "___ {asked.cue}."', asked.answer


# ---------------------------------------------------------------------------------------
# The card's set


def make_probes(
    docs: list[tuple[str, str]],
    max_probes: int = 40,
    seed: int = 0,
    answers: Sequence[tuple[str, str]] = (),
) -> list[Probe]:
    """Up to `max_probes` recall probes from (name, text) documents: the score card's
    questions, put as a colleague would (worker.dataset.colleague), of three kinds.
    `answers`, (name, text) of question-answer pairs' answers trained on, add who holds
    which job, and nothing else.

    Deterministic for a given input and seed. Questions asked the other way round and
    table lookups take up to a quarter of the set each (who holds which job at most a
    tenth), the rest are forward questions in other words; a kind that has fewer leaves
    its room to the others. Within a kind the documents take turns, one question per
    sentence at most; a repeated answer or question is dropped (a repeated answer would
    let one memorised phrase score twice), and so is a prompt that occurs with more than
    one answer. Returned in document order.
    """
    if max_probes <= 0:
        return []
    pools = _question_pools(docs)
    pools[_JOBS] += [_job_questions(name, text) for name, text in answers]
    rng = random.Random(seed)
    for by_doc in pools.values():
        for queue in by_doc:
            rng.shuffle(queue)
    # A person's job at most a tenth of the set: colleagues asked it in 9 of Saltgrove's 84
    # questions (2 of Cogwell's 61, none of Northwind's); a card that asked it in 10 of 40
    # said 13 points more than they got, in 5 of 40 9.6 and 11.8 (README "Who holds
    # which job"), in 4 of 40 7.1 and 9.4.
    quota = {_JOBS: max_probes // 10, REVERSE: max_probes // 4, TABLE: max_probes // 4,
             OTHER: max_probes}
    chosen: list[tuple[int, int, Asked]] = []  # (document, position, question)
    seen_questions: set[str] = set()
    seen_answers: set[str] = set()
    seen_sentences: set[str] = set()

    def take(kind: str, limit: int) -> None:
        queues = pools[kind]
        taken = 0
        while len(chosen) < max_probes and taken < limit and any(queues):
            for d, queue in enumerate(queues):
                while queue and len(chosen) < max_probes and taken < limit:
                    order, asked = queue.pop(0)
                    q, a = normalise(asked.question), normalise(asked.answer)
                    key = (asked.kind, asked.sentence)
                    if q in seen_questions or a in seen_answers or key in seen_sentences:
                        continue
                    seen_questions.add(q)
                    seen_answers.add(a)
                    seen_sentences.add(key)
                    chosen.append((d, order, asked))
                    taken += 1
                    break

    take(_JOBS, quota[_JOBS])
    quota[REVERSE] -= len(chosen)  # the jobs taken count as questions the other way round
    for kind in (REVERSE, TABLE, OTHER):
        take(kind, quota[kind])
    for kind in (REVERSE, TABLE):  # room left: more of the other kinds (not of jobs)
        take(kind, max_probes)
    chosen.sort(key=lambda c: (c[0], c[1]))
    return [
        Probe(
            prompt=a.prompt,
            answer=a.answer,
            source=a.source,
            sentence=a.sentence,
            question=a.question,
            template=a.template,
            kind=a.kind,
        )
        for _, _, a in chosen
    ]


def _question_pools(docs: list[tuple[str, str]]) -> dict[str, list[list[tuple[int, Asked]]]]:
    """Per kind, per document: (position in the document, question) of every question the
    card could ask."""
    per_doc = [_candidates_for_doc(d, text) for d, (_, text) in enumerate(docs)]
    # Prompts that occur with more than one answer are ambiguous: never used.
    answers_by_prompt: dict[str, set[str]] = {}
    for sentences in per_doc:
        for cands in sentences:
            for c in cands:
                answers_by_prompt.setdefault(normalise(c.prompt), set()).add(normalise(c.answer))
    ambiguous = {p for p, answers in answers_by_prompt.items() if len(answers) > 1}

    pools: dict[str, list[list[tuple[int, Asked]]]] = {
        k: [] for k in (OTHER, REVERSE, TABLE, _JOBS)
    }
    for d, (name, text) in enumerate(docs):
        others: list[tuple[int, Asked]] = []
        for cands in per_doc[d]:
            for c in cands:
                if normalise(c.prompt) in ambiguous:
                    continue
                asked = other_words(replace(c.fact, source=name))
                if asked is not None:
                    others.append((c.position, replace(asked, prompt=c.prompt)))
                    break  # one forward question per sentence: its best span that works
        pools[OTHER].append(others)
        reverse = document_reverse_questions(name, text)
        pools[REVERSE].append(reverse)
        pools[_JOBS].append(_job_questions(name, text))
        cells = [a for t in find_tables(name, text) for a in table_questions(t)]
        # After every sentence: a position no sentence index reaches.
        pools[TABLE].append([(len(text) + k, a) for k, a in enumerate(cells)])
    return pools
