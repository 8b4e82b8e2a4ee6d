"""Jobs left running by a dead worker go back on the queue; they resume from checkpoint."""

from __future__ import annotations

import logging
import socket

from sqlalchemy import or_, select

from app.contract.tasks import TRAIN_TASK
from app.db import session_scope, utcnow
from app.models import Job, JobState
from app.queue import enqueue_after_commit
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
