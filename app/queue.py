"""The Celery client side: the web app sends tasks by name and never imports the worker.

Tasks queued during a request leave only after the transaction commits; a rollback
drops them (the job row and its message can never disagree). The listeners that do this
are on the app's own session factory (app.db.SessionFactory), not on every Session in the
process. The task names and queues are app.contract.tasks'."""

from __future__ import annotations

from celery import Celery
from sqlalchemy import event
from sqlalchemy.orm import Session

from app.contract.tasks import ROUTES
from app.db import SessionFactory
from app.settings import settings

__all__ = ["INLINE", "celery_client", "enqueue_after_commit", "make_celery"]


def make_celery(name: str = "doctune") -> Celery:
    celery = Celery(name, broker=settings.broker_url)
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        # A task whose worker dies is delivered again. A training job resumes from its
        # checkpoint; an ingest task finds the attempt on the document row and marks the file
        # failed instead of reading it again (worker/ingest.py), so no file loops forever.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,  # a busy worker hoards nothing
        broker_connection_retry_on_startup=True,
        # Redis redelivers an unacknowledged message after this (DOCTUNE_VISIBILITY_TIMEOUT_S,
        # longer than a job: app/settings.py); training jobs also reconcile at worker start
        # (worker/reconcile.py), so this is only a backstop.
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        task_routes=ROUTES,
    )
    return celery


celery_client = make_celery()

_PENDING = "doctune_pending_tasks"
# A session with this key in .info collects its committed tasks in that list instead of
# sending them: the headless CLI runs the very same services, then the tasks in-process.
INLINE = "doctune_inline_tasks"


def enqueue_after_commit(session: Session, task: str, *args: object) -> None:
    """Send `task(*args)` once `session` commits; forget it if the session rolls back."""
    session.info.setdefault(_PENDING, []).append((task, args))


@event.listens_for(SessionFactory, "after_commit")
def _send_pending(session: Session) -> None:
    for task, args in session.info.pop(_PENDING, []):
        if INLINE in session.info:
            session.info[INLINE].append((task, args))
        else:
            celery_client.send_task(task, args=list(args))


@event.listens_for(SessionFactory, "after_soft_rollback")
def _drop_pending(session: Session, _previous_transaction) -> None:
    session.info.pop(_PENDING, None)
