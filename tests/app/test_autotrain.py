"""Auto-train decisions, one look at a time (the watcher makes these looks every second; its
real-time debounce is tested with the watcher process in test_watcher.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import select

from app.db import session_scope, utcnow
from app.models import AutoTrain, DocStatus, Job, JobState, Project
from app.services.autotrain import auto_train_step, last_nightly_moment
from app.services.errors import InvalidInput
from app.services.inbox import parse_inbox_form

from .factories import make_document, make_job, make_project


def _project(session, mode=AutoTrain.changes, quiet_s=60, **fields) -> Project:
    project = make_project(session, f"Auto {mode} {utcnow().timestamp()}")
    project.auto_train, project.auto_quiet_s = mode, quiet_s
    for key, value in fields.items():
        setattr(project, key, value)
    session.flush()
    return project


def _jobs(session, project: Project) -> list[Job]:
    return list(session.scalars(select(Job).where(Job.project_id == project.id).order_by(Job.id)))


def _done(session, project, docs, **fields) -> Job:
    sources = [{"id": d.id, "name": d.original_name, "sha256": d.sha256} for d in docs]
    return make_job(session, project, JobState.done, sources=sources, **fields)


def test_after_changes_waits_for_the_quiet_period_then_queues_one_job(env):
    now = utcnow()
    with session_scope() as session:
        project = _project(session, last_change_at=now - timedelta(seconds=30))
        make_document(session, project, "a.txt")
        assert auto_train_step(session, project, now).action == "waiting for quiet"
        later = now + timedelta(seconds=31)
        step = auto_train_step(session, project, later)
        assert step.action == "queued"
        assert auto_train_step(session, project, later).action == "a job is waiting"
        [job] = _jobs(session, project)
        assert job.auto and job.state == JobState.queued and job.parent_job_id is None
    assert env.queue_length("train") == 1


def test_a_queued_auto_job_absorbs_later_changes(env):
    now = utcnow()
    with session_scope() as session:
        project = _project(session, quiet_s=0)
        a = make_document(session, project, "a.txt")
        job = session.get(Job, auto_train_step(session, project, now).job_id)
        b = make_document(session, project, "b.txt")
        step = auto_train_step(session, project, now)
        assert (step.action, step.job_id) == ("absorbed", job.id)
        assert [s["id"] for s in job.sources] == [a.id, b.id]
        job.state = JobState.running  # claimed by a worker: it keeps what it read
        make_document(session, project, "c.txt")
        assert auto_train_step(session, project, now).action == "a job is running"
        assert len(_jobs(session, project)) == 1


def test_nothing_changed_since_the_last_successful_job_queues_nothing(env):
    now = utcnow()
    with session_scope() as session:
        project = _project(session, quiet_s=0)
        docs = [make_document(session, project, f"{n}.txt") for n in "ab"]
        done = _done(session, project, docs)
        assert auto_train_step(session, project, now).action == "up to date"
        new = make_document(session, project, "c.txt")
        step = auto_train_step(session, project, now)
        assert step.action == "queued"
        job = session.get(Job, step.job_id)
        assert job.parent_job_id == done.id  # incremental: starts from the current version
        assert {s["id"]: s["new"] for s in job.sources} == {
            docs[0].id: False,
            docs[1].id: False,
            new.id: True,
        }


def test_deleted_documents_alone_retrain_only_from_the_base_model(env):
    now = utcnow()
    with session_scope() as session:
        project = _project(session, quiet_s=0)
        docs = [make_document(session, project, f"{n}.txt") for n in "ab"]
        _done(session, project, docs)
        docs[1].retired_at, docs[1].retired_reason = now, "deleted"
        assert auto_train_step(session, project, now).action == "up to date"
        project.start_from = "base"
        step = auto_train_step(session, project, now)
        assert step.action == "queued"
        assert session.get(Job, step.job_id).parent_job_id is None


def test_it_waits_for_documents_being_read_and_for_running_jobs(env):
    now = utcnow()
    with session_scope() as session:
        project = _project(session, quiet_s=0)
        make_document(session, project, "a.txt", DocStatus.pending)
        assert auto_train_step(session, project, now).action == "documents not ready"
        make_job(session, project, JobState.running)  # a manual job
        assert auto_train_step(session, project, now).action == "a job is running"


def test_a_failed_auto_job_is_not_repeated_on_the_same_documents(env):
    now = utcnow()
    with session_scope() as session:
        project = _project(session, quiet_s=0)
        doc = make_document(session, project, "a.txt")
        job = session.get(Job, auto_train_step(session, project, now).job_id)
        job.state = JobState.failed
        assert auto_train_step(session, project, now).action.startswith("last auto job failed")
        make_document(session, project, "b.txt")
        assert auto_train_step(session, project, now).action == "queued"
        assert doc.id in {s["id"] for s in _jobs(session, project)[-1].sources}


def test_nightly_runs_once_a_day_at_the_set_time(env):
    now = utcnow()
    moment = last_nightly_moment("03:30", now)
    assert moment <= now < moment + timedelta(days=1)
    with session_scope() as session:
        project = _project(
            session,
            AutoTrain.nightly,
            auto_nightly_at="03:30",
            auto_fired_at=moment - timedelta(minutes=1),
            last_change_at=now,
        )  # no quiet period at night: the time decides
        make_document(session, project, "a.txt")
        assert auto_train_step(session, project, now).action == "queued"
        assert project.auto_fired_at == now
        project.jobs[0].state = JobState.done
        make_document(session, project, "b.txt")
        assert auto_train_step(session, project, now).action == "waiting for the night"
        tomorrow = moment + timedelta(days=1, seconds=1)
        assert auto_train_step(session, project, tomorrow).action == "queued"


def test_off_does_nothing(env):
    with session_scope() as session:
        project = _project(session, AutoTrain.off)
        make_document(session, project, "a.txt")
        assert auto_train_step(session, project, utcnow()).action == "off"
        assert _jobs(session, project) == []


def test_the_settings_form_is_checked():
    good = parse_inbox_form(
        {
            "auto_train": "changes",
            "auto_quiet_min": "2.5",
            "auto_nightly_at": "4:05",
            "start_from": "base",
        }
    )
    assert (good.auto_quiet_s, good.auto_nightly_at, good.inbox_path) == (150, "04:05", None)
    with pytest.raises(InvalidInput) as exc:
        parse_inbox_form(
            {
                "inbox_path": "relative/folder",
                "auto_train": "hourly",
                "auto_quiet_min": "0",
                "auto_nightly_at": "25:00",
                "start_from": "scratch",
            }
        )
    assert set(exc.value.errors) == {
        "inbox_path",
        "auto_train",
        "auto_quiet_min",
        "auto_nightly_at",
        "start_from",
    }
