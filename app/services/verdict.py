"""The score card's verdict: one plain sentence on whether training worked, and what to try
next, from the worker's before/after scores (Job.scores["before"] / ["after"]).

Pure Python on JSON-like dicts, so the web app can show it without the ML side and the
worker can print it into model cards.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# General-text perplexity may rise this much (relative) before we call it forgetting.
FORGETTING_RISE = 0.20
# A recall at least this high, without forgetting, is "safe to use".
SAFE_RECALL = 0.5
# Fewer newly recalled facts than this (and than MIN_GAIN_SHARE of the probes) is "barely
# changed": greedy answers of a small model flip on a fact or two by chance.
MIN_GAIN = 2
MIN_GAIN_SHARE = 0.10
# Held-out perplexity rising this much means the model memorised rather than generalised.
OVERFIT_RISE = 0.5


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
class RecallFigures:
    n: int
    before: int
    after: int
    kind: str  # "questions" (asked in chat) or "completion" (sentence completions)

    @property
    def gain(self) -> int:
        return self.after - self.before

    @property
    def rate_after(self) -> float:
        return self.after / self.n if self.n else 0.0


def finite_number(value: Any) -> float | None:
    """`value` as a float, or None when it is missing, not a number, NaN or infinite (scores
    come from JSON written by the worker)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _count(side: Mapping[str, Any], key: str) -> tuple[int, int]:
    """(n, hits) of one recall measure: "questions" or the completion probes."""
    if key == "questions":
        q = side.get("questions") or {}
        return int(q.get("n") or 0), int(q.get("n_recalled") or 0)
    n = int(side.get("n_probes") or 0)
    hits = side.get("n_recalled")
    if hits is None and side.get("recall") is not None:
        hits = round(float(side["recall"]) * n)
    return n, int(hits or 0)


def headline_recall(before: Mapping[str, Any], after: Mapping[str, Any]) -> RecallFigures:
    """Questions asked in chat when the job measured them, else sentence completions."""
    n_q, after_q = _count(after, "questions")
    if n_q:
        return RecallFigures(n_q, _count(before, "questions")[1], after_q, "questions")
    n, after_hits = _count(after, "completion")
    return RecallFigures(n, _count(before, "completion")[1], after_hits, "completion")


def forgetting(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    """Relative rise of the general-text perplexity (0.25 = 25% worse); None if unmeasured."""
    b = finite_number((before.get("general") or {}).get("perplexity"))
    a = finite_number((after.get("general") or {}).get("perplexity"))
    if b is None or a is None or b <= 0:
        return None
    return a / b - 1


def _facts(n: int) -> str:
    return f"{n} fact{'s' if n != 1 else ''}"


def verdict(
    before: Mapping[str, Any] | None,
    after: Mapping[str, Any] | None,
    params: Mapping[str, Any] | None = None,
) -> Verdict:
    """The verdict for one job. `params` (the job's settings) makes the advice concrete."""
    before, after, params = before or {}, after or {}, params or {}
    recall = headline_recall(before, after)
    rise = forgetting(before, after)
    forgot = rise is not None and rise > FORGETTING_RISE
    epochs = params.get("epochs")
    lr = finite_number(params.get("learning_rate"))
    more_epochs = f" (for example {int(epochs) * 2} epochs instead of {epochs})" if epochs else ""
    fewer_epochs = (
        f" (for example {max(1, int(epochs) // 2)} instead of {epochs})"
        if epochs and int(epochs) > 1
        else ""
    )

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
    ppl_b, ppl_a = finite_number(before.get("perplexity")), finite_number(after.get("perplexity"))
    if ppl_b and ppl_a and ppl_a > ppl_b * (1 + OVERFIT_RISE):
        details.append(
            f"Held-out perplexity rose from {ppl_b:.1f} to {ppl_a:.1f}: the model memorised "
            "the training text rather than its style."
        )
        advice.append("Train for fewer epochs, or add more documents so it cannot memorise.")
    qa_b, qa_a = before.get("qa") or {}, after.get("qa") or {}
    f1_b, f1_a = finite_number(qa_b.get("f1")), finite_number(qa_a.get("f1"))
    if qa_a.get("n") and f1_b is not None and f1_a is not None:
        details.append(
            f"Your own held-out questions: word overlap {100 * f1_b:.0f}% → {100 * f1_a:.0f}% "
            f"({qa_a['n']} question{'s' if qa_a['n'] != 1 else ''})."
        )

    if recall.n == 0:
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
                f"Try fewer epochs{fewer_epochs}: the model got worse at general English."
            )
        return Verdict(
            "unmeasured", "No facts to check: recall could not be measured.", details, advice
        )

    how = "questions about your documents" if recall.kind == "questions" else "fact completions"
    details.insert(
        0,
        f"Knowledge recall: {recall.after} of {recall.n} {how} answered correctly after "
        f"training, {recall.before} before.",
    )
    learned = f"Learned {recall.after} of {recall.n} facts (was {recall.before})."
    barely = abs(recall.gain) < max(MIN_GAIN, math.ceil(MIN_GAIN_SHARE * recall.n))

    if recall.gain < 0 and not barely:
        level = "worse"
        headline = (
            f"Got worse: recalls {_facts(recall.after)} of {recall.n}, "
            f"down from {recall.before}. Do not use it."
        )
        advice.append(
            "Train again with a lower learning rate"
            + (f" (for example {lr / 2:g})" if lr else "")
            + " or fewer epochs."
        )
    elif barely:
        level, headline = "barely", "Barely changed: add more documents or train longer."
        advice.append(f"Train longer{more_epochs}.")
        advice.append(
            "Add question-answer pairs (CSV or JSONL) about the facts that matter most: "
            "the model learns to answer from them fastest."
        )
        if lr is not None and params.get("method", "lora") == "lora" and lr < 5e-4:
            advice.append(f"Or raise the learning rate (for example to {min(lr * 2.5, 1e-3):g}).")
    elif forgot:
        level = "forgetting"
        headline = f"{learned[:-1]}, but the model got worse at general English; try fewer epochs."
        advice.append(
            f"Try fewer epochs{fewer_epochs} or a lower learning rate"
            + (f" (for example {lr / 2:g})" if lr else "")
            + " to keep its general skills."
        )
    elif recall.rate_after >= SAFE_RECALL:
        level, headline = "good", f"{learned} Safe to use."
        if recall.rate_after < 0.9:
            advice.append(
                "Check the side-by-side answers below: the facts it still misses are the ones "
                "to add as question-answer pairs."
            )
    else:
        level = "partial"
        headline = f"{learned} Partly learned: check its answers against your documents."
        advice.append(
            f"Train longer{more_epochs}, or add question-answer pairs about the facts it misses."
        )
    if forgot and level not in ("forgetting", "worse"):
        advice.append(f"The model got worse at general English; try fewer epochs{fewer_epochs}.")
    return Verdict(level, headline, details, advice)
