"""A job delivered twice runs once. Celery may hand a job's message to a second worker (Redis'
visibility timeout passing on a long job; the message kept after a worker restart's requeue),
possibly on another machine: the claim (worker/jobs/run.py) is one conditional UPDATE, so the
second delivery finds the job taken and does nothing. Against the migrated test database."""

from __future__ import annotations

import threading
import time

from app.db import session_scope
from app.models import Job, JobState
from app.services.projects import create_project
from worker.jobs.run import claim, run_job


def _queued_job() -> int:
    with session_scope() as session:
        project = create_project(session, f"Claims {time.monotonic_ns()}")
        job = Job(project=project, state=JobState.queued, method="lora", params={}, sources=[])
        session.add(job)
        session.flush()
        return job.id


def _job(job_id: int) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def test_a_second_delivery_from_another_node_does_not_run_the_job(migrated_db):
    job_id = _queued_job()
    assert claim(job_id, "train@first")
    assert not claim(job_id, "train@second")
    # The train task's whole body on the second delivery: no claim, so nothing runs.
    assert run_job(job_id, node="train@second") is None
    job = _job(job_id)
    assert (job.state, job.claimed_by, job.attempts) == (JobState.running, "train@first", 1)
    assert job.phase == "Starting"  # no pipeline phase was written by the second node


def _race(job_id: int, nodes: tuple[str, str]) -> dict[str, bool]:
    """Two deliveries of `job_id` claiming it at the same moment: node -> whether it won."""
    start = threading.Barrier(len(nodes))
    won: dict[str, bool] = {}

    def deliver(node: str) -> None:
        start.wait()
        won[node] = claim(job_id, node)

    threads = [threading.Thread(target=deliver, args=(node,)) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return won


def test_two_nodes_claiming_at_the_same_moment_one_wins(migrated_db):
    for _ in range(5):
        job_id = _queued_job()
        won = _race(job_id, ("train@a", "train@b"))
        assert sorted(won.values()) == [False, True]
        job = _job(job_id)
        assert job.claimed_by == next(n for n, ok in won.items() if ok) and job.attempts == 1
