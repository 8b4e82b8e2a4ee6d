"""The job page's score card: a finished job's scores (app.contract.scores) turned into the
figures, rows and verdict the page shows, and the one-line summary of the job list."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.contract.results import dataset_notes
from app.contract.scores import (
    QA,
    KindFigures,
    Probe,
    Question,
    Scores,
    Side,
    finite_number,
    headline_kind,
    headline_recall,
    kind_figures,
    parse_scores,
)
from app.contract.verdict import FORGETTING_RISE, Verdict, verdict
from app.models import Job, JobState
from app.services.documents import model_versions

log = logging.getLogger(__name__)


@dataclass
class Recall:
    n_recalled: int
    n_probes: int

    @property
    def pct(self) -> float | None:
        return 100.0 * self.n_recalled / self.n_probes if self.n_probes else None


@dataclass
class ProbeRow:
    prompt: str
    answer: str
    source: str
    base_output: str
    base_hit: bool
    tuned_output: str
    tuned_hit: bool
    sentence: str = ""
    kind: str = ""  # how the question was put (QUESTION_KINDS), "" for completions


@dataclass
class QARow:
    """One of the user's held-out questions, answered before and after."""

    question: str
    answer: str
    base_output: str
    tuned_output: str
    base_f1: float | None
    tuned_f1: float | None
    base_hit: bool
    tuned_hit: bool


@dataclass
class ScoreCard:
    # The headline: facts asked as questions in chat when measured, else completions.
    recall_before: Recall
    recall_after: Recall
    perplexity_before: float | None
    perplexity_after: float | None
    n_heldout_chunks: int
    probes: list[ProbeRow] = field(default_factory=list)  # sentence completions (a sample)
    qa_n: int = 0
    qa_f1_before: float | None = None
    qa_f1_after: float | None = None
    qa_exact_before: float | None = None
    qa_exact_after: float | None = None
    recall_kind: str = "completion"  # "questions" | "completion"
    completion_before: Recall | None = None  # the completion form, when the headline is questions
    completion_after: Recall | None = None
    general_before: float | None = None  # forgetting check: general-text perplexity
    general_after: float | None = None
    side_by_side: list[ProbeRow] = field(default_factory=list)  # questions, base vs tuned
    # The headline questions by how they were put (QUESTION_KINDS order); [] for older jobs,
    # whose questions carry no kind.
    kinds: list[KindFigures] = field(default_factory=list)
    # What a colleague would see, estimated from the kinds (app.contract.scores
    # colleague_share), as shares; None for older jobs, whose questions carry no kind.
    colleague_before: float | None = None
    colleague_after: float | None = None
    colleague_previous: float | None = None
    qa_rows: list[QARow] = field(default_factory=list)
    verdict: Verdict | None = None
    notes: list[str] = field(default_factory=list)  # from dataset building (Job.dataset)
    # Incremental jobs: the version the job started from, measured on the same probes and
    # passages. The recall is of the same kind as the headline (questions or completions).
    has_previous: bool = False
    previous_label: str | None = None  # "v2"
    recall_previous: Recall | None = None
    perplexity_previous: float | None = None
    general_previous: float | None = None
    qa_f1_previous: float | None = None

    @property
    def n_probes(self) -> int:
        return self.recall_after.n_probes or self.recall_before.n_probes

    @property
    def n_completions(self) -> int:
        side = self.completion_after or self.recall_after
        return side.n_probes

    @property
    def kinds_line(self) -> str:
        """The headline questions by kind, e.g. Asked 40 questions: 22 in a colleague's own
        words (9 right, was 0), 10 asked the other way round (2 right, was 0), 8 looked up in
        a table (3 right, was 0). Empty when the questions carry no kind (an older job)."""
        if not self.kinds:
            return ""
        parts = [
            f"{k.n} {k.words} ({k.after} right"
            + (f", was {k.before})" if k.before is not None else ")")
            for k in self.kinds
        ]
        rest = self.n_probes - sum(k.n for k in self.kinds)
        if rest > 0:  # not expected: every question of a job with kinds has one
            parts.append(f"{rest} put otherwise")
        plural = "s" if self.n_probes != 1 else ""
        return f"Asked {self.n_probes} question{plural}: {', '.join(parts)}."

    @property
    def headline_pcts(self) -> tuple[float | None, float | None]:
        """The recall the card leads with, before and after, in percent: what a colleague
        would see where the questions carry kinds, else the share of its questions right."""
        if self.colleague_after is not None:
            before = self.colleague_before
            return (None if before is None else 100 * before), 100 * self.colleague_after
        return self.recall_before.pct, self.recall_after.pct

    @property
    def headline_previous_pct(self) -> float | None:
        """The previous version's recall, in the same terms as `headline_pcts`."""
        if self.colleague_after is not None:
            return None if self.colleague_previous is None else 100 * self.colleague_previous
        return self.recall_previous.pct if self.recall_previous is not None else None

    @property
    def general_rise(self) -> float | None:
        """Relative rise of the general-text perplexity (0.3 = 30% worse)."""
        if self.general_before and self.general_after is not None:
            return self.general_after / self.general_before - 1
        return None

    @property
    def forgetting(self) -> bool:
        rise = self.general_rise
        return rise is not None and rise > FORGETTING_RISE


