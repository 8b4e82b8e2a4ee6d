"""Compare two finished versions of a project's model on the same probes.

Each job stores the probes it was scored on (app.contract.scores: a side's questions'
items and its probes), so two jobs are compared on the probes they share: all of them when
the two jobs were built from the same documents with the same settings, fewer when not,
and the page says which. No model runs here: the figures are the ones the worker measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from app.contract.scores import Probe, Question, RecallKind, Side, headline_kind, parse_scores
from app.db import MAX_ROW_ID
from app.models import Job, JobState, Project
from app.services.errors import InvalidInput, NotFound


@dataclass
class MetricRow:
    label: str
    base: str  # the base model, as scored by job A (same probes)
    a: str
    b: str
    better: str | None  # "a", "b" or None (a tie or not comparable)
    note: str = ""


@dataclass
class FactRow:
    question: str
    answer: str
    source: str
    a_output: str
    a_hit: bool
    b_output: str
    b_hit: bool


@dataclass
class Comparison:
    job_a: Job
    job_b: Job
    same_probes: bool
    n_common: int
    n_a: int
    n_b: int
    kind: str  # "questions" or "completion": which probes are compared
    message: str
    metrics: list[MetricRow] = field(default_factory=list)
    facts: list[FactRow] = field(default_factory=list)  # where the two differ first


def _scored(job: Job) -> bool:
    """A done job whose scores have an "after" side worth comparing."""
    if job.state != JobState.done or not (job.scores or {}).get("after"):
        return False
    try:
        parse_scores(job.scores)
    except ValueError:
        return False
    return True


def comparable_jobs(project: Project) -> list[Job]:
    """The project's finished jobs that have scores, newest first."""
    return sorted((j for j in project.jobs if _scored(j)), key=lambda j: j.id, reverse=True)


Asked = Probe | Question
_Key = tuple[str, str]


def _items(side: Side, kind: RecallKind) -> dict[_Key, Asked]:
    """A side's probes of `kind`, by (question or prompt, answer)."""
    if kind == "questions":
        return {(q.question, q.answer): q for q in side.questions.items}
    return {(p.prompt, p.answer): p for p in side.probes}


def _pct(hits: int, n: int) -> str:
    return f"{hits} of {n} ({100 * hits / n:.0f}%)" if n else "—"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _better(a: float | None, b: float | None, lower_is_better: bool = False) -> str | None:
    if a is None or b is None or a == b:
        return None
    if lower_is_better:
        return "a" if a < b else "b"
    return "a" if a > b else "b"


def _documents_differ(a: Job, b: Job) -> str:
    docs_a = {s.get("sha256"): s.get("name") for s in a.sources or []}
    docs_b = {s.get("sha256"): s.get("name") for s in b.sources or []}
    only_a = [docs_a[h] for h in docs_a.keys() - docs_b.keys()]
    only_b = [docs_b[h] for h in docs_b.keys() - docs_a.keys()]
    parts = []
    if only_a:
        parts.append(f"only job #{a.id} used {', '.join(sorted(map(str, only_a))[:3])}")
    if only_b:
        parts.append(f"only job #{b.id} used {', '.join(sorted(map(str, only_b))[:3])}")
    return "; ".join(parts)


@dataclass
class _Probes:
    """The probes of the compared kind: each job's, the base model's (as scored by job A),
    and the ones both jobs share, in job A's order."""

    kind: RecallKind
    a: dict[_Key, Asked]
    b: dict[_Key, Asked]
    base: dict[_Key, Asked]

    @property
    def common(self) -> list[_Key]:
        return [k for k in self.a if k in self.b]

    @property
    def same(self) -> bool:
        return bool(self.a) and self.a.keys() == self.b.keys()

    def hits(self, items: dict[_Key, Asked]) -> int:
        return sum(bool(items.get(k) and items[k].hit) for k in self.common)


def _message(a: Job, b: Job, probes: _Probes) -> str:
    """Whether the comparison is fair, in words."""
    n = len(probes.common)
    if not probes.a and not probes.b:
        return "Neither job had facts to check, so recall cannot be compared."
    if probes.same:
        return (
            f"Both jobs were scored on the same {n} "
            f"{'questions' if probes.kind == 'questions' else 'fact checks'}: a fair comparison."
        )
    why = _documents_differ(a, b) or "they were built with different settings"
    return (
        f"The two jobs were scored on different probes ({why}). The figures below use "
        f"only the {n} they share (job #{a.id} had {len(probes.a)}, "
        f"job #{b.id} had {len(probes.b)})."
    )


