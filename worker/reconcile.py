"""What a dead worker left behind, put right when a worker starts: jobs it was running go back
on the queue (they resume from their checkpoint); documents it was reading are marked failed
(a reader that took its worker down is not run again)."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

from sqlalchemy import or_, select

from app.contract.tasks import TRAIN_TASK
from app.db import session_scope, utcnow
from app.models import DocStatus, Document, Job, JobState
from app.queue import enqueue_after_commit
from app.settings import settings
from worker.ingest import READ_BEFORE
from worker.jobs.run import STALE_AFTER

log = logging.getLogger(__name__)


def requeue_orphaned_jobs(node: str | None = None) -> list[int]:
    """Requeue running jobs claimed by `node` (this worker's previous life) or gone stale."""
    node = node or socket.gethostname()
    stale_before = utcnow() - STALE_AFTER
    with session_scope() as session:
        jobs = session.scalars(
            select(Job).where(
                Job.state.in_([JobState.running, JobState.evaluating]),
                or_(Job.claimed_by == node, Job.heartbeat_at.is_(None),
                    Job.heartbeat_at < stale_before),
            )
        ).all()
        for job in jobs:
            job.state, job.phase = JobState.queued, "Resuming after a restart"
            enqueue_after_commit(session, TRAIN_TASK, job.id)
        ids = [j.id for j in jobs]
    if ids:
        log.warning("requeued orphaned jobs %s", ids)
    return ids


# Past the reader's own wall clock by this much, a read that has not finished never will.
ABANDONED_READ_MARGIN = timedelta(minutes=5)


def fail_abandoned_reads(timeout_s: float | None = None) -> list[int]:
    """Mark failed the pending documents whose reading started longer ago than the reader's
    wall clock allows (plus a margin): the worker reading them died with them. Without this,
    such a file would stay "pending" until the broker redelivers its task (hours)."""
    timeout = timedelta(seconds=settings.reader_timeout_s if timeout_s is None else timeout_s)
    started_before = utcnow() - timeout - ABANDONED_READ_MARGIN
    with session_scope() as session:
        docs = session.scalars(
            select(Document).where(
                Document.status == DocStatus.pending,
                Document.read_attempts > 0,
                Document.read_started_at < started_before,
            )
        ).all()
        now = utcnow()
        for doc in docs:
            doc.status, doc.error, doc.extracted_at = DocStatus.failed, READ_BEFORE, now
        ids = [d.id for d in docs]
    if ids:
        log.warning("marked failed documents whose reading never finished: %s", ids)
    return ids
