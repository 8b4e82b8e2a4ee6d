"""HTML pages. Each route parses the request, calls a service, and renders a page or,
for htmx, only the blocks the page asked for (see templating.render)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Form, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, RedirectResponse, Response
from sqlalchemy.orm import object_session
from starlette.requests import ClientDisconnect

from app.audit import Action, listed, record_request
from app.contract.results import export_errors
from app.contract.training import FIELDS
from app.db import RowId, SessionDep
from app.filetypes import ACCEPT_ATTRIBUTE, SUPPORTED_LABEL
from app.models import Job, JobState, Project
from app.services import compare as compare_service
from app.services import documents as documents_service
from app.services import inbox as inbox_service
from app.services import jobs as jobs_service
from app.services import planner
from app.services import projects as projects_service
from app.services import score_card as score_card_service
from app.services import telemetry as telemetry_service
from app.services.errors import InvalidInput
from app.services.uploads import UploadRejected, check_content_length, receive_files
from app.settings import settings

from .templating import hx_target, is_htmx, render

router = APIRouter()


# Projects


@router.get("/", name="index")
def index(request: Request, session: SessionDep) -> Response:
    projects = projects_service.list_projects(session)
    return render(request, "index.html", {"projects": projects, "errors": {}, "name": ""})


@router.post("/projects", name="create_project")
def create_project(
    request: Request, session: SessionDep, name: Annotated[str, Form()] = ""
) -> Response:
    try:
        project = projects_service.create_project(session, name)
    except InvalidInput as exc:
        context = {
            "projects": projects_service.list_projects(session),
            "errors": exc.errors,
            "name": name,
        }
        return render(request, "index.html", context, status_code=422)
    record_request(request, session, Action.project_created, _named(project))
    return RedirectResponse(f"/projects/{project.id}", status_code=303)


def _named(project: Project) -> str:
    return f"project “{project.name}”"


def _project_context(project: Project, **extra: Any) -> dict[str, Any]:
    session = object_session(project)
    corpus = projects_service.corpus_of(project)
    rows = documents_service.document_rows(project, include_retired=True)
    defaults = jobs_service.shown_defaults(project, corpus, "lora")
    fields = {}
    fmt = jobs_service.format_number
    for f in FIELDS:
        fields[f.name] = {
            "label": f.label,
            "hint": f"{f.hint} ({fmt(f.low)} to {fmt(f.high)}).",
            "placeholder": f"{fmt(defaults[f.name])} (default)",
        }
    jobs = jobs_service.job_rows(project)
    profile = planner.load_profile()  # None until the training worker has measured the machine
    counting = planner.ask_for_plan(project, corpus)  # the steps of this corpus, counted
    context: dict[str, Any] = {
        "project": project,
        "corpus": corpus,
        "docs": [row for row in rows if row.retired_at is None],
        "removed_docs": [row for row in rows if row.retired_at is not None],
        "inbox": inbox_service.inbox_view(session, project, settings.inbox_dir),
        "inbox_errors": {},
        "inbox_values": {},
        "docs_stamp": documents_service.docs_stamp(session, project.id),
        "reason": jobs_service.readiness(corpus),
        "defaults": defaults,
        # (only its step is shown, which no dataset changes: no second plan lookup)
        "defaults_full": jobs_service.defaults_for(corpus, "full"),
        "plan": planner.estimates_for(corpus, profile, load=False,
                                      history=planner.history(session), project=project),
        "plan_pending": profile is None or counting,  # the panel asks again shortly
        "profile_pending": profile is None,
        "plan_counting": counting,
        "fields": fields,
        "train_errors": {},
        "train_values": {},
        # The version a new job continues ("v3"); the Train form offers the base model instead.
        "continue_version": jobs_service.continuable_version(project),
        "jobs": jobs,
        "n_active_jobs": sum(1 for row in jobs if row.active),
        "outcomes": [],
        "upload_error": None,
        "supported_label": SUPPORTED_LABEL,
        "accept": ACCEPT_ATTRIBUTE,
        "max_upload_mb": settings.max_upload_mb,
        "max_files": settings.max_files_per_upload,
        "oob_documents": False,
        "oob_train": False,
    }
    context.update(extra)
    return context


@router.get("/projects/{project_id}", name="project")
def project_page(request: Request, project_id: RowId, session: SessionDep) -> Response:
    project = projects_service.get_project(session, project_id)
    target = hx_target(request)
    since = request.query_params.get("since")
    # The list's own poll (files come and go in the watched folder): nothing new, no body.
    if target == "documents" and since == documents_service.docs_stamp(session, project.id):
        return Response(status_code=204)
    context = _project_context(project)
    blocks = None
    if target == "inbox-status":
        blocks = ["inbox_status"]
    elif target == "documents":
        blocks = ["documents"]
        if not context["corpus"].n_pending:  # the last poll: the Train button may now be usable
            blocks.append("train")
            context["oob_train"] = True
    elif target == "jobs":
        blocks = ["jobs"]
    elif target == "train-plan":  # polled until the machine's speed is measured
        blocks = ["plan"]
    return render(request, "project.html", context, blocks=blocks)


@router.post("/projects/{project_id}/documents", name="upload")
async def upload(request: Request, project_id: RowId, session: SessionDep) -> Response:
    """Files from the drop zone or the file picker: each one accepted, a duplicate, or refused."""
    project = await run_in_threadpool(projects_service.get_project, session, project_id)
    try:
        check_content_length(
            request.headers.get("content-length"),
            max_file_bytes=settings.max_upload_bytes,
            max_files=settings.max_files_per_upload,
        )
        received = await receive_files(
            request.stream(),
            request.headers.get("content-type"),
            dest_dir=settings.documents_dir,
            max_file_bytes=settings.max_upload_bytes,
            max_files=settings.max_files_per_upload,
        )
    except ClientDisconnect:
        return Response(status_code=400)  # the browser went away; receive_files cleaned up
    except UploadRejected as exc:
        context = await run_in_threadpool(_project_context, project, upload_error=exc.message)
        return render(
            request, "project.html", context, blocks=["upload_results"], status_code=exc.status_code
        )
    if not received:
        context = await run_in_threadpool(
            _project_context,
            project,
            upload_error="No files were chosen. Please pick at least one.",
        )
        return render(request, "project.html", context, blocks=["upload_results"], status_code=422)
    outcomes = await run_in_threadpool(
        documents_service.register_uploads, session, project, received
    )
    if kept := [o.name for o in outcomes if o.fate == "accepted"]:
        await run_in_threadpool(record_request, request, session, Action.uploaded,
                                _named(project), listed(kept))
    context = await run_in_threadpool(
        _project_context, project, outcomes=outcomes, oob_documents=True, oob_train=True
    )
    return render(request, "project.html", context, blocks=["upload_results", "documents", "train"])


@router.post("/projects/{project_id}/inbox", name="inbox_settings")
def inbox_settings(
    request: Request,
    project_id: RowId,
    session: SessionDep,
    inbox_path: Annotated[str, Form()] = "",
    auto_train: Annotated[str, Form()] = "off",
    auto_quiet_min: Annotated[str, Form()] = "10",
    auto_nightly_at: Annotated[str, Form()] = "02:00",
    start_from: Annotated[str, Form()] = "latest",
) -> Response:
    """The watched folder's settings: which folder, auto-train, where new jobs start."""
    project = projects_service.get_project(session, project_id)
    values = {
        "inbox_path": inbox_path,
        "auto_train": auto_train,
        "auto_quiet_min": auto_quiet_min,
        "auto_nightly_at": auto_nightly_at,
        "start_from": start_from,
    }
    try:
        inbox_service.update_inbox_settings(session, project, values)
    except InvalidInput as exc:
        context = _project_context(project, inbox_errors=exc.errors, inbox_values=values)
        return render(request, "project.html", context, status_code=422)
    shown = {**values, "inbox_path": project.inbox_path or "(the project's own folder)"}
    record_request(request, session, Action.folder_settings, _named(project),
                   ", ".join(f"{k}: {v}" for k, v in shown.items()))
    return RedirectResponse(f"/projects/{project.id}#inbox", status_code=303)


