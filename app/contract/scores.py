"""A job's scores (`Job.scores`): what the worker measured before and after training, and
for an incremental job on the version it started from. The worker validates them when it
writes the row (worker/jobs/run.py); every reader (the score card, the verdict, the
comparison, the model card, the CLI, scripts/experiments/recall.py) parses them here.

One side (`Side`) is what worker/scoring/evaluate.py returns:

- perplexity on the held-out chunks (None without any);
- the recall probes as sentence completions: n_probes, n_recalled, recall, probes;
- questions: the same facts asked as questions in the chat format, {n, n_recalled,
  recall, items}; each item records how it was put (`Question.kind`, one of
  QUESTION_KINDS; "" for older jobs);
- qa: the user's held-out question-answer pairs, token F1 and containment;
- general: the forgetting check, perplexity on a general-English sample (None: skipped);
- probe_set: a fingerprint of the probes, so two jobs can be compared on the same ones.

A part that is missing or null reads as empty (no probes, nothing measured): scores of
older jobs lack the questions and the forgetting check. Unknown keys are refused, so a new
figure is added here before either side uses it.

The headline rule: the facts asked as questions when the job measured them, else the
sentence completions (`headline_kind`, `headline_recall`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field


def _none_as(empty: Any) -> BeforeValidator:
    """null in the JSON reads as `empty` (an older or partial row)."""
    return BeforeValidator(lambda value: empty if value is None else value)


Count = Annotated[int, _none_as(0)]
Text = Annotated[str, _none_as("")]
Flag = Annotated[bool, _none_as(False)]


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, frozen=True)


class _Answered(_Part):
    answer: Text = ""
    output: Text = ""  # what the model generated (greedy)


class Probe(_Answered):
    """A fact as a sentence completion: the model continues `prompt`."""

    prompt: Text = ""
    hit: Flag = False  # the output contains the answer
    source: Text = ""  # the document it comes from


# How a question is put, in the order the score card lists them, with the card's words for
# each ("22 asked in the documents' own terms"). Defined once here: the worker records one of these
# keys on every question it asks (`Question.kind`), and a new kind is added here first.
QUESTION_KINDS: dict[str, str] = {
    # A short forward question: fronted and cut, but in the document's own terms for the thing
    # ("How often are laptops replaced?"), where a colleague uses theirs ("How often do we get
    # a new laptop?"). The key stays as jobs stored it.
    "other words": "asked in the documents' own terms",
    "reverse": "asked the other way round",  # from the other end of the relation
    "table": "looked up in a table",  # a cell of a table, by row and column
}


def _known_kind(kind: str) -> str:
    if kind and kind not in QUESTION_KINDS:
        raise ValueError(f"unknown question kind {kind!r}: not one of {list(QUESTION_KINDS)}")
    return kind


class Question(_Answered):
    """The same fact asked as a question in the chat format, worded apart from training."""

    question: Text = ""
    hit: Flag = False
    source: Text = ""
    sentence: Text = ""  # the document's sentence that states the fact
    template: Text = ""  # which wording was used
    # How the question is put: "other words", "reverse", "table" (QUESTION_KINDS); "" for
    # older jobs, whose questions stayed close to the document's own sentences.
    kind: Annotated[Text, AfterValidator(_known_kind)] = ""


class Questions(_Part):
    n: Count = 0
    n_recalled: Count = 0
    recall: float | None = None
    items: Annotated[list[Question], _none_as([])] = Field(default_factory=list)


def kind_counts(questions: Questions) -> dict[str, tuple[int, int]]:
    """(hits, n) of the questions of each kind, in QUESTION_KINDS order: only the kinds that
    occur; items without a kind (older jobs) are left out, so an older job's is empty."""
    tally = {kind: [0, 0] for kind in QUESTION_KINDS}
    for item in questions.items:
        if item.kind:
            tally[item.kind][0] += item.hit
            tally[item.kind][1] += 1
    return {kind: (hits, n) for kind, (hits, n) in tally.items() if n}


