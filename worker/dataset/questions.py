"""Questions about a fact sentence, in several phrasings, made with templates (no model).

A fact is a sentence with a distinctive span (the answer): "Every employee receives 27 days
of paid annual leave." -> "27 days". From it we make questions the way people ask them:

- probe phrasings (kept out of training, so recall measures answering, not recitation):
  `fronted`  "How many days does every employee receive?"
  `subject`   "Which code is a silent self-closing hinge?" (the span is the sentence's subject)
  `in_situ`  "Every employee receives how many days?"  (when no fronted form can be made)
- training phrasings (other templates, other wording):
  `echo`        "Every employee receives how many days of paid annual leave?" (whole sentence)
  `fill_blank`  'Fill in the blank: "Every employee receives ___ of paid annual leave."'
  `complete`    "Complete this sentence from the employee handbook: Every employee receives"
  `topic`       "What does the employee handbook say about paid annual leave?"
  `fronted`     only for facts that are not probed.

Pure Python; the grammar is deliberately small. A question that cannot be made well is not
made (None), rather than made badly.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

PROBE_TEMPLATES = ("fronted", "subject", "in_situ")
TRAIN_TEMPLATES = ("echo", "fill_blank", "complete", "topic", "fronted")

_AUX = {
    "is", "are", "was", "were", "can", "could", "may", "might", "must", "will", "would",
    "should", "shall", "has", "have", "had",
}  # fmt: skip
_PREPOSITIONS = {
    "of", "in", "on", "at", "by", "for", "from", "to", "with", "within", "into", "after",
    "before", "until", "about", "over", "under", "between", "near", "via", "per", "every",
    "than", "around", "across", "through", "during", "since",
}  # fmt: skip
_ARTICLES = {"a", "an", "the"}
_PRONOUNS = {"it", "its", "they", "their", "this", "these", "that", "those", "he", "she", "his",
             "her", "them"}  # fmt: skip
# First words of a subject that are written in lower case inside a question.
_LOWER_IN_QUESTION = _ARTICLES | _PRONOUNS | {
    "our", "your", "my", "we", "you", "every", "each", "all", "some", "any", "no", "one",
    "office", "plant", "staff", "employees", "applications", "claims", "prices", "payments",
}  # fmt: skip
# A word naming the kind of thing the span is ("extension 5050", "requisition NW-J-208").
_LABELS = {
    "extension", "ext", "number", "code", "version", "requisition", "room", "model", "line",
    "ticket", "reference", "order", "part", "item", "gate", "floor", "building", "aisle",
    "dock", "route", "flight", "account", "id", "badge", "form", "policy", "clause", "article",
    "band", "channel", "port", "pin", "platform", "desk", "bay", "unit", "suite", "release",
}  # fmt: skip
# Words ending in "s" that are not third-person verbs.
_NOT_VERBS = {
    "is", "was", "has", "does", "this", "his", "its", "as", "us", "plus", "thus", "always",
    "perhaps", "sometimes", "series", "news", "less", "unless", "across", "various", "hours",
    "days", "weeks", "months", "years", "staff", "business", "process", "address", "access",
    "themselves", "ourselves", "yourselves",
}  # fmt: skip
_PLACE_PREPOSITIONS = {"in", "at", "on", "near", "inside", "outside"}
_CONJUNCTIONS = {"and", "or", "but", "nor", "so", "yet", "which", "who", "that", "where", "when"}
_PERSON_PREPOSITIONS = {"by", "from", "to", "with", "for"}


@dataclass(frozen=True)
class Fact:
    """A sentence, the span in it that is the answer, and where it came from."""

    sentence: str
    start: int
    end: int
    kind: str  # probes' span kind: money, percent, quantity, number, date, time, code, name...
    context: str = ""  # the sentence before it in the document ("" if none)
    source: str = ""  # document name
    # The sentence's first word is an ordinary word ("Laptops are ..."), written in lower
    # case inside a question; False for a name ("Northwind Widgets was ...").
    lower_first: bool = False

    @property
    def answer(self) -> str:
        return self.sentence[self.start : self.end].strip()

    @property
    def prefix(self) -> str:
        return self.sentence[: self.start].rstrip()

    @property
    def suffix(self) -> str:
        """What follows the span, without the sentence's final punctuation."""
        return re.sub(r"[\s.!?;:]+$", "", self.sentence[self.end :])

    @property
    def needs_context(self) -> bool:
        """The sentence leans on the one before ("It costs ...", "Then head to ...")."""
        words = self.prefix.split()
        first = words[0].lower().strip("(\"'") if words else ""
        return bool(self.context) and (first in _PRONOUNS or len(words) < 3)

    @property
    def standalone(self) -> str:
        """The sentence, with the one before it when it needs it to make sense."""
        return f"{self.context} {self.sentence}" if self.needs_context else self.sentence


