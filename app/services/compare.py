"""Compare two finished versions of a project's model on the same probes.

Each job stores the probes it was scored on (Job.scores[side]["questions"]["items"] and
["probes"]), so two jobs are compared on the probes they share: all of them when the two
jobs were built from the same documents with the same settings, fewer when not, and the
page says which. No model runs here: the figures are the ones the worker measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

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


def comparable_jobs(project: Project) -> list[Job]:
    """The project's finished jobs that have scores, newest first."""
    return sorted(
        (j for j in project.jobs if j.state == JobState.done and (j.scores or {}).get("after")),
        key=lambda j: j.id,
        reverse=True,
    )


def _items(side: Mapping[str, Any], kind: str) -> dict[tuple[str, str], Mapping[str, Any]]:
    if kind == "questions":
        raw = (side.get("questions") or {}).get("items") or []
        key = "question"
    else:
        raw = side.get("probes") or []
        key = "prompt"
    return {
        (str(p.get(key) or ""), str(p.get("answer") or "")): p
        for p in raw
        if isinstance(p, Mapping)
    }


def _pct(hits: int, n: int) -> str:
    return f"{hits} of {n} ({100 * hits / n:.0f}%)" if n else "—"


def _fmt(value: Any, digits: int = 1) -> str:
    try:
        return f"{float(value):,.{digits}f}"
    except (TypeError, ValueError):
        return "—"


def _share(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _better(a: float | None, b: float | None, lower_is_better: bool = False) -> str | None:
    if a is None or b is None or a == b:
        return None
    if lower_is_better:
        return "a" if a < b else "b"
    return "a" if a > b else "b"


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


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


def compare_jobs(a: Job, b: Job) -> Comparison:
    """Job A against job B on the probes both were scored on."""
    after_a, after_b = a.scores["after"], b.scores["after"]
    base_a = (a.scores or {}).get("before") or {}
    has_q = bool((after_a.get("questions") or {}).get("n")) and bool(
        (after_b.get("questions") or {}).get("n")
    )
    kind = "questions" if has_q else "completion"
    items_a, items_b = _items(after_a, kind), _items(after_b, kind)
    items_base = _items(base_a, kind)
    common = [k for k in items_a if k in items_b]
    same = bool(items_a) and items_a.keys() == items_b.keys()

    if not items_a and not items_b:
        message = "Neither job had facts to check, so recall cannot be compared."
    elif same:
        message = (
            f"Both jobs were scored on the same {len(common)} "
            f"{'questions' if kind == 'questions' else 'fact checks'}: a fair comparison."
        )
    else:
        why = _documents_differ(a, b) or "they were built with different settings"
        message = (
            f"The two jobs were scored on different probes ({why}). The figures below use "
            f"only the {len(common)} they share (job #{a.id} had {len(items_a)}, "
            f"job #{b.id} had {len(items_b)})."
        )
    hits = {
        name: sum(bool(items.get(k, {}).get("hit")) for k in common)
        for name, items in (("a", items_a), ("b", items_b), ("base", items_base))
    }
    n = len(common)
    metrics = [
        MetricRow(
            "Knowledge recall" + (" (questions)" if kind == "questions" else " (completions)"),
            _pct(hits["base"], n) if items_base else "—",
            _pct(hits["a"], n),
            _pct(hits["b"], n),
            _better(hits["a"], hits["b"]) if n else None,
        )
    ]
    ppl_a, ppl_b = _float(after_a.get("perplexity")), _float(after_b.get("perplexity"))
    metrics.append(
        MetricRow(
            "Held-out perplexity (lower is better)",
            _fmt(base_a.get("perplexity")),
            _fmt(ppl_a),
            _fmt(ppl_b),
            _better(ppl_a, ppl_b, lower_is_better=True) if same else None,
            "" if same else "measured on different held-out text",
        )
    )
    gen_a = _float((after_a.get("general") or {}).get("perplexity"))
    gen_b = _float((after_b.get("general") or {}).get("perplexity"))
    if gen_a is not None or gen_b is not None:
        metrics.append(
            MetricRow(
                "Forgetting check: general-text perplexity (lower is better)",
                _fmt((base_a.get("general") or {}).get("perplexity")),
                _fmt(gen_a),
                _fmt(gen_b),
                _better(gen_a, gen_b, lower_is_better=True),
            )
        )
    f1_a = _float((after_a.get("qa") or {}).get("f1"))
    f1_b = _float((after_b.get("qa") or {}).get("f1"))
    if f1_a is not None or f1_b is not None:
        metrics.append(
            MetricRow(
                "Your held-out questions: token F1",
                _share(_float((base_a.get("qa") or {}).get("f1"))),
                _share(f1_a),
                _share(f1_b),
                _better(f1_a, f1_b) if same else None,
                "" if same else "different held-out questions",
            )
        )

    facts = []
    for k in common:
        pa, pb = items_a[k], items_b[k]
        facts.append(
            FactRow(
                question=k[0],
                answer=k[1],
                source=str(pa.get("source") or ""),
                a_output=str(pa.get("output") or ""),
                a_hit=bool(pa.get("hit")),
                b_output=str(pb.get("output") or ""),
                b_hit=bool(pb.get("hit")),
            )
        )
    facts.sort(key=lambda f: f.a_hit == f.b_hit)  # disagreements first, then document order
    return Comparison(
        job_a=a,
        job_b=b,
        same_probes=same,
        n_common=n,
        n_a=len(items_a),
        n_b=len(items_b),
        kind=kind,
        message=message,
        metrics=metrics,
        facts=facts,
    )


def compare_in_project(session: Session, project: Project, a_id: Any, b_id: Any) -> Comparison:
    """Validate the two job ids from the form and compare them. InvalidInput in words."""
    try:
        ids = int(str(a_id)), int(str(b_id))
    except ValueError:
        raise InvalidInput("Choose two finished training jobs to compare.") from None
    if ids[0] == ids[1]:
        raise InvalidInput("Choose two different training jobs to compare.")
    jobs = []
    for job_id in ids:
        job = session.get(Job, job_id)
        if job is None or job.project_id != project.id:
            raise NotFound(f"Training job #{job_id} is not part of this project.")
        if job.state != JobState.done or not (job.scores or {}).get("after"):
            raise InvalidInput(f"Training job #{job_id} has no scores yet: it has not finished.")
        jobs.append(job)
    return compare_jobs(*jobs)
