"""A small read-only JSON API (scripts, the watcher, tests) and the health check."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.db import RowId, SessionDep
from app.models import Job, Project
from app.services import documents as documents_service
from app.services import jobs as jobs_service
from app.services import projects as projects_service

router = APIRouter()


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() + "Z" if value else None


def _project_summary(project: Project) -> dict[str, Any]:
    corpus = projects_service.corpus_of(project)
    return {
        "id": project.id,
        "name": project.name,
        "created_at": _iso(project.created_at),
        "n_documents": corpus.n_documents,
        "n_extracted": corpus.n_extracted,
        "n_pending": corpus.n_pending,
        "n_words": corpus.n_words,
        "n_qa": corpus.n_qa,
        "n_jobs": len(project.jobs),
    }


def _job_json(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "project_id": job.project_id,
        "state": job.state,
        "cancel_requested": job.cancel_requested,
        "method": job.method,
        "params": job.params,
        "phase": job.phase,
        "step": job.step,
        "total_steps": job.total_steps,
        "loss_history": job.loss_history,
        "tokens_per_s": job.tokens_per_s,
        "eta_s": job.eta_s,
        "telemetry": job.telemetry,  # the offload engine's memory and disk figures, or null
        "scores": job.scores,  # app.contract.scores
        "dataset": job.dataset,  # app.contract.results: the training set's counts and notes
        "metrics": job.metrics,  # the training run's figures
        "export_errors": job.export_errors or {},  # kind -> why that download is missing
        "artifacts": sorted(k for k, v in (job.artifacts or {}).items() if v),
        "error": job.error,
        "created_at": _iso(job.created_at),
        "started_at": _iso(job.started_at),
        "finished_at": _iso(job.finished_at),
    }


@router.get("/api/projects")
def api_projects(session: SessionDep) -> list[dict[str, Any]]:
    return [_project_summary(p) for p in projects_service.list_projects(session)]


@router.get("/api/projects/{project_id}")
def api_project(project_id: RowId, session: SessionDep) -> dict[str, Any]:
    project = projects_service.get_project(session, project_id)
    out = _project_summary(project)
    out["training_blocked_by"] = jobs_service.readiness(projects_service.corpus_of(project))
    out["documents"] = [
        {
            "id": row.id,
            "name": row.name,
            "original_name": row.original_name,
            "kind": row.kind,
            "size_bytes": row.size_bytes,
            "status": row.status,
            "word_count": row.word_count,
            "qa_count": row.qa_count,
            "error": row.error,
            "duplicate_of": row.duplicate_of,
            "source_path": row.source_path,  # in the watched folder (None: uploaded)
            "version": row.version,
            "last_seen_at": _iso(row.last_seen),
            "trained_in": row.trained_in,  # model versions, e.g. ["v1", "v2"]
        }
        for row in documents_service.document_rows(project)
    ]
    out["jobs"] = [
        {"id": row.job.id, "state": row.job.state, "summary": row.summary}
        for row in jobs_service.job_rows(project)
    ]
    return out


@router.get("/api/jobs/{job_id}")
def api_job(job_id: RowId, session: SessionDep) -> dict[str, Any]:
    return _job_json(jobs_service.get_job(session, job_id))


@router.get("/healthz")
def healthz(session: SessionDep) -> JSONResponse:
    """200 when the app can reach its database; 503 (with the reason) when it cannot."""
    try:
        session.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001  (any failure means "not healthy")
        return JSONResponse({"status": "error", "database": str(exc)[:200]}, status_code=503)
    return JSONResponse({"status": "ok"})