def title_of(source: str) -> str:
    """ "employee_handbook.pdf" -> "the employee handbook"; "" -> "our documents"."""
    stem = PurePath(source).stem if source else ""
    words = re.sub(r"[_\-.]+", " ", stem).strip()
    return f"the {words.lower()}" if words else "our documents"


# ---------------------------------------------------------------------------------------
# The question word for a span


def _clean_prefix(prefix: str) -> str:
    """Drop a dangling opening bracket or list dash, and a trailing article."""
    prefix = re.sub(r"^[-–•*]\s*", "", prefix.strip())
    prefix = re.sub(r"\s*[(\[]\s*$", "", prefix)
    words = prefix.split()
    while words and words[-1].lower() in _ARTICLES:
        words.pop()
    return " ".join(words)


def wh_phrase(kind: str, answer: str, prefix: str, suffix: str = "") -> tuple[str, str, str]:
    """(question phrase, prefix, suffix to use with it): "27 days" -> ("how many days", ...).

    A label right before the span moves into the phrase ("on extension" + "5050" -> "what
    extension"), and so does a noun right after a name ("the Ledgerline portal" -> "which
    portal").
    """
    prefix = _clean_prefix(prefix)
    words = prefix.split()
    last = words[-1].lower().strip("(,:") if words else ""
    after = suffix.split()
    nxt = after[0] if after else ""
    if last in _LABELS and kind in ("number", "code", "phone", "quantity"):
        return f"what {last}", " ".join(words[:-1]), suffix
    if kind == "money":
        return "how much", prefix, suffix
    if kind == "percent":
        return "what percentage", prefix, suffix
    if kind == "quantity":
        unit = re.sub(r"^[\d.,\u202f]+(?:\s?[-–]\s?[\d.,]+)?\s*(?:to\s+[\d.,]+\s*)?", "", answer)
        unit = unit.strip()
        return (f"how many {unit}" if unit and unit[0].isalpha() else "how many"), prefix, suffix
    if kind == "number":
        digits = answer.replace(",", "")
        if digits.isdigit() and 1800 <= int(digits) <= 2100:
            return "what year", prefix, suffix
        return "what number", prefix, suffix
    simple = {
        "date": "what date",
        "time": "what time",
        "phone": "what phone number",
        "email": "what email address",
        "code": "what code",
    }
    if kind in simple:
        return simple[kind], prefix, suffix
    # A name. Followed by a plain noun it names a thing: "which portal".
    if (
        nxt.isalpha()
        and nxt.islower()
        and nxt not in _PREPOSITIONS | _ARTICLES | _AUX | _CONJUNCTIONS
        and (len(words) >= 2 or not _lemma(nxt))  # "Priya Castellanos hands out": a verb
    ):
        return f"which {nxt}", prefix, " ".join(after[1:])
    if last in ("called", "named", "titled"):
        return "what", prefix, suffix
    if last in _PERSON_PREPOSITIONS:
        return "whom", prefix, suffix
    if last in _PLACE_PREPOSITIONS:
        return "where", " ".join(words[:-1]), suffix
    return "who", prefix, suffix


def _capitalise(text: str) -> str:
    return text[:1].upper() + text[1:]


def _subject_case(words: list[str], lower_first: bool = False) -> list[str]:
    if words and (lower_first or words[0].lower() in _LOWER_IN_QUESTION):
        return [words[0].lower(), *words[1:]]
    return words


def _lemma(verb: str) -> str | None:
    """Base form of a third-person verb: "receives" -> "receive", "carries" -> "carry"."""
    v = verb.lower()
    if v in _NOT_VERBS or not v.isalpha() or len(v) < 4 or not v.endswith("s") or v.endswith("ss"):
        return None
    if v.endswith("ies"):
        return v[:-3] + "y"
    if v.endswith(("ches", "shes", "sses", "xes", "zes", "oes")):
        return v[:-2]
    return v[:-1]


def _fronted(wh: str, prefix: str, lower_first: bool = False) -> str | None:
    """Move the question phrase to the front: "Every employee receives" + "how many days" ->
    "How many days does every employee receive?". None when the sentence has no simple
    subject-verb start this can handle."""
    words = prefix.split()
    if not words or len(words) > 24 or any(w.endswith((",", ";", ":")) for w in words[:-1]):
        return None
    front = "Who" if wh == "whom" else _capitalise(wh)
    for i in range(1, min(7, len(words))):
        low = words[i].lower()
        subject, rest = " ".join(_subject_case(words[:i], lower_first)), words[i + 1 :]
        if low in _AUX:
            after = rest[0].lower() if rest else ""
            if low not in ("has", "have", "had") or after.endswith(("ed", "en")) or after == "been":
                return f"{front} {low} {' '.join([subject, *rest])}".rstrip() + "?"
            # "has a lifetime warranty": a main verb, asked with do.
            do = {"has": "does", "have": "do", "had": "did"}[low]
            return f"{front} {do} {' '.join([subject, 'have', *rest])}".rstrip() + "?"
        if low in _PREPOSITIONS or low in _ARTICLES:
            return None  # past the subject without finding its verb
        lemma = _lemma(words[i])
        # A verb is followed by its object (the span, a number, an article...), not by
        # another plain word: "Fire drills take place" has no verb at "drills".
        nxt = rest[0] if rest else ""
        if lemma and (
            not nxt
            or not nxt.isalpha()
            or not nxt.islower()
            or nxt in _ARTICLES
            or nxt in _PREPOSITIONS
            or nxt in _LOWER_IN_QUESTION
        ):
            return f"{front} does {' '.join([subject, lemma, *rest])}".rstrip() + "?"
    return None


