"""One job on two machines: two Celery training workers, one in this network namespace and
one in another (scripts/netns.py: a veth pair, shaped to 1 Gbit/s), sharing a Redis that
listens on the link, the database and the data folder. The job's worker finds the other one
free in the registry, sends it its part on its node queue, and both train data parallel over
the link (c10d rendezvous at the job's machine, gloo pinned to the veth)."""

from __future__ import annotations

import secrets
import shutil
import subprocess

import pytest
from celery import Celery
from sqlalchemy import update

from app.contract.tasks import TRAIN_TASK
from app.db import session_scope, utcnow
from app.models import JobState, Project, Worker
from app.queue import INLINE
from app.services.jobs import create_job
from scripts.netns import LINKS, TwoNodes, usable
from tests.conftest import SESSION_DIR, WorkerProcess, _free_port, wait_for
from tests.worker.test_tasks import _job, _ready_project

pytestmark = [
    pytest.mark.usefixtures("celery_worker"),  # reads the documents, as in any job
    pytest.mark.skipif(usable() is not None, reason=str(usable())),
]


def _redis_on(address: str) -> tuple[subprocess.Popen, str]:
    """A Redis for the two machines, on node A's end of the link, with a password."""
    port, password = _free_port(), secrets.token_hex(16)
    folder = SESSION_DIR / f"redis-{port}"
    folder.mkdir()
    proc = subprocess.Popen(
        [shutil.which("redis-server"), "--bind", address, "--port", str(port),
         "--requirepass", password, "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    return proc, f"redis://:{password}@{address}:{port}/0"


def _online(*nodes: str) -> bool:
    with session_scope() as s:
        rows = s.query(Worker).filter(Worker.node.in_(nodes), Worker.stopped_at.is_(None)).all()
        return len(rows) == len(nodes)


@pytest.mark.parametrize("parallel", ["data", "pipeline"])
def test_a_job_trains_on_two_machines_over_the_link(tmp_path, parallel):
    """Data parallel: the gradients cross the link. A pipeline: each machine one stage, the
    hidden states and their gradients cross it."""
    project_id = _ready_project(tmp_path, "two machines")
    with TwoNodes(LINKS[1]) as nodes:
        redis, url = _redis_on(nodes.addr_a)
        settings_ = {"REDIS_URL": url, "DOCTUNE_TRAIN_NODES": "2",
                     "DOCTUNE_TRAIN_PARALLEL": parallel}
        a = WorkerProcess("train", "train", host="node-a", env=settings_)
        b = WorkerProcess("train", "train", host="node-b", env=settings_,
                          prefix=nodes.on_b([]))
        try:
            a.start(), b.start()
            wait_for(lambda: _online(a.node, b.node), 60, "both workers in the registry")
            with session_scope() as s:  # only these two machines: the session's worker is
                s.execute(update(Worker).where(Worker.node.not_in([a.node, b.node]))  # on
                          .values(stopped_at=utcnow()))  # another broker
                s.info[INLINE] = []  # the job's task goes to the two machines' Redis, below
                job = create_job(s, s.get(Project, project_id), {"method": "lora"})
                job.params = {**job.params, "max_steps": 6}  # a few steps show it
                job_id = job.id
            before = nodes.wire_bytes()
            Celery(broker=url).send_task(TRAIN_TASK, args=[job_id], queue="train")
            job = wait_for(lambda: (j := _job(job_id)).state in {JobState.done, JobState.failed}
                           and j, 300, "the job on two machines")
            crossed = nodes.wire_bytes() - before
        finally:
            for w in (a, b):
                w.stop()
            redis.terminate()
            redis.wait(timeout=10)
    assert job.state == JobState.done, job.error
    assert job.claimed_by in (a.node, b.node)  # either may take it from the train queue
    assert job.telemetry["world_size"] == 2  # rank 0's engine: one of two ranks
    assert job.telemetry["pipeline_parallel"] is (parallel == "pipeline")
    assert job.telemetry["reduce_bytes"] > 0  # gradients summed, or the norm gathered
    assert crossed >= job.telemetry["reduce_bytes"]  # over the link
    logs = SESSION_DIR / "data" / "jobs" / str(job_id) / "ranks"
    other = nodes.addr_b if job.claimed_by == a.node else nodes.addr_a
    assert [p for p in logs.glob("ranks-*.log") if other in p.name], "the other machine ran no ranks"
    assert job.step == job.total_steps > 0
