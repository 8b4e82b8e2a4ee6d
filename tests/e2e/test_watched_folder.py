"""The watched folder without a browser: files put in a project's folder are read by the real
worker, auto-train queues one job once the folder is quiet, the worker trains it, and the
project page lists the new model version with its score. Every part is a real process: the
watcher (`doctune watch`), the Celery worker, Redis, the SQLite file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from sqlalchemy import select

from app.db import session_scope
from app.models import Job, JobState, Project
from app.services.inbox import update_inbox_settings
from app.services.projects import create_project
from tests.app.web import local_client
from tests.conftest import ROOT, SESSION_DIR, wait_for
from tests.fixtures import docs as fx

FACTS = [
    "The Northwind warranty lasts 36 months from the date of delivery.",
    "Part NW-4471 ships from the Lyon warehouse within 2 working days.",
    "Support tickets marked urgent are answered within 4 hours by Dana Whitfield.",
]


def test_files_in_the_folder_become_a_scored_model_version(celery_worker, tmp_path, monkeypatch):
    from app.settings import settings

    inbox_root = tmp_path / "inbox"
    shared = tmp_path / "shared"  # a folder outside the inbox root, allowed for watching
    monkeypatch.setattr(settings, "allowed_folders", [shared])  # for the form's check here
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        DOCTUNE_INBOX_DIR=str(inbox_root),
        DOCTUNE_ALLOWED_FOLDERS=str(shared),
        DOCTUNE_WATCH_STABLE_S="0.7",
        DOCTUNE_WATCH_RESCAN_S="3",
    )
    log = SESSION_DIR / "watcher-e2e.log"
    with open(log, "ab") as logf:
        watcher = subprocess.Popen(
            [sys.executable, "-m", "worker.cli", "watch"],
            cwd=ROOT,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    try:
        with session_scope() as session:
            project = create_project(session, f"Folder only {time.monotonic_ns()}")
            update_inbox_settings(
                session,
                project,
                {"inbox_path": str(shared / "support"), "auto_train": "changes"},
            )
            project.auto_quiet_s = 2  # seconds, for the test (the page offers minutes)
            project_id = project.id
        folder = shared / "support"
        folder.mkdir(parents=True)
        fx.make_txt(folder / "facts.txt", FACTS * 5)
        fx.make_qa_csv(
            folder / "faq.csv",
            [
                ("How long is the warranty?", "36 months"),
                ("Who answers urgent tickets?", "Dana Whitfield"),
            ],
        )

        def done_jobs() -> list[Job]:
            with session_scope() as session:
                return list(
                    session.scalars(
                        select(Job).where(
                            Job.project_id == project_id,
                            Job.state.in_([JobState.done, JobState.failed]),
                        )
                    )
                )

        [job] = wait_for(done_jobs, 300, "the automatic job to finish", watcher)
        assert job.state == JobState.done and job.auto, job.error
        assert {s["name"] for s in job.sources} == {"facts.txt", "faq.csv"}
        with session_scope() as session:
            assert len(session.get(Project, project_id).jobs) == 1  # exactly one job
        from app.main import create_app

        with local_client(create_app()) as client:
            page = client.get(f"/projects/{project_id}").text
        row = page.split(f"Training job #{job.id}</a>")[1].split("</tr>")[0]
        assert "Model v1" in row and "current" in row and "Recall" in row
        assert "started by the watched folder" in row
    finally:
        watcher.send_signal(signal.SIGTERM)
        watcher.wait(timeout=15)
    assert watcher.returncode == 0, log.read_text(errors="replace")[-3000:]
