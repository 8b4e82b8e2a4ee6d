"""The admin's Workers page (/admin/workers): every registered worker with its machine, its
hardware, whether it is online, and the job it is running, linked to the job's page. Real
app, real database; the rows are written as worker/registry.py writes them."""

from __future__ import annotations

import html
from datetime import timedelta

from app.contract.workers import ONLINE_WITHIN_S
from app.db import session_scope, utcnow
from app.main import create_app
from app.models import JobState
from tests.app.factories import make_job, make_project, make_worker
from tests.app.web import local_client


def _row(page: str, node: str) -> str:
    """The table row of `node` on the page."""
    start = page.index(f"<strong>{node}</strong>")
    return page[page.rindex("<tr", 0, start):page.index("</tr>", start)]


def test_only_an_admin_sees_the_workers(env):
    """(Anonymous visitors are refused on every route: tests/app/test_accounts.py.)"""
    app = create_app()
    for role in ("member", "viewer"):
        with local_client(app, role=role) as client:
            assert client.get("/admin/workers").status_code == 403
            assert 'href="/admin/workers"' not in client.get("/").text


def test_an_admin_sees_each_worker_its_hardware_and_the_job_it_runs(env):
    with session_scope() as session:
        project = make_project(session, "Handbook")
        make_worker(session, "train@gpu-box")
        make_worker(session, "ingest@main", queues=["ingest"], hardware={"cores": 2})
        running = make_job(session, project, JobState.running, claimed_by="train@gpu-box")
        make_job(session, project, JobState.done, claimed_by="train@gpu-box")  # over: not shown
        running_id = running.id
    with local_client(create_app()) as admin:
        assert 'href="/admin/workers"' in admin.get("/").text  # in the admin's menu
        page = html.unescape(admin.get("/admin/workers").text)

    gpu = _row(page, "train@gpu-box")
    assert "on gpu-box · DocTune 0.1.0" in gpu and "node.gpu-box, train" in gpu
    assert "AMD EPYC 9654 96-Core Processor, 16 cores, 128.0 GB RAM" in gpu
    assert "NVIDIA H200 (140.4 GB)" in gpu and "online" in gpu and "offline" not in gpu
    assert f'<a href="/jobs/{running_id}">Job {running_id}</a> of Handbook' in gpu
    assert gpu.count("/jobs/") == 1
    main = _row(page, "ingest@main")
    assert "CPU not known, 2 cores" in main and "no GPU" in main and "nothing" in main


def test_a_worker_not_heard_from_is_offline_and_a_stopped_one_too(env):
    now = utcnow()
    with session_scope() as session:
        project = make_project(session)
        window = timedelta(seconds=ONLINE_WITHIN_S)
        make_worker(session, "train@lost", last_seen_at=now - window - timedelta(seconds=5))
        make_worker(session, "train@quiet", last_seen_at=now - window + timedelta(seconds=30))
        make_worker(session, "train@gone", stopped_at=now, last_seen_at=now)
        # The job a dead worker held stays on its row until a worker requeues it.
        make_job(session, project, JobState.running, claimed_by="train@lost")
    with local_client(create_app()) as admin:
        page = admin.get("/admin/workers").text

    assert "status-failed\">offline" in _row(page, "train@lost")
    assert "last seen" in _row(page, "train@lost") and "/jobs/" in _row(page, "train@lost")
    assert "status-ok\">online" in _row(page, "train@quiet")
    gone = _row(page, "train@gone")
    assert "status-failed\">offline" in gone and "stopped" in gone
    assert page.index("train@quiet") < page.index("train@gone") < page.index("train@lost")
    assert "(every 30 seconds); one not heard from for 90 seconds is offline" in page


def test_no_worker_yet_says_how_to_add_a_machine(env):
    with local_client(create_app()) as admin:
        page = admin.get("/admin/workers").text
    assert "No worker has registered yet" in page
    assert "doctune worker --join --redis redis://HOST:6379/0" in page


def test_a_worker_lending_its_ranks_shows_whose_job_it_trains(env):
    """A job on several machines reserves the other machines' workers (Worker.lending_to,
    worker/distributed/nodes.py); the page says which job each trains for, and a
    reservation whose job is over shows as nothing."""
    with session_scope() as session:
        project = make_project(session, "Handbook")
        make_worker(session, "train@main")
        running = make_job(session, project, JobState.running, claimed_by="train@main")
        over = make_job(session, project, JobState.done, claimed_by="train@main")
        make_worker(session, "train@box2", lending_to=running.id)
        make_worker(session, "train@box3", lending_to=over.id)
        running_id = running.id
    with local_client(create_app()) as admin:
        page = html.unescape(admin.get("/admin/workers").text)
    box2 = _row(page, "train@box2")
    assert (f'Training ranks of <a href="/jobs/{running_id}">Job {running_id}</a> of Handbook, '
            "for train@main") in box2
    assert "nothing" not in box2
    box3 = _row(page, "train@box3")
    assert "nothing" in box3 and "Training ranks" not in box3


def test_a_worker_holding_a_chats_second_half_says_for_whom(env):
    """A chat on two machines reserves another machine's worker (Worker.chat_stage_of,
    worker/chat/head.py) while its second stage runs there."""
    with session_scope() as session:
        make_worker(session, "chat@main", queues=["chat"])
        make_worker(session, "train@box4", chat_stage_of="chat@main")
    with local_client(create_app()) as admin:
        page = html.unescape(admin.get("/admin/workers").text)
    box4 = _row(page, "train@box4")
    assert "Second half of the chat's model, for chat@main" in box4
    assert "nothing" not in box4
    assert "Second half" not in _row(page, "chat@main")