# ---------------------------------------------------------------------------------------
# Phrasings


def _opens_aside(prefix: str, suffix: str) -> bool:
    """A span that opens its line and is followed by a comma: "Linus Pemberton-Yau, IT
    Manager.", "Document QP-07, revision D, ...". No verb says what it does, so no question
    can be made around it ("Who , IT Manager?" is not one)."""
    return len(prefix.split()) < 2 and suffix.strip()[:1] in tuple(",;:)")


def _with_context(fact: Fact, question: str) -> str:
    return f"{fact.context} {question}" if fact.needs_context else question


def probe_question(fact: Fact) -> tuple[str, str]:
    """(template, question) in a held-out phrasing: fronted when possible, else in place;
    a span that is the sentence's subject is asked about with the rest of the sentence."""
    wh, prefix, suffix = wh_phrase(fact.kind, fact.answer, fact.prefix, fact.suffix)
    if len(prefix.split()) < 2 and suffix.strip() and not _opens_aside(prefix, suffix):
        # The span is the subject: the rest of the sentence says what it is about.
        name = re.match(r"(?:[A-Z][\w'’.-]*\s?)+", suffix.strip())
        if wh.startswith("what ") and name:  # "NW-3109 Quiet Hinge is ..."
            return "subject", f"What is the {wh.split()[-1]} of the {name.group(0).strip()}?"
        phrase = "which " + wh.split()[-1] if wh.startswith("what ") else wh
        phrase = "who" if phrase == "whom" else phrase
        return "subject", f"{_capitalise(phrase)} {suffix.strip()}?"
    fronted = _fronted(wh, prefix, fact.lower_first)
    if fronted:
        return "fronted", _with_context(fact, fronted)
    body = f"{prefix} {wh}".strip() if prefix else wh
    return "in_situ", _with_context(fact, _capitalise(body) + "?")


def _topic(fact: Fact) -> str:
    """A few words saying what the sentence is about, from around the span."""
    after = re.split(r"[,;:(]", fact.suffix, maxsplit=1)[0].split()
    while after and (after[0].lower() in _PREPOSITIONS | _ARTICLES | {"and", "or"}):
        after = after[1:]
    if len(after) >= 2:
        return " ".join(after[:8])
    before = _clean_prefix(fact.prefix).split()
    while before and before[-1].lower() in _PREPOSITIONS | _ARTICLES | _AUX:
        before = before[:-1]
    return " ".join(before[-6:])


def training_questions(fact: Fact, probed: bool) -> list[tuple[str, str, str]]:
    """(template, question, answer) pairs that teach the fact. For a probed fact, never the
    template of its probe question (so the probe stays unseen)."""
    probe_template, probe_text = probe_question(fact)
    out: list[tuple[str, str, str]] = []
    title = title_of(fact.source)
    answer_sentence = fact.standalone
    wh, prefix, rest = wh_phrase(fact.kind, fact.answer, fact.prefix, fact.suffix)

    if not (probed and probe_template in ("in_situ", "subject")) and not _opens_aside(prefix, rest):
        rest = rest.strip()
        gap = "" if not rest or rest[0] in ",;:)" else " "
        echo = f"{prefix} {wh}{gap}{rest}".strip()
        out.append(("echo", _with_context(fact, _capitalise(echo) + "?"), answer_sentence))
    blank = f"{fact.prefix} ___{fact.sentence[fact.end :]}".strip()
    out.append(("fill_blank", f'Fill in the blank from {title}: "{blank}"', fact.answer))
    if fact.prefix:
        out.append(
            ("complete", f"Complete this sentence from {title}: {fact.prefix}", fact.sentence)
        )
    topic = _topic(fact)
    if topic and len(topic.split()) >= 2:
        out.append(("topic", f"What does {title} say about {topic}?", answer_sentence))
    if not probed and probe_template in ("fronted", "subject"):
        out.append(("fronted", probe_text, answer_sentence))
    if not probed:
        return out
    # Never a training question that reads like the probe.
    probe_norm = _norm(probe_text)
    return [(t, q, a) for t, q, a in out if _norm(q) != probe_norm]


def _norm(text: str) -> str:
    return re.sub(r"\W+", " ", text.casefold()).strip()
