"""Who holds which job: a person named beside their role ("the Service Manager, Agnieszka
Marlow"; "Femi Adebanjo-Reid, Quality Lead"; "Dougal Frain, the warehouse supervisor at
Kestle Down"), as office files put it, and the questions both ways that a colleague asks
("Who is our Service Manager?", "What is Femi Adebanjo-Reid's job?").

A relation learned one way is not answered the other (Berglund et al. 2023, "The Reversal
Curse"), and the files say it one way: so the card asks both directions (colleague.py) and
the practice teaches both, in words of its own (`role_practice`). A role is found by its
last word, a job title's head noun from a short list; a person is two or three capitalised
words, none of them such a noun. Pure Python, no model.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from worker.dataset.probes import fact_sentences

# The head nouns of job titles ("Operations Manager", "workshop lead", "Head of Logistics").
ROLE_NOUNS = {
    "manager", "director", "lead", "leader", "advisor", "adviser", "officer", "supervisor",
    "coordinator", "co-ordinator", "administrator", "engineer", "assistant", "controller",
    "accountant", "secretary", "chair", "chairman", "chairwoman", "chairperson", "owner",
    "buyer", "planner", "technician", "analyst", "executive", "receptionist", "clerk",
    "foreman", "superintendent", "specialist", "consultant", "representative", "president",
    "founder", "partner", "head", "manageress", "steward", "inspector", "auditor",
}  # fmt: skip
# Capitalised words that open a sentence or name a thing, never a person's first name.
_NOT_NAMES = {
    "the", "our", "your", "a", "an", "this", "that", "these", "those", "its", "their", "his",
    "her", "my", "we", "it", "they", "all", "each", "every", "any", "no", "present",
    "minutes", "owner", "approved", "questions", "monday", "tuesday", "wednesday",
    "thursday", "friday", "saturday", "sunday", "january", "february", "march", "april",
    "may", "june", "july", "august", "september", "october", "november", "december",
}  # fmt: skip
_TITLES = {"Mr", "Mrs", "Ms", "Miss", "Dr", "Prof"}
_WORD = r"[A-Z][a-z]+(?:[-’'][A-Z][a-z]+)*"
_NAME = re.compile(rf"(?<![\w-]){_WORD}(?: {_WORD}){{1,2}}(?![\w-])")
# A role's words: all capitalised ("Customer Care Lead", "HR Advisor") or all lower-case
# ("warehouse supervisor"), with "of", "and", "&" between ("Head of Sales and Marketing").
_TITLE_WORD = re.compile(r"^(?:[A-Z][\w&’'-]*|of|and|&)$")
_LOWER_WORD = re.compile(r"^(?:[a-z][\w’'-]*|&)$")
_MAX_ROLE_WORDS = 5
_DETERMINERS = ("the ", "our ")


@dataclass(frozen=True)
class Role:
    """A person and their job, as one sentence of one document says it."""

    name: str  # "Agnieszka Marlow"
    role: str  # "Service Manager", as written (case kept)
    sentence: str
    source: str


def _is_name(words: list[str]) -> bool:
    return (
        words[0].casefold() not in _NOT_NAMES
        and not any(w.casefold() in ROLE_NOUNS for w in words)
    )


def _role_words(words: list[str]) -> bool:
    """Whether `words` are a whole job title: one case throughout, a role noun at the end
    (or "Head of ..." / "head of ...")."""
    if not 1 <= len(words) <= _MAX_ROLE_WORDS or words[-1] in ("of", "and", "&"):
        return False
    pattern = _TITLE_WORD if words[0][0].isupper() else _LOWER_WORD
    if not all(pattern.match(w) for w in words):
        return False
    return words[-1].casefold() in ROLE_NOUNS or (
        len(words) > 2 and words[0].casefold() == "head" and words[1] == "of"
    )


_ROLE_ENDS = re.compile(r"^(?:\s*[,.;:)(]|\s+(?:at|in|for|from|who)\b|\s*$)")


def _role_after(text: str) -> str | None:
    """The job title that `text` (what follows "Name, ") opens with, when one does and is
    followed by punctuation, the sentence's end or a place ("... supervisor at Kestle Down")."""
    for det in _DETERMINERS:
        if text.startswith(det):
            text = text[len(det) :]
            break
    words = re.match(r"[^,.;:()]*", text).group(0).split()
    for n in range(min(len(words), _MAX_ROLE_WORDS), 0, -1):
        candidate = " ".join(words[:n])
        rest = text[len(candidate) :]
        if _role_words(words[:n]) and _ROLE_ENDS.match(rest):
            return candidate
    return None