def _completions(side: Side) -> Recall:
    n, hits = side.completion_counts()
    return Recall(hits, n)


def _paired_rows(
    before: Sequence[Probe | Question], after: Sequence[Probe | Question], prompt_key: str
) -> list[ProbeRow]:
    """Before/after outputs of the same probes (the same `prompt_key` and answer), learned
    facts first, then the ones the tuned model gets right, then the rest (each group in
    document order)."""
    base_by = {(getattr(p, prompt_key), p.answer): p for p in before}
    rows = []
    for p in after:
        base = base_by.get((getattr(p, prompt_key), p.answer))
        rows.append(
            ProbeRow(
                prompt=getattr(p, prompt_key),
                answer=p.answer,
                source=p.source,
                base_output=base.output if base else "",
                base_hit=base.hit if base else False,
                tuned_output=p.output,
                tuned_hit=p.hit,
                sentence=getattr(p, "sentence", ""),
                kind=getattr(p, "kind", ""),
            )
        )
    rows.sort(key=lambda r: (r.tuned_hit == r.base_hit, not r.tuned_hit))
    return rows


def _sample(rows: list[ProbeRow], limit: int) -> list[ProbeRow]:
    """`limit` rows for the side-by-side: the kinds of question taking turns (a sample of
    only the easiest kind would flatter), and a question the tuned model misses among them
    when there is one."""
    by_kind: dict[str, list[ProbeRow]] = {}
    for row in rows:
        by_kind.setdefault(row.kind, []).append(row)
    picked: list[ProbeRow] = []
    while len(picked) < min(limit, len(rows)):
        for queue in by_kind.values():
            if queue and len(picked) < limit:
                picked.append(queue.pop(0))
    missed = next((r for r in rows if not r.tuned_hit), None)
    if picked and missed is not None and all(r.tuned_hit for r in picked):
        picked[-1] = missed
    return picked


def _qa_rows(before: QA, after: QA, limit: int) -> list[QARow]:
    """The user's held-out questions, before and after, in their order."""
    base_by_q = {i.question: i for i in before.items}
    rows = []
    for item in after.items[:limit]:
        base = base_by_q.get(item.question)
        rows.append(
            QARow(
                question=item.question,
                answer=item.answer,
                base_output=base.output if base else "",
                tuned_output=item.output,
                base_f1=finite_number(base.f1) if base else None,
                tuned_f1=finite_number(item.f1),
                base_hit=base.contains if base else False,
                tuned_hit=item.contains,
            )
        )
    return rows


def _previous_figures(card: ScoreCard, previous: Side, label: str | None) -> None:
    """Fill the card's previous-version figures from scores["previous"] (evaluate()'s shape),
    with the recall of the same kind as the card's headline: questions or completions."""
    card.has_previous = True
    card.previous_label = label
    if card.recall_kind == "questions":
        if previous.questions.n:
            n, hits = previous.question_counts()
            card.recall_previous = Recall(hits, n)
    elif previous.n_probes:
        card.recall_previous = _completions(previous)
    card.perplexity_previous = finite_number(previous.perplexity)
    card.general_previous = finite_number(previous.general.perplexity)
    card.qa_f1_previous = finite_number(previous.qa.f1)


