"""Tuned model versions on the project page: every done job is a version (v1, v2...), one is
current, new jobs continue from it, and each document says which versions learned it."""

from __future__ import annotations

import re

from app.db import session_scope
from app.models import Job, JobState
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
