"""The admin's Workers page: every worker that registered (worker/registry.py), whether it is
online, its machine's hardware, the jobs it is running (running or evaluating jobs it
claimed, Job.claimed_by) and the one it lends its training ranks to (Worker.lending_to: a job
another machine's worker runs on several machines), or the chat worker whose model's second
half it holds (Worker.chat_stage_of)."""

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
    lending_to: Job | None  # a running job of another worker that this one trains ranks for


def worker_rows(session: Session, now: datetime | None = None) -> list[WorkerRow]:
    """Online workers first, then by node name; a stopped worker is offline at once, one
    that died silently once ONLINE_WITHIN_S passed without a heartbeat."""
    seen_since = (now or utcnow()) - timedelta(seconds=ONLINE_WITHIN_S)
    workers = session.scalars(select(Worker).order_by(Worker.node)).all()
    running = session.scalars(
        select(Job).where(Job.state.in_([JobState.running, JobState.evaluating])).order_by(Job.id)
    ).all()
    by_id = {j.id: j for j in running}
    rows = [
        WorkerRow(worker=w, hardware=Hardware.model_validate(w.hardware or {}),
                  online=w.stopped_at is None and w.last_seen_at >= seen_since,
                  jobs=[j for j in running if j.claimed_by == w.node],
                  lending_to=by_id.get(w.lending_to) if w.lending_to is not None else None)
        for w in workers
    ]
    return sorted(rows, key=lambda row: not row.online)  # stable: names stay in order
