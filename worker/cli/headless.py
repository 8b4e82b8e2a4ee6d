"""`doctune train DIR`: the web job's path without the web.

The same services create the project, register the files and queue the job; the session
is marked INLINE so the queued tasks are handed back here and run in this process instead
of going through Redis. So the headless result is the web result, minus a browser."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.contract.tasks import INGEST_TASK, PLAN_TASK, TRAIN_TASK
from app.contract.training import FIELD_NAMES
from app.db import session_scope
from app.migrate import upgrade_to_head
from app.models import Job
from app.queue import INLINE
from app.services import planner
from app.services.documents import register_uploads
from app.services.errors import InvalidInput
from app.services.jobs import create_job
from app.services.projects import corpus_of, create_project, get_project
from app.services.uploads import receive_local_file
from app.settings import settings
from worker.ingest import ingest_document
from worker.jobs.dataset_plan import plan_project
from worker.jobs.run import run_job


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def _run_inline(tasks: list, log: Callable[[str], None]) -> None:
    for task, args in tasks:
        if task == INGEST_TASK:
            ingest_document(*args)
        elif task == PLAN_TASK:
            plan_project(*args)
        elif task == TRAIN_TASK:
            log("Training (this takes a while on a CPU)...")
            run_job(*args, node="cli")


def add_folder(folder: Path, log: Callable[[str], None] | None = None
               ) -> tuple[int, list[dict[str, Any]]]:
    """A new project holding the files of `folder`, read as the worker reads uploads: the
    project's id, and the files refused on the way in (as result rows)."""
    log = log or (lambda _msg: None)
    upgrade_to_head()
    tasks: list = []
    with session_scope() as session:
        session.info[INLINE] = tasks
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        project = create_project(session, f"{folder.resolve().name[:60]} (doctune train {stamp})")
        # The user named this folder on their own machine: a link in it is followed (by
        # resolving it here), unlike in a watched folder, and shown by its own name.
        received = [receive_local_file(p.resolve(), name=p.name, dest_dir=settings.documents_dir,
                                       max_file_bytes=settings.max_upload_bytes)
                    for p in _files(folder)]
        outcomes = register_uploads(session, project, received)
        project_id = project.id
    log(f"Reading {sum(o.fate == 'accepted' for o in outcomes)} documents...")
    _run_inline(tasks, log)
    return project_id, [{"name": o.name, "status": "refused", "words": 0, "qa_pairs": 0,
                         "error": o.message} for o in outcomes if o.fate == "refused"]


def count_plan(project_id: int) -> None:
    """Count the project's dataset plan for the Train button's settings, as the worker does
    when the project page asks (so the job keeps an estimate made from the real steps)."""
    tasks: list = []
    with session_scope() as session:
        session.info[INLINE] = tasks
        project = get_project(session, project_id)
        planner.ask_for_plan(project, corpus_of(project))
    _run_inline(tasks, lambda _msg: None)


def train_project(project_id: int, overrides: dict[str, Any],
                  log: Callable[[str], None] | None = None,
                  refused: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Train a job on the project's documents with `overrides` of the Train form's settings
    (and seed, max_steps); the job's results."""
    log = log or (lambda _msg: None)
    result: dict[str, Any] = {"project_id": project_id, "job_id": None}
    tasks: list = []
    try:
        with session_scope() as session:
            session.info[INLINE] = tasks
            project = get_project(session, project_id)
            result["documents"] = [
                {"name": d.original_name, "status": d.status, "words": d.word_count,
                 "qa_pairs": d.qa_count, "error": d.error} for d in project.documents
            ] + list(refused or [])
            form = {"method": overrides.get("method", "lora")}
            form |= {k: str(overrides[k]) for k in FIELD_NAMES if k in overrides}
            job = create_job(session, project, form)
            extra = {k: overrides[k] for k in ("seed", "max_steps") if k in overrides}
            job.params = {**job.params, **extra}
            result["job_id"] = job.id
    except InvalidInput as exc:
        return result | {"state": "failed", "error": exc.message, "scores": None,
                         "dataset": None, "metrics": None, "export_errors": {},
                         "params": {}, "artifacts": {}}
    _run_inline(tasks, log)

    with session_scope() as session:
        job = session.get(Job, result["job_id"])
        return result | {"state": job.state, "error": job.error, "params": job.params,
                         "scores": job.scores, "dataset": job.dataset, "metrics": job.metrics,
                         "export_errors": job.export_errors or {},
                         "artifacts": {k: str(settings.data_path(v))
                                       for k, v in (job.artifacts or {}).items()},
                         "loss_history": job.loss_history,
                         "estimate": job.estimate}


def train_folder(folder: Path, overrides: dict[str, Any],
                 log: Callable[[str], None] | None = None) -> dict[str, Any]:
    project_id, refused = add_folder(folder, log)
    count_plan(project_id)
    return train_project(project_id, overrides, log, refused)