def _qa_figures(card: ScoreCard, before: QA, after: QA, limit: int) -> None:
    card.qa_n = after.n
    if card.qa_n:
        card.qa_f1_before = finite_number(before.f1)
        card.qa_f1_after = finite_number(after.f1)
        card.qa_exact_before = finite_number(before.exact)
        card.qa_exact_after = finite_number(after.exact)
        card.qa_rows = _qa_rows(before, after, limit)


def score_card(
    scores: Scores | Mapping[str, Any] | None,
    max_probes: int = 8,
    params: Mapping[str, Any] | None = None,
    side_by_side: int = 5,
    previous_label: str | None = None,
    dataset: Mapping[str, Any] | None = None,
) -> ScoreCard | None:
    """The before/after comparison with its verdict, or None when the job has no scores.

    An incremental job's card also carries the version it started from (scores["previous"];
    `previous_label` names it, e.g. "v2"). `dataset`: the job's Job.dataset, for its notes.
    Raises ValueError when `scores` does not have app.contract.scores' shape."""
    if not scores:
        return None
    parsed = parse_scores(scores)
    if parsed.after is None:
        return None
    before, after = parsed.before, parsed.after
    card = ScoreCard(
        recall_before=_completions(before),
        recall_after=_completions(after),
        perplexity_before=finite_number(before.perplexity),
        perplexity_after=finite_number(after.perplexity),
        n_heldout_chunks=after.n_heldout_chunks or before.n_heldout_chunks,
        general_before=finite_number(before.general.perplexity),
        general_after=finite_number(after.general.perplexity),
        verdict=verdict(before, after, params),
        notes=dataset_notes(dataset),
    )
    if headline_kind(after) == "questions":
        recall = headline_recall(before, after)
        card.recall_kind = recall.kind
        card.completion_before, card.completion_after = card.recall_before, card.recall_after
        card.recall_before = Recall(recall.before, recall.n)
        card.recall_after = Recall(recall.after, recall.n)
        card.kinds = kind_figures(before, after)
        card.colleague_before, card.colleague_after = recall.colleague_before, recall.colleague_after
        card.side_by_side = _sample(
            _paired_rows(before.questions.items, after.questions.items, "question"), side_by_side
        )
    if parsed.previous is not None:
        _previous_figures(card, parsed.previous, previous_label)
        if card.colleague_after is not None:  # the previous version's answers, kinded alike
            card.colleague_previous = headline_recall(parsed.previous, after).colleague_before
    card.probes = _paired_rows(before.probes, after.probes, "prompt")[:max_probes]
    _qa_figures(card, before.qa, after.qa, side_by_side)
    return card


def job_score_card(job: Job) -> ScoreCard | None:
    """The job page's score card: a done job's scores, with the version it started from
    named ("v2") when it continued one. None, logged, for scores of another shape."""
    if job.state != JobState.done:
        return None
    label = model_versions(job.project).get(job.parent_job_id) if job.parent_job_id else None
    try:
        return score_card(
            job.scores, params=job.params, previous_label=label, dataset=job.dataset
        )
    except ValueError:
        log.warning("job %s: its scores do not have the score card's shape", job.id, exc_info=True)
        return None


def score_summary(scores: Scores | Mapping[str, Any] | None) -> str | None:
    """One line for the job list, e.g. "Recall 10% → 45% (previous version 30%)": the card's
    headline recall, so the line and the card always quote the same figures."""
    try:
        card = score_card(scores)
    except ValueError:
        return None
    if card is None or card.recall_after.pct is None:
        return None
    before, after = card.headline_pcts
    line = f"Recall {before:.0f}% → {after:.0f}%" if before is not None else f"Recall {after:.0f}%"
    # The version it started from, on the same probes.
    was = card.headline_previous_pct
    if was is not None:
        line += f" (previous version {was:.0f}%)"
    return line
