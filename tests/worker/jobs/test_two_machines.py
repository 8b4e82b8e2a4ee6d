"""One job on two machines: two Celery training workers, one in this network namespace and
one in another (scripts/netns.py: a veth pair, shaped to 1 Gbit/s), sharing a Redis that
listens on the link, the database and the data folder. The job's worker finds the other one
free in the registry, sends it its part on its node queue, and both train data parallel over
the link (c10d rendezvous at the job's machine, gloo pinned to the veth)."""

from __future__ import annotations

import secrets
import shutil
import subprocess
from pathlib import Path

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
        # Machines differ in threads: the job's machine runs its ranks on its worker's count
        # (1 here), the joining one on one per core (the ranks' start check once took their
        # equal weights for other ones).
        settings_ = {"REDIS_URL": url, "DOCTUNE_TRAIN_NODES": "2",
                     "DOCTUNE_TRAIN_PARALLEL": parallel, "OMP_NUM_THREADS": "1"}
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


def test_the_chat_answers_on_two_machines(tmp_path):
    """DOCTUNE_CHAT_NODES=2: the chat worker holds the first half of the model and reserves
    the other machine's idle training worker for the second; the reply is one machine's,
    its hidden states and logits crossed the link, and the reservation ends with the chat."""
    from app.accounts.service import create_user
    from app.chat.models import ChatMessage, Conversation, ReplyState
    from app.chat.service import ask
    from app.contract.tasks import CHAT_TASK
    from app.settings import settings
    from worker.chat.generate import generate
    from worker.chat.loaded import ChatModels, Version
    from worker.chat.prompt import turn_ids

    project_id = _ready_project(tmp_path, "chat on two machines")
    question = "Where does NW-4471 ship from?"
    with TwoNodes(LINKS[1]) as nodes:
        redis, url = _redis_on(nodes.addr_a)
        settings_ = {"REDIS_URL": url, "DOCTUNE_CHAT_NODES": "2"}
        chat = WorkerProcess("chat", "chat", host="node-a", env=settings_)
        b = WorkerProcess("train", "train", host="node-b", env=settings_,
                          prefix=nodes.on_b([]))
        try:
            chat.start(), b.start()
            wait_for(lambda: _online(chat.node, b.node), 60, "both workers in the registry")
            with session_scope() as s:  # the other machine is the only free training worker
                s.execute(update(Worker).where(Worker.node.not_in([chat.node, b.node]))
                          .values(stopped_at=utcnow()))
                s.info[INLINE] = []  # the reply's task goes to the two machines' Redis, below
                user = create_user(s, f"asker{secrets.token_hex(4)}", "member")
                s.flush()
                conversation = Conversation(project_id=project_id, user_id=user.id)
                s.add(conversation)
                reply_id = ask(s, conversation, question).id
            before = nodes.wire_bytes()
            Celery(broker=url).send_task(CHAT_TASK, args=[reply_id], queue="chat")

            def finished():
                with session_scope() as s:
                    m = s.get(ChatMessage, reply_id)
                    return m.reply_state.finished and (m.state, m.token_ids, m.error)
            state, ids, error = wait_for(finished, 180, "the reply on two machines")
            crossed = nodes.wire_bytes() - before
            lent_to = _lent(b.node)
        finally:
            chat.stop()
            if b.proc and b.proc.poll() is None:  # the stage ends with its chat worker
                wait_for(lambda: _lent(b.node) is None, 60, "the reservation ended")
            b.stop()
            redis.terminate()
            redis.wait(timeout=10)
    assert state == ReplyState.done, error
    assert lent_to == chat.node  # the other machine held the chat's second stage
    assert crossed > 10_000  # hidden states one way, logits the other
    assert "Chat stage for chat@node-a" in b.log.read_text(errors="replace")
    base = Path(settings.base_model)
    one = ChatModels(base, tmp_path / "one", None)
    with one.use(Version(None)) as loaded:
        prompt = turn_ids(loaded.tokenizer, [], [{"role": "user", "content": question}])
        expected = generate(loaded.model, loaded.tokenizer, None, prompt, max_new_tokens=len(ids))
    assert ids == expected.ids  # one machine's tokens


def _lent(node: str) -> str | None:
    with session_scope() as s:
        return s.query(Worker.chat_stage_of).filter_by(node=node).scalar()
