"""The admin's Workers page: every worker that registered (worker/registry.py), whether it is
online, its machine's hardware, and the jobs it is running (running or evaluating jobs it
claimed, Job.claimed_by)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.contract.workers import ONLINE_WITHIN_S, Hardware
from app.db import utcnow
from app.models import Job, JobState, Worker


@dataclass(frozen=True)
class WorkerRow:
    """One line of the page."""

    worker: Worker
    hardware: Hardware
    online: bool
    jobs: list[Job]


def worker_rows(session: Session, now: datetime | None = None) -> list[WorkerRow]:
    """Online workers first, then by node name; a stopped worker is offline at once, one
    that died silently once ONLINE_WITHIN_S passed without a heartbeat."""
    seen_since = (now or utcnow()) - timedelta(seconds=ONLINE_WITHIN_S)
    workers = session.scalars(select(Worker).order_by(Worker.node)).all()
    running = session.scalars(
        select(Job).where(Job.state.in_([JobState.running, JobState.evaluating]),
                          Job.claimed_by.in_([w.node for w in workers])).order_by(Job.id)
    ).all()
    rows = [
        WorkerRow(worker=w, hardware=Hardware.model_validate(w.hardware or {}),
                  online=w.stopped_at is None and w.last_seen_at >= seen_since,
                  jobs=[j for j in running if j.claimed_by == w.node])
        for w in workers
    ]
    return sorted(rows, key=lambda row: not row.online)  # stable: names stay in order