@router.post("/projects/{project_id}/jobs", name="start_training")
def start_training(
    request: Request,
    project_id: RowId,
    session: SessionDep,
    method: Annotated[str, Form()] = "lora",
    epochs: Annotated[str, Form()] = "",
    learning_rate: Annotated[str, Form()] = "",
    lora_rank: Annotated[str, Form()] = "",
    max_seq_len: Annotated[str, Form()] = "",
    from_base: Annotated[str, Form()] = "",
) -> Response:
    """The Train form. `from_base` is its "start from the base model" checkbox: unticked
    (absent from the form) means continue the current version, whatever the project's default."""
    project = projects_service.get_project(session, project_id)
    values = {
        "method": method,
        "epochs": epochs,
        "learning_rate": learning_rate,
        "lora_rank": lora_rank,
        "max_seq_len": max_seq_len,
        "from_base": from_base,
    }
    try:
        job = jobs_service.create_job(session, project, values)
    except InvalidInput as exc:
        context = _project_context(project, train_errors=exc.errors, train_values=values)
        return render(request, "project.html", context, status_code=422)
    record_request(request, session, Action.training_started, _named(project),
                   f"job {job.id}, {job.method}")
    return RedirectResponse(f"/jobs/{job.id}", status_code=303)


@router.get("/projects/{project_id}/compare", name="compare")
def compare_versions(
    request: Request, project_id: RowId, session: SessionDep, a: str = "", b: str = ""
) -> Response:
    """Two finished versions of the project's model, side by side on the same probes."""
    project = projects_service.get_project(session, project_id)
    comparison = compare_service.compare_in_project(session, project, a, b)
    return render(request, "compare.html", {"project": project, "cmp": comparison})


