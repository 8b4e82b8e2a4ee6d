"""Training jobs: starting one, cancelling it, and turning its row into what the page shows
(the score card itself: app/services/score_card.py).

The worker owns a job once it is queued: it moves `state`, writes progress, scores, the other
results and artifacts. The web side only creates the row, asks for cancellation, and reads."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app.contract.artifacts import ADAPTER, GGUF_F16, GGUF_Q8_0, MERGED
from app.contract.results import export_errors
from app.contract.tasks import TRAIN_TASK
from app.contract.training import FIELDS, METHODS, chosen, default_params, settle
from app.models import Job, JobState, Project
from app.queue import enqueue_after_commit
from app.services import planner
from app.services.documents import model_versions
from app.services.errors import InvalidInput, NotFound
from app.services.projects import Corpus, corpus_of
from app.services.score_card import score_summary
from app.settings import settings

# The downloads as the job page lists them (app.contract.artifacts.KINDS), in this order.
ARTIFACT_LABELS = {
    ADAPTER: "LoRA adapter (.zip)",
    MERGED: "Merged model (.zip)",
    GGUF_Q8_0: "GGUF for llama.cpp / Ollama, 8-bit (.zip)",
    GGUF_F16: "GGUF for llama.cpp / Ollama, 16-bit (.zip)",
}
ARTIFACT_HINTS = {
    ADAPTER: "Small; load it on top of the base model (peft).",
    MERGED: "The complete model with your training built in (transformers, safetensors).",
    GGUF_Q8_0: "Half the size of 16-bit, nearly the same answers; with an Ollama Modelfile.",
    GGUF_F16: "Full 16-bit precision; with an Ollama Modelfile.",
}


# Starting a job


def readiness(corpus: Corpus) -> str | None:
    """Why training cannot start now, in plain words; None when it can."""
    if corpus.n_documents == 0:
        return "Add documents first: there is nothing to learn from yet."
    if corpus.n_pending:
        n = corpus.n_pending
        return f"Please wait: {n} document{'s are' if n != 1 else ' is'} still being read."
    if corpus.n_extracted == 0:
        return "None of the documents gave usable text. Add documents that contain text."
    if corpus.n_words == 0 and corpus.n_qa == 0:
        return "The documents were read but contain no text to learn from."
    return None


def defaults_for(corpus: Corpus, method: str = "lora") -> dict[str, Any]:
    return default_params(corpus.n_words, corpus.n_qa, method)


def shown_defaults(project: Project, corpus: Corpus, method: str = "lora") -> dict[str, Any]:
    """The defaults as the Train panel shows them: once the worker has counted the project's
    dataset plan, with the passes and the step the job will set from its dataset (a job is
    queued with defaults_for's, and sets them the same way when it starts). `counted` says
    which: False while the passes and step are still guessed from the words."""
    params = defaults_for(corpus, method)
    plan = planner.dataset_plan(project, corpus, params)
    if plan is None:
        return params | {"counted": False}
    return params | settle(params, plan.train_tokens) | {"counted": True}


def format_number(value: Any) -> str:
    """A setting as a person would type it: 0.0002 rather than 2e-04."""
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        text = f"{value:.12f}".rstrip("0").rstrip(".")
        return text if text not in ("", "0") else f"{value:g}"
    return str(value)


# The Train form's "Start from the base model instead of vN" checkbox, as browsers send it
# (ticked: "on"; unticked: the route passes ""), or as a script might spell it.
_FROM_BASE_VALUES = {
    "": False, "0": False, "off": False, "false": False, "no": False,
    "1": True, "on": True, "true": True, "yes": True,
}


def start_from_base(form: Mapping[str, Any], project: Project) -> bool:
    """Whether the job starts from the base model rather than the current tuned version: the
    form's `from_base` choice when it has one (the Train form always does), else the
    project's setting (auto-train). parse_train_form refuses any other value."""
    raw = form.get("from_base")
    if raw is None:
        return project.start_from == "base"
    return _FROM_BASE_VALUES.get(str(raw).strip().lower(), False)


def parse_train_form(form: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The method and the Advanced settings the user filled in (empty fields keep defaults).

    Raises InvalidInput with one plain message per bad field."""
    errors: dict[str, str] = {}
    from_base = form.get("from_base")
    if from_base is not None and str(from_base).strip().lower() not in _FROM_BASE_VALUES:
        errors["from_base"] = "Tick the box to start from the base model, or leave it empty."
    method = str(form.get("method") or "lora").strip().lower()
    if method not in METHODS:
        errors["method"] = "Please choose LoRA or full fine-tuning."
    overrides: dict[str, Any] = {}
    for f in FIELDS:
        name, label, whole, low, high = f.name, f.label, f.whole, f.low, f.high
        raw = str(form.get(name) or "").strip()
        if not raw:
            continue
        kind = "a whole number" if whole else "a number"
        bounds = f"from {format_number(low)} to {format_number(high)}"
        try:
            value: float | int = float(raw.replace(",", "."))
        except ValueError:
            errors[name] = f"{label} must be {kind} {bounds}; “{raw[:40]}” is not."
            continue
        if not math.isfinite(value):
            errors[name] = f"{label} must be {kind} {bounds}."
            continue
        if whole:
            if value != int(value):
                errors[name] = f"{label} must be {kind} {bounds}, without decimals."
                continue
            value = int(value)
        if not low <= value <= high:
            errors[name] = (
                f"{label} must be {kind} {bounds}; {format_number(value)} is out of range."
            )
            continue
        overrides[name] = value
    if errors:
        raise InvalidInput("Some training settings need a fix.", errors)
    return method, overrides


def current_version(project: Project) -> Job | None:
    """The project's tuned version in use: the one the user chose, else the latest done job."""
    done = [j for j in project.jobs if j.state == JobState.done]
    chosen = [j for j in done if j.id == project.current_job_id]
    return chosen[0] if chosen else max(done, key=lambda j: j.id, default=None)


def continuable_version(project: Project) -> str | None:
    """The label ("v3") of the version a new job of the same method (LoRA or full
    fine-tuning) would continue, whatever the project's setting; None when there is no
    version yet. The Train form offers "start from the base model instead" only then."""
    current = current_version(project)
    if current is None:
        return None
    return model_versions(project).get(current.id)


def job_sources(corpus: Corpus, parent: Job | None) -> list[dict[str, Any]]:
    """The documents a job uses, each marked "new" when the version it starts from was not
    trained on that content (an added or edited file); the others are known to it."""
    known = {s.get("sha256") for s in (parent.sources or [])} if parent else set()
    return [
        {"id": d.id, "name": d.original_name, "sha256": d.sha256, "new": d.sha256 not in known}
        for d in corpus.usable
    ]


def create_job(
    session: Session, project: Project, form: Mapping[str, Any], *, auto: bool = False
) -> Job:
    """Queue a training job on the project's extracted documents.

    A job starts from the project's current tuned version (its parent) when that version
    was trained with the same method: a LoRA job continues a LoRA version's adapter, a full
    fine-tune a full version's merged model. A LoRA version and a full job, or a full version
    and a LoRA job, start from the base model, as does any job whose form's `from_base` is
    ticked, or, when the form has no such field (auto-train), whose project is set to start
    from the base model. The row is created now (state queued);
    TRAIN_TASK(job id) leaves after the commit. Raises InvalidInput when training cannot
    start or a setting is out of bounds."""
    corpus = corpus_of(project)
    reason = readiness(corpus)
    if reason:
        raise InvalidInput(reason, {"train": reason})
    method, overrides = parse_train_form(form)
    params = chosen(defaults_for(corpus, method), overrides)
    # Continuing a version means continuing its weights: only a version of the same method.
    parent = None if start_from_base(form, project) else current_version(project)
    if parent is not None and parent.method != method:
        parent = None
    job = Job(
        project=project,
        state=JobState.queued,
        method=method,
        params=params,
        sources=job_sources(corpus, parent),
        auto=auto,
        parent_job_id=parent.id if parent else None,
        estimate=planner.estimate_record(project, corpus, params),  # what the Train panel said
    )
    session.add(job)
    session.flush()
    enqueue_after_commit(session, TRAIN_TASK, job.id)
    return job


# Reading and steering a job


def get_job(session: Session, job_id: int) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(f"There is no training job number {job_id}. It may have been deleted.")
    return job


def request_cancel(session: Session, job: Job) -> bool:
    """Ask the worker to stop the job (it checks every step, or skips a queued job).

    Returns False when the job had already finished, so there was nothing to cancel."""
    if JobState(job.state).finished:
        return False
    job.cancel_requested = True
    session.flush()
    return True


def artifact_file(job: Job, kind: str) -> Path:
    """The zip the worker wrote for `kind`; NotFound with the reason when there is none."""
    label = ARTIFACT_LABELS.get(kind)
    if label is None:
        raise NotFound(
            "There is no such download. Choose the LoRA adapter, the merged model or a GGUF file."
        )
    raw = (job.artifacts or {}).get(kind)
    if not raw:
        if job.state != JobState.done:
            raise NotFound("Downloads are ready once the training job has finished.")
        failed = export_errors(job.export_errors).get(kind)
        if failed:
            raise NotFound(str(failed))
        raise NotFound(f"This job has no {label.split(' (')[0].lower()} to download.")
    path = settings.data_path(raw).resolve()
    if not path.is_relative_to(settings.data_dir.resolve()) or not path.is_file():
        raise NotFound("The file for this download is missing from the data folder.")
    return path


def download_filename(job: Job, kind: str) -> str:
    """E.g. "Support-FAQ-job12-adapter.zip": ASCII only, so every browser keeps it."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", job.project.name).strip("-.")[:60] or "project"
    return f"{stem}-job{job.id}-{kind}.zip"


@dataclass
class LossChart:
    """An inline SVG line chart of the training loss, computed on the server.

    Coordinates are in the SVG's own units: the plot area is left..right x top..bottom, with
    room on the left for the loss labels and below for the step labels."""

    width: int
    height: int
    left: int
    right: int
    top: int
    bottom: int
    points: str  # the polyline's "x,y x,y ..."
    first: float
    last: float
    low: float
    high: float
    last_step: int
    total_steps: int


def loss_chart(
    history: list[list[float]] | None, total_steps: int = 0, width: int = 900, height: int = 220
) -> LossChart | None:
    """None until there is at least one finite loss value."""
    pts = []
    for p in history or []:
        try:
            x, y = float(p[0]), float(p[1])
        except (TypeError, ValueError, IndexError):
            continue
        if math.isfinite(x) and math.isfinite(y):
            pts.append((x, y))
    if not pts:
        return None
    if len(pts) > 600:  # plenty for a chart this wide
        stride = math.ceil(len(pts) / 600)
        pts = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
    losses = [y for _, y in pts]
    low, high = min(losses), max(losses)
    span = (high - low) or 1.0
    x_end = max(float(total_steps), pts[-1][0], 1.0)
    x_start = min(pts[0][0], 0.0)
    left, right, top, bottom = 48, width - 12, 10, height - 24
    coords = []
    for x, y in pts:
        px = left + (x - x_start) / ((x_end - x_start) or 1.0) * (right - left)
        py = top + (high - y) / span * (bottom - top)
        coords.append(f"{px:.1f},{py:.1f}")
    return LossChart(
        width=width,
        height=height,
        left=left,
        right=right,
        top=top,
        bottom=bottom,
        points=" ".join(coords),
        first=losses[0],
        last=losses[-1],
        low=low,
        high=high,
        last_step=int(pts[-1][0]),
        total_steps=int(x_end),
    )


def job_state_label(job: Job) -> str:
    if job.cancel_requested and not JobState(job.state).finished:
        return "cancelling…"
    return {
        JobState.queued: "waiting to start",
        JobState.running: "training",
        JobState.evaluating: "measuring",
        JobState.done: "done",
        JobState.failed: "failed",
        JobState.cancelled: "cancelled",
    }.get(JobState(job.state), job.state)


@dataclass
class JobRow:
    """One line of a project's job list."""

    job: Job
    label: str
    summary: str | None
    version: str | None = None  # "v2": a done job is a tuned model version
    current: bool = False  # the version in use
    parent_version: str | None = None  # the version it started from (incremental)

    @property
    def active(self) -> bool:
        return not JobState(self.job.state).finished


def job_rows(project: Project) -> list[JobRow]:
    """The project's jobs, newest first."""
    jobs = sorted(project.jobs, key=lambda j: j.id, reverse=True)
    versions = model_versions(project)
    current = current_version(project)
    return [
        JobRow(j, job_state_label(j), score_summary(j.scores), versions.get(j.id),
               current is not None and j.id == current.id,
               versions.get(j.parent_job_id) if j.parent_job_id else None)
        for j in jobs
    ]


def set_current_version(session: Session, job: Job) -> None:
    """Make a done job the project's current version (new jobs continue from it)."""
    if job.state != JobState.done:
        raise InvalidInput("Only a finished training job can be the current version.")
    job.project.current_job_id = job.id
    session.flush()


def phase_times(job: Job) -> list[tuple[str, float]]:
    """How long each part of a finished job took, in order (what the next estimates use)."""
    phases = (job.metrics or {}).get("phase_s") or {}
    return [(label, float(phases[key])) for key, label in planner.PHASE_LABELS.items()
            if key in phases]
