"""Tuned model versions on the project page: every done job is a version (v1, v2...), one is
current, new jobs continue from it, and each document says which versions learned it."""

from __future__ import annotations

import re

from sqlalchemy import select

from app.db import session_scope
from app.models import Job, JobState, Project
from app.queue import INLINE
from app.services import jobs as jobs_service

from .factories import make_document, make_job, make_project, sample_scores


def _done(session, project, docs, **fields) -> Job:
    sources = [{"id": d.id, "name": d.original_name, "sha256": d.sha256} for d in docs]
    return make_job(session, project, JobState.done, sources=sources, **fields)


def test_versions_current_and_what_each_document_was_trained_in(client):
    with session_scope() as session:
        project = make_project(session, "Versions")
        a = make_document(session, project, "a.txt")
        v1 = _done(session, project, [a])
        b = make_document(session, project, "b.txt")
        scores = sample_scores() | {"previous": sample_scores()["after"] | {"n_recalled": 3}}
        v2 = _done(session, project, [a, b], parent_job_id=v1.id, auto=True, scores=scores)
        make_job(session, project, JobState.failed)  # not a version
        project_id, v1_id, v2_id = project.id, v1.id, v2.id

    page = client.get(f"/projects/{project_id}").text
    assert "Model v1" in page and "Model v2" in page and "Model v3" not in page
    row_v2 = page.split(f"Training job #{v2_id}</a>")[1].split("</tr>")[0]
    assert "current" in row_v2 and "continued from v1" in row_v2
    assert "started by the watched folder" in row_v2
    assert "Recall 10% → 60% (previous version 30%)" in row_v2
    models = re.findall(r'<td class="doc-models">([^<]*)</td>', page)
    assert models == ["v1, v2", "v2"]

    r = client.post(f"/jobs/{v1_id}/current", follow_redirects=False)
    assert r.status_code == 303
    row_v1 = (
        client.get(f"/projects/{project_id}")
        .text.split(f"Training job #{v1_id}</a>")[1]
        .split("</tr>")[0]
    )
    assert "current" in row_v1
    with session_scope() as session:
        project = session.get(Job, v1_id).project
        session.info[INLINE] = []  # keep the job's message here
        job = jobs_service.create_job(session, project, {"method": "lora"})
        assert job.parent_job_id == v1_id  # new training continues the current version
        assert {s["name"]: s["new"] for s in job.sources} == {"a.txt": False, "b.txt": True}
        session.rollback()


def test_only_a_done_job_can_be_made_current(client):
    with session_scope() as session:
        project = make_project(session, "Not done")
        job_id = make_job(session, project, JobState.running).id
    r = client.post(f"/jobs/{job_id}/current", follow_redirects=False)
    assert r.status_code == 422 and "Only a finished training job" in r.text


_FROM_BASE = re.compile(r'<input type="checkbox" name="from_base" value="on" ?(checked)?')


def _queued(project_id: int) -> list[Job]:
    with session_scope() as session:
        rows = session.scalars(
            select(Job).where(Job.project_id == project_id, Job.state == JobState.queued)
            .order_by(Job.id)
        )
        return list(rows)


def test_the_train_form_can_start_from_the_base_model_instead_of_the_current_version(client):
    with session_scope() as session:
        project = make_project(session, "Choice")
        a = make_document(session, project, "a.txt")
        v1 = _done(session, project, [a])
        make_document(session, project, "b.txt")
        project_id, v1_id = project.id, v1.id

    page = client.get(f"/projects/{project_id}").text
    assert "Start from the base model instead of v1" in page
    assert _FROM_BASE.search(page).group(1) is None  # the project continues by default

    r = client.post(f"/projects/{project_id}/jobs", data={"from_base": "on"},
                    follow_redirects=False)
    assert r.status_code == 303
    (ticked,) = _queued(project_id)
    assert ticked.parent_job_id is None  # the worker trains a fresh adapter on everything
    assert {s["name"]: s["new"] for s in ticked.sources} == {"a.txt": True, "b.txt": True}

    r = client.post(f"/projects/{project_id}/jobs", data={}, follow_redirects=False)
    assert r.status_code == 303
    unticked = _queued(project_id)[-1]
    assert unticked.parent_job_id == v1_id
    assert {s["name"]: s["new"] for s in unticked.sources} == {"a.txt": False, "b.txt": True}

    r = client.post(f"/projects/{project_id}/jobs", data={"from_base": "maybe"},
                    follow_redirects=False)
    assert r.status_code == 422
    assert "Tick the box to start from the base model, or leave it empty." in r.text
    assert len(_queued(project_id)) == 2