# What a colleague would see, estimated from the card's questions (README "What a colleague
# would see"). The card's forward questions keep the documents' terms for the thing ("How
# often are laptops replaced?"), and no rule can reword them (nor can the embedded model:
# README "The base model as its own paraphraser"); a colleague asks in their own ("How often
# do we get a new laptop?") and is answered less often. So the card counts its forward
# questions at these odds of the share it got right: 60% reads as 43%, 90% as 82%, none
# and all as they are. Questions the other way round and table lookups count as answered.
# Fitted with scripts/experiments/card_pool.py to six tuned models of two companies
# (Northwind, Cogwell: the default, three seeds each; the root mean square of the
# headline's gap to 60- and 61-question colleague sets is least at 0.5, 8.4 points, against
# 11.1 for the share right) and checked on a third company it was not fitted to (Saltgrove:
# 5.7 above, 5.9 and 1.4 below its colleagues on three seeds).
OWN_WORDS_ODDS = 0.5


def colleague_share(questions: Questions) -> float | None:
    """The share of a colleague's questions the model would answer, estimated from the
    card's: each kind as answered, the forward ones ("other words") at OWN_WORDS_ODDS. None
    when the questions carry no kinds (older jobs)."""
    tally = kind_counts(questions)
    if not tally:
        return None
    counted = 0.0
    for kind, (hits, n) in tally.items():
        if kind == "other words":
            rate = hits / n
            counted += n * rate * OWN_WORDS_ODDS / (1 - rate + rate * OWN_WORDS_ODDS)
        else:
            counted += hits
    return counted / sum(n for _, n in tally.values())


class General(_Part):
    """The forgetting check: perplexity on a general-English sample shipped with the app."""

    perplexity: float | None = None
    n_paragraphs: Count = 0


class QAItem(_Answered):
    """One of the user's held-out question-answer pairs."""

    question: Text = ""
    f1: float | None = None  # token F1 of the output against the answer
    contains: Flag = False  # the output contains the answer


class QA(_Part):
    n: Count = 0
    f1: float | None = None
    exact: float | None = None  # share of outputs that contain the answer
    items: Annotated[list[QAItem], _none_as([])] = Field(default_factory=list)


class Side(_Part):
    """One model's scores: before training, after it, or the previous version."""

    probe_set: str | None = None
    perplexity: float | None = None
    n_heldout_chunks: Count = 0
    recall: float | None = None
    n_probes: Count = 0
    n_recalled: int | None = None  # None: older rows that stored only `recall`
    probes: Annotated[list[Probe], _none_as([])] = Field(default_factory=list)
    questions: Annotated[Questions, _none_as({})] = Field(default_factory=Questions)
    general: Annotated[General, _none_as({})] = Field(default_factory=General)
    qa: Annotated[QA, _none_as({})] = Field(default_factory=QA)

    @property
    def measured(self) -> bool:
        """Anything was recorded for this side (an empty dict records nothing)."""
        return bool(self.model_fields_set)

    def completion_counts(self) -> tuple[int, int]:
        """(n, hits) of the sentence completions."""
        hits = self.n_recalled
        if hits is None and self.recall is not None:
            hits = round(float(self.recall) * self.n_probes)
        return self.n_probes, int(hits or 0)

    def question_counts(self) -> tuple[int, int]:
        """(n, hits) of the facts asked as questions."""
        return self.questions.n, self.questions.n_recalled


class Scores(_Part):
    """`Job.scores`: before and after training; `previous` for an incremental job (the
    version it started from, on the same probes and held-out text)."""

    before: Annotated[Side, _none_as({})] = Field(default_factory=Side)
    after: Side | None = None
    previous: Side | None = None


def as_side(side: Side | Mapping[str, Any] | None) -> Side:
    """One side from the JSON (or already parsed); None reads as nothing measured."""
    if isinstance(side, Side):
        return side
    return Side.model_validate(dict(side or {}))


def parse_scores(raw: Scores | Mapping[str, Any] | None) -> Scores:
    """`Job.scores` from the JSON; raises ValueError (pydantic's ValidationError) when it
    does not have this shape."""
    if isinstance(raw, Scores):
        return raw
    return Scores.model_validate(dict(raw or {}))