# Jobs


def _job_context(job: Job) -> dict[str, Any]:
    finished = JobState(job.state).finished
    percent = 0
    if job.total_steps:
        percent = min(100, round(100 * job.step / job.total_steps))
    artifacts = job.artifacts or {}
    return {
        "job": job,
        "label": jobs_service.job_state_label(job),
        "finished": finished,
        "percent": percent,
        "chart": jobs_service.loss_chart(job.loss_history, job.total_steps),
        "disk": telemetry_service.describe(job.telemetry),
        "card": score_card_service.job_score_card(job),
        "downloads": [
            (kind, label)
            for kind, label in jobs_service.ARTIFACT_LABELS.items()
            if artifacts.get(kind)
        ],
        "download_hints": jobs_service.ARTIFACT_HINTS,
        "phases": jobs_service.phase_times(job),
        "time_left": (planner.time_left(job, planner.history(object_session(job)))
                      if not finished else None),
        "export_errors": sorted(export_errors(job.export_errors).items()),
        "sources": [
            documents_service.display_name(str(s.get("name", ""))) for s in job.sources or []
        ],
    }


@router.get("/jobs/{job_id}", name="job")
def job_page(request: Request, job_id: RowId, session: SessionDep) -> Response:
    job = jobs_service.get_job(session, job_id)
    blocks = ["live"] if hx_target(request) == "job-live" else None
    return render(request, "job.html", _job_context(job), blocks=blocks)


@router.post("/jobs/{job_id}/cancel", name="cancel_job")
def cancel_job(request: Request, job_id: RowId, session: SessionDep) -> Response:
    job = jobs_service.get_job(session, job_id)
    jobs_service.request_cancel(session, job)
    record_request(request, session, Action.job_cancelled, f"job {job.id}",
                   _named(job.project))
    if is_htmx(request):
        return render(request, "job.html", _job_context(job), blocks=["live"])
    return RedirectResponse(f"/jobs/{job.id}", status_code=303)


@router.post("/jobs/{job_id}/current", name="make_current")
def make_current(request: Request, job_id: RowId, session: SessionDep) -> Response:
    """Use this tuned version: the next training (manual or automatic) continues from it."""
    job = jobs_service.get_job(session, job_id)
    jobs_service.set_current_version(session, job)
    record_request(request, session, Action.version_chosen, f"job {job.id}",
                   _named(job.project))
    return RedirectResponse(f"/projects/{job.project_id}#jobs", status_code=303)


@router.get("/jobs/{job_id}/download/{kind}", name="download")
def download(request: Request, job_id: RowId, kind: str, session: SessionDep) -> FileResponse:
    """The zip streamed from disk in chunks (FileResponse), with a readable file name."""
    job = jobs_service.get_job(session, job_id)
    path = jobs_service.artifact_file(job, kind)
    record_request(request, session, Action.downloaded, f"job {job.id}",
                   f"{jobs_service.ARTIFACT_LABELS.get(kind, kind)}, {_named(job.project)}")
    return FileResponse(
        path, media_type="application/zip", filename=jobs_service.download_filename(job, kind)
    )