def test_the_project_setting_is_the_default_and_auto_train_follows_it(client):
    with session_scope() as session:
        project = make_project(session, "Base by default")
        a = make_document(session, project, "a.txt")
        v1 = _done(session, project, [a])
        project.start_from = "base"
        project_id, v1_id = project.id, v1.id

    page = client.get(f"/projects/{project_id}").text
    assert _FROM_BASE.search(page).group(1) == "checked"
    with session_scope() as session:  # auto-train passes no choice: the setting decides
        session.info[INLINE] = []
        job = jobs_service.create_job(session, session.get(Project, project_id), {}, auto=True)
        assert job.parent_job_id is None
        session.rollback()

    # The user unticks the box: this one job continues v1 despite the setting.
    r = client.post(f"/projects/{project_id}/jobs", data={}, follow_redirects=False)
    assert r.status_code == 303
    assert [j.parent_job_id for j in _queued(project_id)] == [v1_id]


def test_the_choice_is_offered_only_when_there_is_a_version_to_continue(client):
    with session_scope() as session:
        fresh = make_project(session, "No version yet")
        make_document(session, fresh, "a.txt")
        full = make_project(session, "Full version")
        b = make_document(session, full, "b.txt")
        _done(session, full, [b], method="full")  # a full fine-tune is continued too
        fresh_id, full_id = fresh.id, full.id
    page = client.get(f"/projects/{fresh_id}").text
    assert 'name="from_base"' not in page and "instead of v" not in page
    page = client.get(f"/projects/{full_id}").text
    assert "Start from the base model instead of v1" in page
    assert "with the other method, training starts from the base model" in page


def test_a_full_fine_tune_continues_a_full_version_and_only_a_full_one(client):
    with session_scope() as session:
        project = make_project(session, "Full continues")
        a = make_document(session, project, "a.txt")
        v1 = _done(session, project, [a], method="full")
        make_document(session, project, "b.txt")
        project_id, v1_id = project.id, v1.id

    r = client.post(f"/projects/{project_id}/jobs", data={"method": "full"},
                    follow_redirects=False)
    assert r.status_code == 303
    (continued,) = _queued(project_id)
    assert continued.method == "full" and continued.parent_job_id == v1_id
    assert {s["name"]: s["new"] for s in continued.sources} == {"a.txt": False, "b.txt": True}

    r = client.post(f"/projects/{project_id}/jobs", data={"method": "full", "from_base": "on"},
                    follow_redirects=False)
    assert r.status_code == 303
    ticked = _queued(project_id)[-1]
    assert ticked.method == "full" and ticked.parent_job_id is None
    assert {s["name"]: s["new"] for s in ticked.sources} == {"a.txt": True, "b.txt": True}

    # A LoRA job has no adapter to continue in a full version: it starts from the base model.
    r = client.post(f"/projects/{project_id}/jobs", data={"method": "lora"},
                    follow_redirects=False)
    assert r.status_code == 303
    lora = _queued(project_id)[-1]
    assert lora.method == "lora" and lora.parent_job_id is None


def test_a_full_fine_tune_does_not_continue_a_lora_version(client):
    with session_scope() as session:
        project = make_project(session, "LoRA then full")
        a = make_document(session, project, "a.txt")
        _done(session, project, [a], method="lora")
        project_id = project.id
    r = client.post(f"/projects/{project_id}/jobs", data={"method": "full"},
                    follow_redirects=False)
    assert r.status_code == 303
    (job,) = _queued(project_id)
    assert job.method == "full" and job.parent_job_id is None
    assert [s["new"] for s in job.sources] == [True]


def test_the_document_list_updates_when_a_version_finishes(client):
    """The open page polls its document list with a fingerprint; a job that finishes changes
    the "In models" column, so it must change the fingerprint too."""
    with session_scope() as session:
        project = make_project(session, "Live models")
        a = make_document(session, project, "a.txt")
        job = make_job(session, project, JobState.running,
                       sources=[{"id": a.id, "name": a.original_name, "sha256": a.sha256}])
        project_id, job_id = project.id, job.id

    page = client.get(f"/projects/{project_id}").text
    assert re.findall(r'<td class="doc-models">([^<]*)</td>', page) == ["—"]
    poll = re.search(r'hx-get="([^"]*\?since=[^"]+)" hx-trigger="every 5s"', page).group(1)
    listing = {"HX-Request": "true", "HX-Target": "documents"}
    assert client.get(poll, headers=listing).status_code == 204
    with session_scope() as session:
        session.get(Job, job_id).state = JobState.done
    fresh = client.get(poll, headers=listing)
    assert fresh.status_code == 200
    assert re.findall(r'<td class="doc-models">([^<]*)</td>', fresh.text) == ["v1"]
