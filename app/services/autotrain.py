"""Auto-train: the watched folder queues training by itself, per project.

"After changes" waits until the documents have been unchanged for the project's quiet
period; "nightly" looks once a day at a set local time. Either way a job is queued only when
something changed since the last successful job, and never while another job of the project
is waiting or running: a queued auto job takes in later changes instead (its document list
is updated until a worker claims it)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta

from sqlalchemy import update
from sqlalchemy.orm import Session

from app import audit
from app.audit import Action
from app.models import AutoTrain, Job, JobState, Project
from app.services.jobs import create_job, current_version, job_sources, readiness
from app.services.projects import corpus_of


@dataclass
class AutoStep:
    """What one look at a project did ("queued", "absorbed") or why it waited."""

    action: str
    job_id: int | None = None


def last_nightly_moment(at: str, now_utc: datetime) -> datetime:
    """The latest moment at or before `now_utc` (naive UTC) that the local clock read `at`
    ("HH:MM"), as naive UTC."""
    hours, minutes = (int(x) for x in at.split(":"))
    local_now = now_utc.replace(tzinfo=UTC).astimezone()
    moment = datetime.combine(local_now.date(), time(hours, minutes), local_now.tzinfo)
    if moment > local_now:
        moment -= timedelta(days=1)
    return moment.astimezone(UTC).replace(tzinfo=None)


def auto_train_step(session: Session, project: Project, now: datetime) -> AutoStep:
    """Look at one project once (`now`: naive UTC); queue or update an auto job if due."""
    mode = project.auto_train
    if mode == AutoTrain.off:
        return AutoStep("off")
    if mode == AutoTrain.changes:
        quiet = timedelta(seconds=project.auto_quiet_s)
        if project.last_change_at is not None and now - project.last_change_at < quiet:
            return AutoStep("waiting for quiet")
    elif mode == AutoTrain.nightly:
        moment = last_nightly_moment(project.auto_nightly_at, now)
        if project.auto_fired_at is not None and project.auto_fired_at >= moment:
            return AutoStep("waiting for the night")

    corpus = corpus_of(project)
    ready = readiness(corpus) is None
    active = [j for j in project.jobs if not JobState(j.state).finished]
    waiting_auto = [j for j in active if j.auto and j.state == JobState.queued]
    if waiting_auto:
        job = waiting_auto[0]
        wanted = job_sources(
            corpus, session.get(Job, job.parent_job_id) if job.parent_job_id else None
        )
        if ready and _ids(wanted) != _ids(job.sources):
            # Only while still queued: a worker that claimed it already keeps what it read.
            res = session.execute(
                update(Job)
                .where(Job.id == job.id, Job.state == JobState.queued)
                .values(sources=wanted)
                .execution_options(synchronize_session=False)
            )
            if res.rowcount == 1:
                session.refresh(job)
                return AutoStep("absorbed", job.id)
        return AutoStep("a job is waiting", job.id)
    if active:
        return AutoStep("a job is running", active[0].id)
    if not ready:
        return AutoStep("documents not ready")

    current = _ids(job_sources(corpus, None))
    reference = current_version(project)
    trained = _ids(reference.sources) if reference else set()
    added = current - trained
    removed = trained - current
    # Starting from the tuned version cannot forget a deleted document: only new or edited
    # content is worth a job then. From the base model, a removal changes the result too.
    changed = bool(added) or (bool(removed) and project.start_from == "base")
    if not changed:
        _fired(project, mode, now)
        return AutoStep("up to date")
    finished_auto = [j for j in project.jobs if j.auto and JobState(j.state).finished]
    last_auto = max(finished_auto, key=lambda j: j.id, default=None)
    if (
        last_auto is not None
        and last_auto.state != JobState.done
        and _ids(last_auto.sources) == current
    ):
        _fired(project, mode, now)
        return AutoStep("last auto job failed on these documents", last_auto.id)
    method = reference.method if reference else "lora"
    job = create_job(session, project, {"method": method}, auto=True)
    audit.record(session, Action.training_started, actor=audit.AUTO_TRAIN,
                 subject=f"project “{project.name}”", detail=f"job {job.id}, {method}")
    _fired(project, mode, now)
    return AutoStep("queued", job.id)


def _fired(project: Project, mode: str, now: datetime) -> None:
    if mode == AutoTrain.nightly:
        project.auto_fired_at = now


def _ids(sources: list | None) -> set[int]:
    return {s["id"] for s in sources or [] if isinstance(s, dict) and isinstance(s.get("id"), int)}
