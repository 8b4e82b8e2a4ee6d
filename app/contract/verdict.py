"""The score card's verdict: one plain sentence on whether training worked, and what to try
next, from the worker's before/after scores (app.contract.scores).

Here rather than in app/services because the worker prints it too: into every download's
model card (worker/export/card.py) and at the end of `doctune train` (worker/cli/main.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.contract.scores import (
    KindFigures,
    RecallFigures,
    Side,
    as_side,
    finite_number,
    forgetting,
    headline_recall,
    kind_figures,
)

# General-text perplexity may rise this much (relative) before we call it forgetting.
FORGETTING_RISE = 0.20
# A headline recall at least this high, without forgetting, is "safe to use"; below it (a
# real gain all the same) is "partial". The recall judged is what a colleague would see,
# estimated from the card's questions by kind (app.contract.scores.colleague_share; the
# share right for older jobs) and checked against hand-written colleague questions
# (scripts/experiments/recall.py), so 60% means a colleague sees at least about half of
# their questions answered right. (It was 0.5 while the questions stayed close to the
# documents' sentences, which overstated recall threefold.)
SAFE_RECALL = 0.6
# Below this headline recall a colleague gets most answers wrong (under half right, given
# the 10 points of calibration); between it and SAFE_RECALL, often wrong.
MOSTLY_WRONG = 0.4
# "Safe to use" also needs enough questions to rule out a model that is mostly wrong: the
# lower end of the headline's 90% confidence interval (Wilson score, z = 1.645) at least
# MOSTLY_WRONG. A card of 40 or 29 questions clears it at SAFE_RECALL (the lower ends are 47%);
# one of 10 needs 7 right and one of 6 needs 5: 6 of 10 right leaves anything from 35% to 81%.
CONFIDENCE_Z = 1.645
# A kind of question answered less often than this is "rarely" answered.
RARELY = 0.25
# Fewer newly recalled facts than this (and than MIN_GAIN_SHARE of the probes) is "barely
# changed": greedy answers of a small model flip on a fact or two by chance.
MIN_GAIN = 2
MIN_GAIN_SHARE = 0.10
# Held-out perplexity rising this much means the model memorised rather than generalised.
OVERFIT_RISE = 0.5
# What a model that is not ready is good for meanwhile. Measured on the fixture corpus
# (README "Open book"): with the passages the default model answers about as many colleague
# questions as without, a few more (21-27 of 60 against 19-22), and the chat shows them.
# (Training longer is not advised here: the default at 7 epochs instead of 4 answered the
# same 22 of 60 and forgot more; README "Spending the other half".)
OPEN_BOOK = (
    "Until then, ask it in DocTune's chat with \"Use my documents\" on: it answers about as "
    "often, and shows the passages each answer drew on, so a colleague can check the answer."
)


@dataclass
class Verdict:
    """level: good | partial | barely | worse | forgetting | unmeasured."""

    level: str
    headline: str
    details: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.level == "good"


@dataclass
class _Settings:
    """The job's settings as the advice quotes them."""

    lr: float | None
    lora: bool
    more_epochs: str  # " (for example 16 epochs instead of 8)", or ""
    fewer_epochs: str  # " (for example 4 instead of 8)", or ""

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> _Settings:
        epochs = params.get("epochs")
        more = f" (for example {int(epochs) * 2} epochs instead of {epochs})" if epochs else ""
        fewer = (
            f" (for example {max(1, int(epochs) // 2)} instead of {epochs})"
            if epochs and int(epochs) > 1
            else ""
        )
        lora = params.get("method", "lora") == "lora"
        return cls(finite_number(params.get("learning_rate")), lora, more, fewer)

    @property
    def half_lr(self) -> str:
        return f" (for example {self.lr / 2:g})" if self.lr else ""


def _facts(n: int) -> str:
    return f"{n} fact{'s' if n != 1 else ''}"


def _measurements(
    before: Side, after: Side, rise: float | None, forgot: bool
) -> tuple[list[str], list[str]]:
    """(details, advice) from the forgetting check, the held-out perplexity and the user's
    own held-out questions."""
    details: list[str] = []
    advice: list[str] = []
    if rise is not None:
        details.append(
            f"General English: perplexity {'rose' if rise > 0 else 'changed'} by "
            f"{100 * rise:+.0f}% on a general-text sample"
            + (
                " (the model got worse at ordinary text)."
                if forgot
                else " (no sign of forgetting)."
            )
        )
    ppl_b, ppl_a = finite_number(before.perplexity), finite_number(after.perplexity)
    if ppl_b and ppl_a and ppl_a > ppl_b * (1 + OVERFIT_RISE):
        details.append(
            f"Held-out perplexity rose from {ppl_b:.1f} to {ppl_a:.1f}: the model memorised "
            "the training text rather than its style."
        )
        advice.append("Train for fewer epochs, or add more documents so it cannot memorise.")
    f1_b, f1_a = finite_number(before.qa.f1), finite_number(after.qa.f1)
    n_qa = after.qa.n
    if n_qa and f1_b is not None and f1_a is not None:
        details.append(
            f"Your own held-out questions: word overlap {100 * f1_b:.0f}% → {100 * f1_a:.0f}% "
            f"({n_qa} question{'s' if n_qa != 1 else ''})."
        )
    return details, advice


