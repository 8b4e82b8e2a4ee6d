"""Comparing two versions of a project's model on the probes they share."""

from __future__ import annotations

import copy

from app.db import session_scope
from app.models import Job, JobState, Project
from app.services.compare import compare_jobs

from .factories import make_job, make_project
from .test_score_card import full_scores


def _drop_probes(scores: dict, keep: int) -> dict:
    scores = copy.deepcopy(scores)
    for side in ("before", "after"):
        q = scores[side]["questions"]
        q["items"] = q["items"][:keep]
        q["n"] = keep
        q["n_recalled"] = sum(i["hit"] for i in q["items"])
    return scores


def _jobs(scores_a, scores_b, sources_b=None) -> tuple[int, int, int]:
    with session_scope() as session:
        project = make_project(session, "Versions")
        a = make_job(session, project, JobState.done, scores=scores_a)
        extra = {"sources": sources_b} if sources_b else {}
        b = make_job(session, project, JobState.done, scores=scores_b, **extra)
        return project.id, a.id, b.id


def test_same_probes_compare_everything(client):
    project_id, a, b = _jobs(full_scores(after_hits=3), full_scores(after_hits=8))
    with session_scope() as session:
        cmp = compare_jobs(session.get(Job, a), session.get(Job, b))
        assert cmp.same_probes and cmp.n_common == 10 and cmp.kind == "questions"
        recall = cmp.metrics[0]
        assert (recall.base, recall.a, recall.b) == (
            "0 of 10 (0%)",
            "3 of 10 (30%)",
            "8 of 10 (80%)",
        )
        assert recall.better == "b"
        # Disagreements first: facts 3..7 are right in B only.
        assert [f.b_hit and not f.a_hit for f in cmp.facts[:5]] == [True] * 5
        assert all(f.a_hit == f.b_hit for f in cmp.facts[5:])

    page = client.get(f"/projects/{project_id}/compare", params={"a": a, "b": b})
    assert page.status_code == 200
    assert "Both jobs were scored on the same 10 questions: a fair comparison." in page.text
    assert "<strong>8 of 10 (80%)</strong>" in page.text
    assert "Fact by fact (10)" in page.text


def test_different_documents_are_compared_on_shared_probes_and_said_so(client):
    sources_b = [{"id": 9, "name": "new-price-list.xlsx", "sha256": "9" * 64}]
    project_id, a, b = _jobs(full_scores(), _drop_probes(full_scores(), 6), sources_b)
    page = client.get(f"/projects/{project_id}/compare", params={"a": a, "b": b}).text
    assert "scored on different probes" in page
    assert f"only job #{b} used new-price-list.xlsx" in page
    assert f"only the 6 they share (job #{a} had 10, job #{b} had 6)" in page
    assert "measured on different held-out text" in page


def test_bad_choices_are_refused_in_words(client):
    project_id, a, _ = _jobs(full_scores(), full_scores())
    r = client.get(f"/projects/{project_id}/compare", params={"a": a, "b": a})
    assert r.status_code == 422 and "two different training jobs" in r.text
    with session_scope() as session:
        other = make_project(session, "Other project")
        running = make_job(session, other, JobState.running)
        foreign = make_job(session, other, JobState.done, scores=full_scores())
        running_id, foreign_id, other_id = running.id, foreign.id, other.id
    r = client.get(f"/projects/{project_id}/compare", params={"a": a, "b": foreign_id})
    assert r.status_code == 404 and "not part of this project" in r.text
    r = client.get(f"/projects/{other_id}/compare", params={"a": foreign_id, "b": running_id})
    assert r.status_code == 422 and "has not finished" in r.text
    r = client.get(f"/projects/{project_id}/compare", params={"a": "x", "b": ""})
    assert r.status_code == 422


def test_project_page_offers_the_comparison_once_two_versions_exist(client):
    with session_scope() as session:
        project = make_project(session, "One version")
        make_job(session, project, JobState.done, scores=full_scores())
        project_id = project.id
    assert "Compare two versions" not in client.get(f"/projects/{project_id}").text
    with session_scope() as session:
        make_job(session, session.get(Project, project_id), JobState.done, scores=full_scores())
    page = client.get(f"/projects/{project_id}").text
    assert "Compare two versions" in page
    assert f'action="/projects/{project_id}/compare"' in page