def _recall_row(probes: _Probes) -> MetricRow:
    n = len(probes.common)
    hits_a, hits_b = probes.hits(probes.a), probes.hits(probes.b)
    return MetricRow(
        "Knowledge recall" + (" (questions)" if probes.kind == "questions" else " (completions)"),
        _pct(probes.hits(probes.base), n) if probes.base else "—",
        _pct(hits_a, n),
        _pct(hits_b, n),
        _better(hits_a, hits_b) if n else None,
    )


def _metric_rows(after_a: Side, after_b: Side, base: Side, same: bool) -> list[MetricRow]:
    """Held-out perplexity, the forgetting check and the user's own questions."""
    ppl_a, ppl_b = after_a.perplexity, after_b.perplexity
    rows = [
        MetricRow(
            "Held-out perplexity (lower is better)",
            _fmt(base.perplexity),
            _fmt(ppl_a),
            _fmt(ppl_b),
            _better(ppl_a, ppl_b, lower_is_better=True) if same else None,
            "" if same else "measured on different held-out text",
        )
    ]
    gen_a, gen_b = after_a.general.perplexity, after_b.general.perplexity
    if gen_a is not None or gen_b is not None:
        rows.append(
            MetricRow(
                "Forgetting check: general-text perplexity (lower is better)",
                _fmt(base.general.perplexity),
                _fmt(gen_a),
                _fmt(gen_b),
                _better(gen_a, gen_b, lower_is_better=True),
            )
        )
    f1_a, f1_b = after_a.qa.f1, after_b.qa.f1
    if f1_a is not None or f1_b is not None:
        rows.append(
            MetricRow(
                "Your held-out questions: token F1",
                _share(base.qa.f1),
                _share(f1_a),
                _share(f1_b),
                _better(f1_a, f1_b) if same else None,
                "" if same else "different held-out questions",
            )
        )
    return rows


def _fact_rows(probes: _Probes) -> list[FactRow]:
    """The shared probes, where the two jobs disagree first, then in document order."""
    facts = []
    for k in probes.common:
        pa, pb = probes.a[k], probes.b[k]
        facts.append(
            FactRow(
                question=k[0],
                answer=k[1],
                source=pa.source,
                a_output=pa.output,
                a_hit=pa.hit,
                b_output=pb.output,
                b_hit=pb.hit,
            )
        )
    facts.sort(key=lambda f: f.a_hit == f.b_hit)
    return facts


def compare_jobs(a: Job, b: Job) -> Comparison:
    """Job A against job B on the probes both were scored on: the questions when both
    measured them (the headline rule, app.contract.scores), else the completions."""
    scores_a, scores_b = parse_scores(a.scores), parse_scores(b.scores)
    after_a, after_b = scores_a.after or Side(), scores_b.after or Side()
    base_a = scores_a.before
    both_asked = headline_kind(after_a) == headline_kind(after_b) == "questions"
    kind: RecallKind = "questions" if both_asked else "completion"
    probes = _Probes(kind, _items(after_a, kind), _items(after_b, kind), _items(base_a, kind))
    return Comparison(
        job_a=a,
        job_b=b,
        same_probes=probes.same,
        n_common=len(probes.common),
        n_a=len(probes.a),
        n_b=len(probes.b),
        kind=kind,
        message=_message(a, b, probes),
        metrics=[_recall_row(probes), *_metric_rows(after_a, after_b, base_a, probes.same)],
        facts=_fact_rows(probes),
    )


def compare_in_project(session: Session, project: Project, a_id: Any, b_id: Any) -> Comparison:
    """Validate the two job ids from the form and compare them. InvalidInput in words."""
    try:
        ids = int(str(a_id)), int(str(b_id))
    except ValueError:
        raise InvalidInput("Choose two finished training jobs to compare.") from None
    if not all(1 <= job_id <= MAX_ROW_ID for job_id in ids):  # no such row can exist
        raise InvalidInput("Choose two finished training jobs to compare.")
    if ids[0] == ids[1]:
        raise InvalidInput("Choose two different training jobs to compare.")
    jobs = []
    for job_id in ids:
        job = session.get(Job, job_id)
        if job is None or job.project_id != project.id:
            raise NotFound(f"Training job #{job_id} is not part of this project.")
        if not _scored(job):
            raise InvalidInput(f"Training job #{job_id} has no scores yet: it has not finished.")
        jobs.append(job)
    return compare_jobs(*jobs)