def _unmeasured(details: list[str], advice: list[str], forgot: bool, tips: _Settings) -> Verdict:
    """No probes: say why recall could not be measured, and how the next job can be."""
    details.insert(
        0,
        "Recall could not be measured: no sentence in the documents states a distinctive "
        "fact (a number, code, name or date) to ask about.",
    )
    advice.append(
        "Add documents that state concrete facts (prices, dates, names, codes, limits), "
        "or question-answer pairs (CSV or JSONL), so the next job can be checked."
    )
    if forgot:
        advice.append(
            f"Try fewer epochs{tips.fewer_epochs}: the model got worse at general English."
        )
    return Verdict(
        "unmeasured", "No facts to check: recall could not be measured.", details, advice
    )


def _join(parts: list[str], conj: str = "and") -> str:
    """a; a and b; a, b and c (or another conjunction)."""
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} {conj} {parts[-1]}"


def _by_kind(kinds: list[KindFigures]) -> str:
    """The detail line: the headline questions by how they were put, before and after."""
    parts = [
        f"{k.n} {k.words}: {k.after} right"
        + (f" (was {k.before})" if k.before is not None else "")
        for k in kinds
    ]
    return "By how the questions were put: " + "; ".join(parts) + "."


def _weak(kinds: list[KindFigures]) -> list[KindFigures]:
    """The kinds answered less often than a safe recall, in QUESTION_KINDS order."""
    return [k for k in kinds if k.rate_after < SAFE_RECALL]


def _handles(kinds: list[KindFigures]) -> str:
    """Which kinds of question it answers and which it misses, e.g. It answers questions
    looked up in a table (5 of 8) but rarely questions asked the other way round (1 of 10)."""
    weak = _weak(kinds)
    strong = [k for k in kinds if k not in weak]

    def questions(ks: list[KindFigures], conj: str) -> str:
        return "questions " + _join([f"{k.words} ({k.after} of {k.n})" for k in ks], conj)

    if not weak:
        return f"It answers {questions(strong, 'and')}."
    misses = [
        (how_often, questions(ks, "or"))
        for how_often, ks in (
            ("only sometimes", [k for k in weak if k.rate_after >= RARELY]),
            ("rarely", [k for k in weak if k.rate_after < RARELY]),
        )
        if ks
    ]
    if strong:
        missed = " and ".join(f"{how_often} {qs}" for how_often, qs in misses)
        return f"It answers {questions(strong, 'and')} but {missed}."
    (how_often, qs), *more = misses
    return f"It {how_often} answers {qs}" + "".join(f", and {h} {q}" for h, q in more) + "."


def _what_to_add(kinds: list[KindFigures]) -> str:
    """What to add so it answers the facts it misses, naming the kinds it misses. Measured
    (README "Does \"add question-answer pairs\" work?"): a pair's own question is learned as
    written (12 of 12), the same fact in a colleague's other words hardly (3 of 12)."""
    weak = _weak(kinds)
    asked = f", including questions {_join([k.words for k in weak])}" if weak else ""
    return (
        f"Add question-answer pairs (CSV or JSONL) for the facts it misses{asked}, and write "
        "each question the several ways your colleagues would ask it: the model learns a "
        "question as it is written, much less the same fact asked in other words."
    )


def _not_ready_advice(kinds: list[KindFigures]) -> list[str]:
    """A model that is not ready: which kinds it handles (when known), what to add, and how
    to use it meanwhile."""
    add = f"{_handles(kinds)} {_what_to_add(kinds)}" if kinds else _what_to_add(kinds)
    return [add, OPEN_BOOK]


def wilson_lower(hits: float, n: int, z: float = CONFIDENCE_Z) -> float:
    """The lower end of the Wilson score interval for `hits` of `n` (Wilson 1927): the rate
    p below hits/n with (hits/n - p)^2 = z^2 p (1 - p) / n. Unlike hits/n minus a normal
    margin it stays within 0..1 and holds up for the few dozen questions a card asks."""
    if n <= 0:
        return 0.0
    p, zz = hits / n, z * z
    centre = p + zz / (2 * n)
    margin = z * math.sqrt(p * (1 - p) / n + zz / (4 * n * n))
    return max(0.0, (centre - margin) / (1 + zz / n))


def colleague_words(share: float) -> str:
    """What a colleague would see (app.contract.scores.colleague_share), in the words the
    verdict, the chat and the CLI use: "a colleague asking ... would get about 43% right"."""
    return f"a colleague asking in their own words would get about {round(100 * share)}% right"


def _colleague(recall: RecallFigures) -> str:
    """The sentence of what a colleague would see, "" without an estimate."""
    if recall.colleague_after is None:
        return ""
    return f" {_cap(colleague_words(recall.colleague_after))}."


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _scored(recall: RecallFigures) -> str:
    """What it got right, before and after, in the words of the headline's kind."""
    if recall.kind == "questions":
        done = f"Answers {recall.after} of {recall.n} questions about your documents correctly"
    else:
        done = f"Fills in {recall.after} of {recall.n} facts from your documents"
    return f"{done} (was {recall.before})."


