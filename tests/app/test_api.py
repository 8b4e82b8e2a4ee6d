"""The small JSON API and the health check."""

from __future__ import annotations

from app.db import session_scope
from app.models import DocStatus, JobState

from .factories import make_document, make_job, make_project, sample_scores


def test_projects_list_and_detail(client):
    assert client.get("/api/projects").json() == []
    with session_scope() as session:
        project = make_project(session, "Support FAQ")
        make_document(session, project, "manual.pdf", word_count=1000)
        make_document(session, project, "faq.csv", word_count=0, qa_count=12)
        make_document(session, project, "scan.pdf", DocStatus.failed, error="No text in this PDF.")
        make_document(session, project, "manual copy.pdf", DocStatus.duplicate, content=b"x")
        job = make_job(session, project, JobState.done)
        project_id, job_id = project.id, job.id

    [summary] = client.get("/api/projects").json()
    assert summary["id"] == project_id and summary["name"] == "Support FAQ"
    assert (
        summary["n_documents"],
        summary["n_extracted"],
        summary["n_words"],
        summary["n_qa"],
    ) == (4, 2, 1000, 12)
    assert summary["n_jobs"] == 1

    detail = client.get(f"/api/projects/{project_id}").json()
    assert [d["status"] for d in detail["documents"]] == [
        "extracted",
        "extracted",
        "failed",
        "duplicate",
    ]
    assert detail["documents"][2]["error"] == "No text in this PDF."
    assert detail["documents"][0]["word_count"] == 1000 and detail["documents"][1]["qa_count"] == 12
    assert detail["training_blocked_by"] is None
    assert detail["jobs"] == [{"id": job_id, "state": "done", "summary": "Recall 10% → 60%"}]


def test_job_json(client, env):
    with session_scope() as session:
        project = make_project(session)
        job = make_job(
            session,
            project,
            JobState.done,
            artifacts={
                "adapter": str(env.data_dir / "a.zip"),
                "merged": str(env.data_dir / "m.zip"),
            },
            dataset={"n_train_examples": 12, "notes": ["10 recall probes."]},
            metrics={"train_seconds": 2.5, "steps": 120},
            export_errors={"gguf-f16": "The GGUF file (f16) could not be made: no space."},
        )
        job_id = job.id
    data = client.get(f"/api/jobs/{job_id}").json()
    assert data["state"] == "done"
    assert (data["step"], data["total_steps"]) == (120, 120)
    assert data["loss_history"][0] == [0, 3.0]
    assert data["scores"] == sample_scores()
    # The other results have keys of their own (Job.dataset, Job.metrics, Job.export_errors).
    assert data["dataset"]["notes"] == ["10 recall probes."]
    assert data["metrics"] == {"train_seconds": 2.5, "steps": 120}
    assert data["export_errors"] == {"gguf-f16": "The GGUF file (f16) could not be made: no space."}
    assert data["artifacts"] == ["adapter", "merged"]  # kinds only, never server paths
    assert "a.zip" not in str(data)


def test_unknown_ids_are_json_404s(client):
    for url in ("/api/projects/77", "/api/jobs/77"):
        r = client.get(url)
        assert r.status_code == 404
        assert r.headers["content-type"] == "application/json"
        assert "There is no" in r.json()["detail"]


def test_healthz(client):
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok"}