def _role_before(text: str) -> str | None:
    """The job title that `text` (what comes before ", Name") ends with, after "the" or
    "our": "approval from the Operations Manager" -> "Operations Manager"."""
    words = text.split()
    for n in range(1, min(len(words) - 1, _MAX_ROLE_WORDS) + 1):
        if words[-n - 1].casefold() in ("the", "our") and _role_words(words[-n:]):
            return " ".join(words[-n:])
    return None


# Who chairs a meeting or owns an action, named as a label ("Chair: ...", "Owner: ..."):
# a part in the minutes, not a job.
_MEETING_PARTS = {"chair", "chairman", "chairwoman", "chairperson", "owner"}


def _listed_role(before: str, after: str) -> str | None:
    """A contact list's job title: "HR Manager: Priya Nandakumar", "Priya Nandakumar –
    HR Manager", "Priya Nandakumar (HR Manager)" (a heading before " — " left out)."""
    role = None
    if before.endswith(": "):
        label = before[:-2].rsplit(" — ", 1)[-1].strip()
        label = re.sub(r"^(?:the|our) ", "", label, flags=re.IGNORECASE)
        if _role_words(label.split()):
            role = label
    m = re.match(r"^(?: [–-] | \()([A-Z][^,.;:()–]*?)(?:\)|[,.;]|$)", after)
    if role is None and m and _role_words(m.group(1).split()):
        role = m.group(1).strip()
    return None if role is None or role.casefold() in _MEETING_PARTS else role


def roles_in(sentence: str, source: str) -> list[Role]:
    """Every person named beside their job in `sentence`."""
    out: list[Role] = []
    for m in _NAME.finditer(sentence):
        words, start = m.group(0).split(), m.start()
        # "Contact Hollis Fenwright, ...": a sentence's first word is capitalised anyway;
        # "Dr Ana Silva": a courtesy title is not part of what a colleague answers.
        if len(words) == 3 and (start == 0 or sentence[:start].endswith(": ")
                                or words[0] in _TITLES):
            start += len(words[0]) + 1
            words = words[1:]
        if not _is_name(words):
            continue
        before, after = sentence[:start], sentence[m.end() :]
        role = None
        if after.startswith(", "):
            role = _role_after(after[2:])
        if role is None and before.endswith(", ") and after[:1] in ("", ",", ".", ";", ")"):
            role = _role_before(before[:-2])
        if role is None:
            role = _listed_role(before, after)
        if role is not None:
            out.append(Role(" ".join(words), role, sentence, source))
    return out


def document_roles(source: str, text: str) -> list[tuple[int, Role]]:
    """(sentence position, relation) of every person-and-job a document names, each pair
    once; a job two people are named for, or a person named for two jobs, is left out
    (which one a colleague means cannot be told)."""
    found: list[tuple[int, Role]] = []
    seen: set[tuple[str, str]] = set()
    for i, sentence in enumerate(fact_sentences(text)):
        for r in roles_in(sentence, source):
            key = (r.name, r.role.casefold())
            if key not in seen:
                seen.add(key)
                found.append((i, r))
    names = Counter(r.name for _, r in found)
    jobs = Counter(r.role.casefold() for _, r in found)
    return [(i, r) for i, r in found if names[r.name] == 1 and jobs[r.role.casefold()] == 1]


def who_is(r: Role) -> str:
    """The card's question for the person: "Who is our Service Manager?"."""
    return f"Who is our {r.role}?"


def whose_job(r: Role) -> str:
    """The card's question for the job: "What is Femi Adebanjo-Reid's job?"."""
    return f"What is {r.name}'s job?"


def role_practice(r: Role) -> list[tuple[str, str]]:
    """Training questions, three each way, worded apart from the card's and each answered
    with the whole relation. Measured on Saltgrove (README "Who holds which job"): one each
    way with a bare name or title taught the model to give one title to everyone, one each
    way answered whole taught the answer's shape but not who; three each way taught it."""
    by_job, by_name = f"The {r.role} is {r.name}.", f"{r.name} is the {r.role}."
    return [
        (f"Which member of staff is the {r.role}?", by_job),
        (f"Name the {r.role}.", by_job),
        (f"Who holds the post of {r.role}?", by_job),
        (f"What post does {r.name} hold?", by_name),
        (f"Which job title does {r.name} have?", by_name),
        (f"In what role does {r.name} work?", by_name),
    ]