def _too_few(recall: RecallFigures) -> str:
    """The headline of a model that scored high on too few questions to call it safe."""
    return (
        f"{_scored(recall)}{_colleague(recall)} Not sure yet: {recall.n} are too few to tell a "
        "ready model from one that is often wrong."
    )


def _not_ready(recall: RecallFigures) -> str:
    """The partial level's headline: what the model can and cannot do yet."""
    if recall.colleague_after is not None:
        return f"{_scored(recall)} Not ready: {colleague_words(recall.colleague_after)}."
    if recall.kind == "questions":
        how_often = "most of the time" if recall.likely_after < MOSTLY_WRONG else "often"
        return f"{_scored(recall)} Not ready: a colleague would get a wrong answer {how_often}."
    return f"{_scored(recall)} Not ready: it still misses {recall.n - recall.after} of them."


def _judge(
    recall: RecallFigures, forgot: bool, tips: _Settings, kinds: list[KindFigures]
) -> tuple[str, str, list[str]]:
    """(level, headline, advice) from the headline recall and the forgetting check; `kinds`
    (the headline questions by kind, [] for older jobs) says which kinds it misses."""
    advice: list[str] = []
    learned = f"Learned {recall.after} of {recall.n} facts (was {recall.before}).{_colleague(recall)}"
    likely = recall.likely_after  # what a colleague would see
    barely = abs(recall.gain) < max(MIN_GAIN, math.ceil(MIN_GAIN_SHARE * recall.n))
    if recall.gain < 0 and not barely:
        level = "worse"
        headline = (
            f"Got worse: recalls {_facts(recall.after)} of {recall.n}, "
            f"down from {recall.before}. Do not use it."
        )
        advice.append(f"Train again with a lower learning rate{tips.half_lr} or fewer epochs.")
    elif barely:
        level, headline = "barely", "Barely changed: add more documents or train longer."
        advice.append(f"Train longer{tips.more_epochs}.")
        advice.append(
            "Add question-answer pairs (CSV or JSONL) about the facts that matter most: "
            "the model learns to answer from them fastest."
        )
        if tips.lr is not None and tips.lora and tips.lr < 5e-4:
            advice.append(
                f"Or raise the learning rate (for example to {min(tips.lr * 2.5, 1e-3):g})."
            )
    elif forgot:
        level = "forgetting"
        headline = f"{learned[:-1]}, but the model got worse at general English; try fewer epochs."
        if likely < SAFE_RECALL:  # not ready either way: say both
            headline = f"{_not_ready(recall)} It also got worse at general English."
            advice += _not_ready_advice(kinds)
        advice.append(
            f"Try fewer epochs{tips.fewer_epochs} or a lower learning rate{tips.half_lr}"
            " to keep its general skills."
        )
    elif likely >= SAFE_RECALL and wilson_lower(likely * recall.n, recall.n) < MOSTLY_WRONG:
        level, headline = "partial", _too_few(recall)
        advice.append(
            "Check the side-by-side answers below before you rely on it, and add documents or "
            "question-answer pairs (CSV or JSONL) that state more facts, so the next job can "
            "ask more questions."
        )
        advice.append(OPEN_BOOK)
    elif likely >= SAFE_RECALL:
        level, headline = "good", f"{learned} Safe to use."
        if _weak(kinds):
            advice.append(f"{_handles(kinds)} {_what_to_add(kinds)}")
        elif recall.rate_after < 0.9:
            advice.append(
                "Check the side-by-side answers below: the facts it still misses are the ones "
                "to add as question-answer pairs."
            )
    else:
        level, headline = "partial", _not_ready(recall)
        advice += _not_ready_advice(kinds)
    return level, headline, advice


def verdict(
    before: Side | Mapping[str, Any] | None,
    after: Side | Mapping[str, Any] | None,
    params: Mapping[str, Any] | None = None,
) -> Verdict:
    """The verdict for one job. `params` (the job's settings) makes the advice concrete."""
    before, after, params = as_side(before), as_side(after), params or {}
    recall = headline_recall(before, after)
    rise = forgetting(before, after)
    forgot = rise is not None and rise > FORGETTING_RISE
    tips = _Settings.of(params)
    details, advice = _measurements(before, after, rise, forgot)
    if recall.n == 0:
        return _unmeasured(details, advice, forgot, tips)

    how = "questions about your documents" if recall.kind == "questions" else "fact completions"
    details.insert(
        0,
        f"Knowledge recall: {recall.after} of {recall.n} {how} answered correctly after "
        f"training, {recall.before} before.",
    )
    kinds = kind_figures(before, after)
    if kinds:
        details.insert(1, _by_kind(kinds))
    level, headline, more = _judge(recall, forgot, tips, kinds)
    advice += more
    if forgot and level not in ("forgetting", "worse"):
        advice.append(f"The model got worse at general English; try fewer epochs{tips.fewer_epochs}.")
    return Verdict(level, headline, details, advice)