def checked_scores(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The worker's side: `raw` unchanged once it has this shape, else ValueError."""
    parse_scores(raw)
    return dict(raw)


def finite_number(value: Any) -> float | None:
    """`value` as a float, or None when it is missing, not a number, NaN or infinite (scores
    come from JSON written by the worker)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


# The headline rule


RecallKind = Literal["questions", "completion"]


def headline_kind(after: Side) -> RecallKind:
    """Questions asked in chat when the job measured them, else sentence completions."""
    return "questions" if after.questions.n else "completion"


@dataclass
class RecallFigures:
    n: int
    before: int
    after: int
    kind: RecallKind  # "questions" (asked in chat) or "completion" (sentence completions)
    # A colleague's questions answered, estimated from the kinds (`colleague_share`); None
    # where the questions carry no kinds (older jobs, completions).
    colleague_before: float | None = None
    colleague_after: float | None = None

    @property
    def gain(self) -> int:
        return self.after - self.before

    @property
    def rate_after(self) -> float:
        return self.after / self.n if self.n else 0.0

    @property
    def likely_after(self) -> float:
        """What a colleague would see: the estimate where there is one, else the share right."""
        return self.colleague_after if self.colleague_after is not None else self.rate_after


def headline_recall(
    before: Side | Mapping[str, Any] | None, after: Side | Mapping[str, Any] | None
) -> RecallFigures:
    """The headline recall of a job: of the kind `headline_kind` picks, counted over the
    probes of the side after training."""
    before, after = as_side(before), as_side(after)
    if headline_kind(after) == "questions":
        n, hits = after.question_counts()
        return RecallFigures(
            n, before.question_counts()[1], hits, "questions",
            colleague_share(_kinded_like(before.questions, after.questions)),
            colleague_share(after.questions),
        )
    n, hits = after.completion_counts()
    return RecallFigures(n, before.completion_counts()[1], hits, "completion")


@dataclass(frozen=True)
class KindFigures:
    """The headline's questions of one kind (a key of QUESTION_KINDS), before and after."""

    kind: str
    n: int
    after: int  # answered right after training
    before: int | None  # before training; None when the side before cannot tell

    @property
    def words(self) -> str:
        """The card's words for the kind: "asked the other way round"."""
        return QUESTION_KINDS[self.kind]

    @property
    def rate_after(self) -> float:
        return self.after / self.n if self.n else 0.0


def _kinded_like(before: Questions, after: Questions) -> Questions:
    """The questions before training, each under the kind it has after (a question asked
    of both sides is the same question); without items before, none of them."""
    kind_of = {(q.question, q.answer): q.kind for q in after.items}
    return Questions(items=[
        q.model_copy(update={"kind": kind_of.get((q.question, q.answer), q.kind)})
        for q in before.items
    ])


def kind_figures(
    before: Side | Mapping[str, Any] | None, after: Side | Mapping[str, Any] | None
) -> list[KindFigures]:
    """The headline questions by kind (`kind_counts` of the side after training), each with
    the hits before training on the same questions; [] when the questions carry no kinds
    (an older job, or the completions as headline)."""
    before, after = as_side(before), as_side(after)
    if headline_kind(after) != "questions":
        return []
    tally = kind_counts(after.questions)
    if not tally:
        return []
    # The same questions before training, each counted under the kind it has after.
    if before.questions.items:
        was: dict[str, tuple[int, int]] | None = kind_counts(
            _kinded_like(before.questions, after.questions))
    else:  # no items before: only "none right" can be told apart
        was = {} if before.questions.n_recalled == 0 else None
    return [
        KindFigures(kind, n, hits, None if was is None else was.get(kind, (0, 0))[0])
        for kind, (hits, n) in tally.items()
    ]


def forgetting(
    before: Side | Mapping[str, Any] | None, after: Side | Mapping[str, Any] | None
) -> float | None:
    """Relative rise of the general-text perplexity (0.25 = 25% worse); None if unmeasured."""
    b = finite_number(as_side(before).general.perplexity)
    a = finite_number(as_side(after).general.perplexity)
    if b is None or a is None or b <= 0:
        return None
    return a / b - 1
