"""run_job's outcome in words: a message written for the user is shown as it is; anything
else is "something went wrong", with the details in the log and the job's error.log."""

from __future__ import annotations

import errno
import time

import pytest

from app.contract.tasks import INGEST_TASK
from app.db import session_scope
from app.models import Job, JobState, Project
from app.queue import INLINE
from app.services.documents import register_uploads
from app.services.projects import create_project
from app.services.uploads import receive_local_file
from app.settings import settings
from offload import OffloadBudgetError, OffloadDiskFullError
from tests.fixtures import docs as fx
from worker.ingest import ingest_document
from worker.jobs import run
from worker.jobs.run import INTERNAL_ERROR, job_workdir, run_job


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (OSError(errno.ENOSPC, "No space left on device: '/data/secret/x.bin'"), "disk is full"),
        (OffloadDiskFullError("/data/swap/7/block0.bin", 1 << 20), "disk is full"),
        (MemoryError(), "ran out of memory"),
        (OffloadBudgetError("the budget cannot hold one block"), "needs more memory"),
    ],
)
def test_what_ran_out_is_said_in_words(exc, words):
    message = run._plain_error(exc)
    assert words in message and "secret" not in message and "/data/" not in message


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("tensor 'model.layers.0.q_proj' has shape [64, 64] but secret expected"),
        KeyError("secret"),
        RuntimeError("CUDA error: an illegal memory access (secret)"),
    ],
)
def test_any_other_error_is_something_that_went_wrong_never_its_text(exc):
    assert run._plain_error(exc) == INTERNAL_ERROR
    assert "went wrong" in INTERNAL_ERROR and "train again" in INTERNAL_ERROR


def _project_with_a_document(tmp_path) -> tuple[int, list[dict]]:
    tasks: list = []
    fx.make_txt(tmp_path / "facts.txt", ["The Northwind warranty lasts 36 months."] * 8)
    with session_scope() as session:
        project = create_project(session, f"Errors {time.monotonic_ns()}")
        session.info[INLINE] = tasks
        received = receive_local_file(
            tmp_path / "facts.txt",
            dest_dir=settings.documents_dir,
            max_file_bytes=settings.max_upload_bytes,
        )
        register_uploads(session, project, [received])
        project_id = project.id
    for task, args in tasks:
        assert task == INGEST_TASK
        ingest_document(*args)
    with session_scope() as session:
        project = session.get(Project, project_id)
        sources = [
            {"id": d.id, "name": d.original_name, "sha256": d.sha256} for d in project.documents
        ]
    return project_id, sources


def _queued_job(project_id: int, sources: list[dict], params: dict) -> int:
    with session_scope() as session:
        job = Job(
            project=session.get(Project, project_id),
            state=JobState.queued,
            method="lora",
            sources=sources,
            params=params,
        )
        session.add(job)
        session.flush()
        return job.id


def test_a_job_with_no_usable_document_fails_with_the_words_for_the_user(migrated_db, tmp_path):
    project_id, _ = _project_with_a_document(tmp_path)
    job_id = _queued_job(project_id, [], {"method": "lora"})
    assert run_job(job_id, node="test-errors") == JobState.failed
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job.error.startswith("None of this job's documents has usable text any more.")
    assert not (job_workdir(job_id) / "error.log").exists()  # nothing went wrong inside


def test_an_internal_error_is_logged_and_the_user_reads_something_went_wrong(
    migrated_db, tmp_path, caplog
):
    project_id, sources = _project_with_a_document(tmp_path)
    # A setting of the wrong type (the web app never sends one): the comparison with its
    # bounds fails inside the worker, a TypeError the user has no words for.
    job_id = _queued_job(project_id, sources, {"method": "lora", "epochs": "many"})
    assert run_job(job_id, node="test-errors") == JobState.failed
    with session_scope() as session:
        error = session.get(Job, job_id).error
    assert error == INTERNAL_ERROR
    assert "not supported" not in error and "'str'" not in error  # not the exception's text
    trace = (job_workdir(job_id) / "error.log").read_text(encoding="utf-8")
    assert "TypeError" in trace and "'<=' not supported" in trace
    assert any("job %s failed" in r.msg and r.exc_info for r in caplog.records)


def test_the_settings_a_job_sets_from_its_dataset_reach_its_row(migrated_db, tmp_path):
    """The job page shows the passes and step a job trains with from the moment it sets them
    (app.contract.training.settle), not the guess it was queued with."""
    from app.contract.training import default_params

    project_id, sources = _project_with_a_document(tmp_path)
    queued = default_params(1_000, 0, "lora")  # guessed from the words: 3 passes
    job_id = _queued_job(project_id, sources, queued)
    run._RowHooks(job_id).on_settings({"epochs": 2, "learning_rate": 0.002})
    with session_scope() as session:
        params = session.get(Job, job_id).params
    assert params == queued | {"epochs": 2, "learning_rate": 0.002}
    assert queued["epochs"] == 3
