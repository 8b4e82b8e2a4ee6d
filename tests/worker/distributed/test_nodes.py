"""Which other machines' training workers a job on several machines takes
(worker/distributed/nodes.py), against the migrated test database: online training workers
of other machines that run no job and lend to no other running job; a job reserves the
ones it takes, so two jobs asking at once never share one, and frees them when it ends."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import delete, select

from app.contract.workers import ONLINE_WITHIN_S
from app.db import session_scope, utcnow
from app.models import Job, JobState, Project, Worker
from tests.app.factories import make_job, make_project, make_worker
from worker.distributed.nodes import PeerFinder, free_peers, release_peers


@pytest.fixture
def machines(migrated_db):
    """A main machine's worker, three other machines' training workers (one offline), an
    ingest-only worker elsewhere, and two running jobs claimed on the main machine."""
    tag = uuid.uuid4().hex[:6]
    names = {k: f"{k}@{k}-{tag}" for k in ("main", "box2", "box3", "box4", "lost")}
    with session_scope() as s:
        make_worker(s, names["main"])
        for k in ("box2", "box3", "box4"):
            make_worker(s, names[k])
        make_worker(s, names["lost"],
                    last_seen_at=utcnow() - timedelta(seconds=ONLINE_WITHIN_S + 5))
        make_worker(s, f"ingest@elsewhere-{tag}", queues=["ingest"])
        project = make_project(s, f"p-{tag}")
        jobs = [make_job(s, project, JobState.running, claimed_by=names["main"]).id
                for _ in range(2)]
    yield names, jobs
    for job_id in jobs:
        release_peers(job_id)  # the session's own workers may have been taken too
    with session_scope() as s:
        s.execute(delete(Worker).where(Worker.node.like(f"%-{tag}")))
        s.execute(delete(Job).where(Job.id.in_(jobs)))
        s.execute(delete(Project).where(Project.name == f"p-{tag}"))


def _lending() -> dict[str, int | None]:
    with session_scope() as s:
        return {w.node: w.lending_to for w in s.scalars(select(Worker))}


def _ours(names: dict[str, str], peers) -> set[str]:
    """The peers among this test's machines (the session's own workers are online too)."""
    return {p.node for p in peers} & {names[k] for k in ("box2", "box3", "box4", "lost")}


def test_two_jobs_asking_at_once_never_get_the_same_machine(machines):
    names, (one, two) = machines
    got: dict[int, list[str]] = {}

    def ask(job_id: int) -> None:
        got[job_id] = [p.node for p in free_peers(5, names["main"], job_id)]

    threads = [threading.Thread(target=ask, args=(j,)) for j in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    others = {names["box2"], names["box3"], names["box4"]}
    mine = {j: set(got[j]) & (others | {names["lost"], names["main"]}) for j in (one, two)}
    assert mine[one] | mine[two] == others  # between them every free one; not its own
    assert not set(got[one]) & set(got[two])  # machine, not an offline one; none twice
    lending = _lending()
    assert all(lending[n] == j for j in (one, two) for n in got[j])
    # A job asking again (after a lost machine) finds its own reservations again.
    assert {p.node for p in free_peers(5, names["main"], one)} == set(got[one])


def test_released_or_finished_reservations_are_free_again(machines):
    names, (one, two) = machines
    finder = PeerFinder(9, names["main"], one)
    assert len(_ours(names, finder())) == 3
    assert _ours(names, free_peers(9, names["main"], two)) == set()  # all lent to the first
    finder.release()
    assert not any(_lending().values())
    assert len(_ours(names, free_peers(9, names["main"], two))) == 3
    with session_scope() as s:  # the second job ends without releasing (its machine died)
        s.get(Job, two).state = JobState.failed
    # Stale reservations count as free.
    assert len(_ours(names, free_peers(9, names["main"], one))) == 3


def test_a_worker_running_a_job_of_its_own_is_not_lent(machines):
    names, (one, two) = machines
    with session_scope() as s:
        s.get(Job, two).claimed_by = names["box3"]
    assert _ours(names, free_peers(9, names["main"], one)) == {names["box2"], names["box4"]}


def test_a_chats_second_half_reserves_a_machine_jobs_then_leave_be(machines):
    """worker/chat/head.py's reservation (Worker.chat_stage_of): each call takes another free
    machine, never one lent to a running job; jobs do not take a machine holding a chat's
    second half, and take it again once it is released."""
    from worker.distributed.nodes import release_chat_peer, reserve_chat_peer

    names, (one, _two) = machines
    ours = {names[k] for k in ("box2", "box3", "box4")}
    lent = free_peers(1, names["main"], job_id=one)[0].node  # a job holds one machine
    taken: list[str] = []
    try:
        while (node := reserve_chat_peer(f"chat@{names['main']}")) is not None:
            taken.append(node)
        assert lent not in taken and names["lost"] not in taken
        assert ours - {lent} <= set(taken) and len(taken) == len(set(taken))
        assert not _ours(names, free_peers(3, names["main"])) - {lent}
        release_chat_peer(taken[0])
        assert taken[0] in {p.node for p in free_peers(8, names["main"])}
    finally:
        for node in taken:
            release_chat_peer(node)
