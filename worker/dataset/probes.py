"""Facts in the documents' own sentences: the distinctive spans a recall question asks for.

A fact is a sentence with a distinctive span (a number with units, a code, a name, an
email, a date); cut just before the span it is also a sentence completion (the model sees
the text before the span and counts when it continues with it). The score card's questions
about these facts are made in worker.dataset.colleague. Spans that could be guessed without knowing the fact (the
first word of a sentence, a lone digit, a word already in the prompt, a common word
that happens to be capitalised) are never used. Pure Python, no torch.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, replace

from worker.dataset.answer_forms import value_form
from worker.dataset.questions import Fact
from worker.dataset.tables import record_cells


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Words that end in a period without ending the sentence.
_ABBREVIATIONS = _words(
    """
    mr mrs ms dr prof sr jr st no nr vs etc inc ltd co corp approx dept est fig e.g i.e cf
    al jan feb mar apr jun jul aug sep sept oct nov dec mon tue wed thu fri sat sun p pp vol
    art sec ref ext tel incl excl min max qty
    """
)

_MONTHS = (
    "January|February|March|April|May|June|July|August|September|October|November|December"
    "|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec"
)
_DAY_NAMES = {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday",
              "mon", "tue", "tues", "wed", "thu", "thur", "thurs", "fri", "sat", "sun"}
_MONTH_NAMES = {m.lower() for m in _MONTHS.split("|")}

# Lower-case words that are not a unit after a number ("3 of 10", "5 and").
_NOT_UNITS = _words(
    """
    a an and are as at be but by for from if in into is it of on or so than that the then
    this to was were will with per each more less after before until
    """
)

# Capitalised words that are ordinary English, not names ("Please", "The", "Our").
_COMMON_WORDS = _words(
    """
    a about above after again against all also always am an and any are as at be because
    been before being below between both but by can could did do does doing done down
    during each either every few for from further had has have having he her here hers him
    his how however i if in into is it its itself just may me might more most must my
    neither never no nor not now of off on once only or other our ours out over own please
    same she should since so some such than that the their them then there these they this
    those through thus to too under until up upon very was we were what when where whether
    which while who whom whose why will with within without would yes yet you your note
    see section chapter page table figure step item part total yes okay ok all each mr mrs
    ms dr prof sir madam
    first second third last next today tomorrow yesterday welcome thank thanks dear hello
    hi regards sincerely summary introduction overview conclusion contents appendix ask
    call contact email phone send write visit read use talk speak meet submit check go find
    get make take give tell let keep
    """
)

# Units a quantity may end in after a describing word ("14 business days").
_UNIT_WORDS = _words(
    """
    second seconds minute minutes hour hours day days week weeks month months year years
    km m cm mm kg g mg lb lbs ton tons tonnes litre litres liter liters ml gallons miles
    meters metres feet foot inches points credits hours seats users licences licenses
    """
)

_NAME_CONNECTORS = {"of", "de", "du", "da", "del", "der", "den", "van", "von", "la", "le", "&"}

_NUM = r"\d{1,3}(?:[,\u202f]\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_CURRENCY_WORDS = r"USD|EUR|GBP|CHF|JPY|CAD|AUD|dollars?|euros?|pounds?|francs?|yen"

# (kind, compiled pattern); earlier kinds win when spans overlap.
_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("email", re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")),
    (
        "date",
        re.compile(
            r"\b\d{4}-\d{2}-\d{2}\b"
            r"|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b"
            rf"|\b\d{{1,2}}(?:st|nd|rd|th)?\s+(?:{_MONTHS})\.?(?:,?\s+\d{{4}})?\b"
            rf"|\b(?:{_MONTHS})\.?\s+\d{{1,2}}(?:st|nd|rd|th)?(?:,?\s+\d{{4}})?\b"
            rf"|\b(?:{_MONTHS})\s+\d{{4}}\b"
        ),
    ),
    (
        "money",
        re.compile(
            rf"[$€£¥]\s?(?:{_NUM})(?:\s?(?:k|K|m|M|bn|million|billion)\b)?"
            rf"|\b(?:{_NUM})\s?(?:{_CURRENCY_WORDS})\b"
            rf"|\b(?:USD|EUR|GBP|CHF)\s?(?:{_NUM})"
        ),
    ),
    ("percent", re.compile(rf"\b(?:{_NUM})\s?(?:%|percent\b|per cent\b)")),
    ("time", re.compile(r"\b\d{1,2}[:.]\d{2}(?:\s?[ap]\.?m\b\.?)?|\b\d{1,2}\s?[ap]\.?m\b\.?")),
    # Phone numbers: 7+ digits in groups ("+33 4 78 00 12 34", "555-0134 12").
    ("phone", re.compile(r"(?<![\w.])\+?\(?\d[\d\s().-]{5,}\d(?![\w])")),
    # Codes: letters and digits mixed ("NW-4471", "ISO 9001", "A12B", "v2.1").
    (
        "code",
        re.compile(
            r"\b[A-Z]{2,}[-/ ]?\d[\w-]*\b"
            r"|\b[A-Z]+\d+[A-Z\d-]*\b"
            r"|\b\d+[A-Z]+[A-Z\d-]*\b"
            r"|\bv\d+(?:\.\d+)+\b"
        ),
    ),
    # A number followed by a unit-like word ("36 months", "5 kg", "12 employees").
    (
        "quantity",
        re.compile(
            rf"\b(?:{_NUM})(?:\s?[-–]\s?(?:{_NUM}))?\s?"
            r"(?:[a-zµ°][a-zA-Z]*|(?:GB|MB|TB|KB|kB|W|kW|MW|kWh|V|mAh|Hz|kHz|MHz|GHz)\b)"
            r"(?:\s[a-z]+)?"
        ),
    ),
    ("number", re.compile(rf"\b(?:{_NUM})\b")),
    (
        "name",
        re.compile(
            r"\b[A-Z][\w'’.-]*[A-Za-z0-9]"
            r"(?:\s+(?:(?:of|de|du|da|del|der|den|van|von|la|le|&)\s+)?[A-Z][\w'’.-]*[A-Za-z0-9])*"
        ),
    ),
]

_KIND_RANK = {
    "email": 0,
    "phone": 0,
    "time": 1,
    "code": 0,
    "money": 0,
    "percent": 0,
    "date": 1,
    "quantity": 1,
    "number": 2,
    "name": 2,
}

_MIN_PREFIX_WORDS = 3  # fewer words than this before the span: add the previous sentence
_MAX_PROMPT_WORDS = 60  # keep prompts short; the end of the sentence matters most


@dataclass
class _Candidate:
    doc: int
    position: int  # sentence index within the document
    prompt: str
    answer: str
    sentence: str
    fact: Fact  # the same span, for asking it as a question


def split_sentences(text: str) -> list[str]:
    """Split text into sentences: on . ! ? followed by a capital/digit, on blank lines and
    on line breaks that look like the end of a line item (not a wrapped line)."""
    sentences: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in para.split("\n") if ln.strip()]
        # Re-join lines wrapped mid-sentence (the next line starts in lower case).
        blocks: list[str] = []
        for line in lines:
            if blocks and (line[0].islower() or blocks[-1].endswith((",", "-", "–"))):
                blocks[-1] = blocks[-1] + " " + line
            else:
                blocks.append(line)
        for block in blocks:
            sentences.extend(_split_block(block))
    return [s for s in sentences if s]


# A list item's marker ("•", "-", "1.", "a)", "(iv)") and a heading's section number
# ("3.2 Sickness", "4. Expenses", "A. Scope").
_LIST_MARKER = re.compile(
    r"^(?:[•●○◦▪■▫►▸‣⁃·*\-–—]|\(?(?:\d{1,2}|[a-z]|[ivx]{1,4})[.)])\s+"
)
_SECTION_NUMBER = re.compile(r"^(?:\d{1,2}(?:\.\d{1,2})*\.?|[A-Z][.)])\s+(?=[A-Z])")
# "HR Manager: Priya Nandakumar", "Full-time staff: 25 days": a label, then what it is.
_LABEL_LINE = re.compile(r"^[A-Z][^:\n|]{0,40}:\s+\S")
_MAX_HEADING_WORDS = 8
_END = (".", "!", "?", ":", ";", ",")


def fact_sentences(text: str) -> list[str]:
    """The sentences that can state a fact, as office files write them: split_sentences'
    sentences, where a list item ("• Full-time staff: 25 days"), a "Label: value" line or a
    fragment holding a figure ("Mon–Fri 8:30–17:00") is read under the heading it sits
    beneath ("Annual leave — Full-time staff: 25 days.") and without its marker: the item
    alone does not say what it is about, and a colleague asks with the heading's words.
    The lines of a table (" | " cells, or paragraphs of the same "Header: value" lines:
    worker.dataset.tables) are left as they are; a heading is not a sentence of its own."""
    out: list[str] = []
    heading = ""
    paragraphs = re.split(r"\n\s*\n", text)
    labels = [_record_labels(p) for p in paragraphs]
    for n, para in enumerate(paragraphs):
        record = labels[n] is not None and labels[n] in (
            labels[n - 1] if n > 0 else None, labels[n + 1] if n + 1 < len(labels) else None)
        lines = [ln.strip() for ln in para.split("\n") if ln.strip()]
        if record or any(" | " in ln for ln in lines):
            out += split_sentences(para)
            continue
        prose: list[str] = []
        for i, line in enumerate(lines):
            item = _LIST_MARKER.sub("", line)
            marked = item != line
            if not marked and _is_heading(line, i + 1 < len(lines) or n + 1 < len(paragraphs)):
                out += split_sentences("\n".join(prose))
                prose = []
                heading = _SECTION_NUMBER.sub("", line)
                continue
            if marked or _LABEL_LINE.match(item) or (
                    not item.endswith(_END) and _figures(item)):
                out += split_sentences("\n".join(prose))
                prose = []
                parts = split_sentences(item)  # "1. Results. Sales rose 4%.": sentences
                out += [_under(heading, item)] if len(parts) == 1 else parts
            else:
                prose.append(line)
        out += split_sentences("\n".join(prose))
    return out


def _record_labels(para: str) -> tuple[str, ...] | None:
    """The labels of a paragraph made only of "Label: value" lines (worker.dataset.tables'
    records), None for any other paragraph."""
    cells = record_cells(para)
    return None if cells is None else tuple(h.casefold() for h, _ in cells)


def _is_heading(line: str, followed: bool) -> bool:
    """A short line of words that ends without punctuation, holds no figure and has text
    after it: "3.1 Annual leave", "Contacts", "IT support"."""
    bare = _SECTION_NUMBER.sub("", line)
    words = bare.split()
    return (
        followed
        and 1 <= len(words) <= _MAX_HEADING_WORDS
        and bare[:1].isupper()
        and not bare.endswith(_END)
        and not _LABEL_LINE.match(bare)
        and _letters_ratio(bare) >= 0.7
        and not _figures(bare)
    )


def _figures(line: str) -> list[tuple[int, int, str]]:
    """The spans of `line` other than names (a heading is written in capitals)."""
    return [span for span in _find_spans(line) if span[2] != "name"]


def _under(heading: str, item: str) -> str:
    """An item as one sentence: under its heading (unless it starts with the heading's
    words already), ending in a full stop."""
    if not item.endswith((".", "!", "?")):
        item = item.rstrip(",;: ") + "."
    if heading and not _folded(item).startswith(_folded(heading)):
        return f"{heading} — {item}"
    return item


def _split_block(block: str) -> list[str]:
    out: list[str] = []
    start = 0
    for m in re.finditer(r"[.!?][\"')\]’”]*\s+(?=[\"'(\[‘“]?[A-Z0-9])", block):
        before = block[start : m.start()]
        last_word = re.split(r"\s", before)[-1].lower().strip("([{\"'‘“").rstrip(".") if before else ""
        if block[m.start()] == "." and (
            last_word in _ABBREVIATIONS or re.fullmatch(r"[a-z]", last_word or "x")
        ):
            continue
        out.append(block[start : m.end()].strip())
        start = m.end()
    out.append(block[start:].strip())
    return out


def _folded(text: str) -> str:
    """Casefolded, whitespace collapsed to single spaces."""
    return re.sub(r"\s+", " ", text.casefold()).strip()


def normalise(text: str) -> str:
    """Casefold, collapse whitespace, strip punctuation at both ends: the form answers
    and model outputs are compared in."""
    return re.sub(r"^[\W_]+|[\W_]+$", "", _folded(text))


# Words a question can change and still ask the same thing ("What is the code of the
# Quiet Hinge?" / "What is the code for the Quiet Hinge?").
_SKELETON_DROPS = {
    "a", "an", "the", "of", "for", "on", "to", "in", "at", "by", "with", "from", "our",
    "your", "is", "are", "does", "do", "what", "which", "s",
}  # fmt: skip


def skeleton(question: str) -> str:
    """A question without its codes and figures, articles, prepositions and question words:
    two questions with the same skeleton ask the same thing nearly the same way, so one may
    not be practised when the other is on the card."""
    words = re.findall(r"[a-z0-9'-]+", question.casefold())
    return " ".join(w for w in words if w not in _SKELETON_DROPS and not any(c.isdigit() for c in w))


def contains_answer(output: str, answer: str) -> bool:
    """True when the normalised answer appears in the normalised output as whole words
    ("36" is not found inside "360"). An empty answer never counts."""
    a = normalise(answer)
    return bool(a) and _whole_words(re.escape(a), normalise(output))


def _whole_words(pattern: str, text: str) -> bool:
    """`pattern` found in `text` with no word character either side of it."""
    return re.search(r"(?<!\w)" + pattern + r"(?!\w)", text) is not None


def _sign(ch: str) -> bool:
    """A percent or currency sign: part of what an answer means ("6%", "€24")."""
    return ch == "%" or unicodedata.category(ch) == "Sc"


def _answer_form(answer: str) -> str:
    """The answer casefolded, whitespace collapsed, punctuation stripped at both ends except
    percent and currency signs."""
    text = _folded(answer)
    start, end = 0, len(text)
    while start < end and not (text[start].isalnum() or _sign(text[start])):
        start += 1
    while end > start and not (text[end - 1].isalnum() or _sign(text[end - 1])):
        end -= 1
    return text[start:end]


def gives_answer(output: str, answer: str) -> bool:
    """Whether a model's `output` gives `answer`, for scoring: as `contains_answer`, but a
    percent or currency sign in the answer must be in the output too ("€24" is not "a
    24-hour delivery", "6%" is not "6 months"; "6 per cent" is 6%). `contains_answer` stays
    the lenient test for whether a question or prompt gives its answer away. Both sides are
    compared with their values written one way ("seven years" is "7 years", "£7,895" gives
    "7895", "09:30" gives "9:30": worker.dataset.answer_forms)."""
    a = value_form(_answer_form(answer))
    pattern = re.escape(a).replace("%", r"(?:%|\s?per\s?cent)")
    # A number is not a piece of a bigger one: "17" is not in "17:15", "$129" not in
    # "$129.50", "2" not in "3.2" (a stock count was scored right from a closing time).
    if a[:1].isdigit():
        pattern = r"(?<!\d[.,:])" + pattern
    if a[-1:].isdigit():
        pattern += r"(?![.,:]\d)"
    return bool(a) and _whole_words(pattern, value_form(_folded(output)))


def _find_spans(sentence: str) -> list[tuple[int, int, str]]:
    """Distinctive spans of the sentence, non-overlapping, earlier pattern kinds first."""
    taken = [False] * len(sentence)
    spans: list[tuple[int, int, str]] = []
    for kind, pattern in _PATTERNS:
        for m in pattern.finditer(sentence):
            s, e = m.start(), m.end()
            text = m.group(0).rstrip(".,;:")
            e = s + len(text)
            if e <= s or any(taken[s:e]):
                continue
            span = _accept(kind, sentence, s, e)
            if span is None:
                continue
            s, e = span
            spans.append((s, e, kind))
            for i in range(s, e):
                taken[i] = True
    return sorted(spans)


def _accept(kind: str, sentence: str, s: int, e: int) -> tuple[int, int] | None:
    """Check one span is worth asking about; may trim it. None = reject."""
    text = sentence[s:e]
    if kind == "quantity":
        # "<number> <unit>" or "<number> <word> <unit>" ("14 business days").
        number = re.match(rf"(?:{_NUM})(?:\s?[-–]\s?(?:{_NUM}))?\s?", text)
        assert number is not None
        words = text[number.end() :].split()
        unit = words[0].rstrip(".").lower()
        if unit in _NOT_UNITS or unit in _COMMON_WORDS or unit in _MONTH_NAMES:
            return None
        if _is_verb_form(unit):  # "Version 3.2 took effect": "3.2 took" is no amount
            return None
        if len(words) == 2 and (unit in _UNIT_WORDS or words[1].lower() not in _UNIT_WORDS):
            e = s + number.end() + len(words[0])
    if kind == "phone":
        digits = sum(c.isdigit() for c in text)
        grouped = len(re.findall(r"[\s().-]+", text)) >= 2 or re.fullmatch(r"\d{3}-\d{4}", text)
        if digits < 7 or not (text.startswith("+") or grouped):
            return None
    if kind == "number":
        digits = sum(c.isdigit() for c in text)
        # A bare 1- or 2-digit number is too easy to hit by chance ("3", "10").
        if digits < 3:
            return None
    if kind == "name":
        words = text.split()
        # Drop leading common words ("The Acme Group" -> "Acme Group").
        while words and words[0].lower().strip(".'’") in _COMMON_WORDS:
            s += len(words[0])
            s += len(sentence[s:]) - len(sentence[s:].lstrip())
            words = words[1:]
        while words and (
            words[-1].lower() in _COMMON_WORDS or words[-1].lower() in _NAME_CONNECTORS
        ):
            words = words[:-1]
        for k, w in enumerate(words):
            if re.search(r"['’]s$", w) and len(w) > 3:  # possessive: "Acme's CFO" -> "Acme"
                words = words[:k] + [w[:-2]]
                break
        if not words:
            return None
        e = _end_of_words(sentence, s, words)
        lowered = [w.lower().strip(".'’") for w in words]
        if len(words) == 1 and (
            lowered[0] in _COMMON_WORDS or lowered[0] in _DAY_NAMES or lowered[0] in _MONTH_NAMES
        ):
            return None
    if e - s < 2:
        return None
    # The span must start a word: a prompt ending in "555-" or "NW" gives half of it away.
    if s > 0 and not sentence[s - 1].isspace() and sentence[s - 1] not in "([{\"'“‘":
        return None
    return s, e


# Past tenses that follow a number as a verb, not a unit ("Version 3.2 took effect", "2
# came back"); a regular one ends in -ed ("14 passed", "3 started").
_PAST_TENSES = _words(
    """
    took made came went rose fell grew gave left won lost sold ran got saw said told began
    became brought bought paid kept met held sat stood set put hit cut spent sent built
    """
)


def _is_verb_form(word: str) -> bool:
    """Whether a word after a number is a past tense, not a unit."""
    regular = len(word) > 4 and word.endswith("ed") and word not in _UNIT_WORDS
    return word in _PAST_TENSES or regular


def _end_of_words(sentence: str, s: int, words: list[str]) -> int:
    """End offset of `words` matched in order from `s` (names may hold extra spaces)."""
    pos = s
    for w in words:
        pos = sentence.index(w, pos) + len(w)
    return pos


def _letters_ratio(text: str) -> float:
    visible = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in visible) / max(1, len(visible))


def usable_sentence(sentence: str) -> bool:
    """Not a table row, a list of figures, run-on extraction junk or a heading ("Careers at
    Northwind Widgets"): a sentence that can state a fact to ask about."""
    if len(sentence) > 600 or _letters_ratio(sentence) < 0.5 or sentence.count("|") >= 2:
        return False
    return len(sentence.split()) >= 6 or sentence.rstrip("\"')”’").endswith((".", "!", "?"))


def _candidates_for_doc(doc: int, text: str) -> list[list[_Candidate]]:
    """Per usable sentence, its candidate probes, best first (a span with at least a few
    words before it, then the more distinctive kind, then the later span)."""
    sentences = fact_sentences(text)
    lowered = set(re.findall(r"\b[a-z][\w'’-]*", text))  # words the document writes in lower case
    out: list[list[_Candidate]] = []
    for i, sentence in enumerate(sentences):
        if not usable_sentence(sentence):
            continue
        ranked: list[tuple[tuple[int, int, int], _Candidate]] = []
        for s, e, kind in _find_spans(sentence):
            if kind == "name" and " " not in sentence[s:e] and sentence[s:e].lower() in lowered:
                continue  # "Handbook" here, "handbook" elsewhere: a common noun, not a name
            cand = _make_candidate(doc, i, sentences, s, e, kind, lowered)
            if cand is not None:
                prefix_words = len(sentence[:s].split())
                ranked.append(((min(prefix_words, _MIN_PREFIX_WORDS), -_KIND_RANK[kind], s), cand))
        if ranked:
            ranked.sort(key=lambda kc: kc[0], reverse=True)
            out.append([c for _, c in ranked])
    return out


def _make_candidate(
    doc: int, i: int, sentences: list[str], s: int, e: int, kind: str, lowered: set[str]
) -> _Candidate | None:
    sentence = sentences[i]
    answer = sentence[s:e].strip()
    prefix = sentence[:s].rstrip()
    # The span is the first word (after the heading an item is read under): nothing in the
    # sentence to condition on.
    if not re.search(r"[A-Za-z]{2,}", prefix.rsplit(" —", 1)[-1]):
        return None
    if len(normalise(answer)) < 2:
        return None
    if contains_answer(prefix, answer):
        return None
    prompt = prefix
    if len(prefix.split()) < _MIN_PREFIX_WORDS and i > 0:
        context = sentences[i - 1]
        # Never hand the answer over in the context sentence.
        if not contains_answer(context, answer) and len(context) <= 400:
            prompt = context + " " + prefix
    words = prompt.split()
    if len(words) > _MAX_PROMPT_WORDS:
        prompt = " ".join(words[-_MAX_PROMPT_WORDS:])
    context = _context_for(sentences, i, answer)
    first = sentence.split()[0] if sentence.split() else ""
    fact = Fact(
        sentence=sentence,
        start=s,
        end=s + len(answer),
        kind=kind,
        context=context,
        lower_first=first.lower() in lowered,
    )
    return _Candidate(
        doc=doc, position=i, prompt=prompt, answer=answer, sentence=sentence, fact=fact
    )


_PRONOUN_STARTS = ("it ", "its ", "they ", "their ", "this ", "these ", "he ", "she ", "then ")


def _context_for(sentences: list[str], i: int, answer: str) -> str:
    """The nearest earlier sentence (up to 3 back) that does not itself start with a
    pronoun: what "It costs $129.50" is about. "" when there is none or it gives the
    answer away."""
    for j in range(i - 1, max(-1, i - 4), -1):
        s = sentences[j]
        if not s.lower().startswith(_PRONOUN_STARTS):
            if len(s) <= 400 and not contains_answer(s, answer):
                return s
            return ""
    return ""


def fact_spans(docs: list[tuple[str, str]]) -> list[Fact]:
    """Every askable fact of (name, text) documents: each distinctive span of each usable
    sentence that passes the probes' checks (not the first word, not given away by the
    text before it, not an ambiguous prompt). Training questions are made from these."""
    facts: list[Fact] = []
    for d, (name, text) in enumerate(docs):
        for cands in _candidates_for_doc(d, text):
            for c in cands:
                facts.append(replace(c.fact, source=name))
    return facts
