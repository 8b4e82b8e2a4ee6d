"""Celery tasks: thin wrappers that take ids and open their own sessions."""

from __future__ import annotations

from app.contract.tasks import (
    CHAT_FORGET_TASK,
    CHAT_STAGE_TASK,
    CHAT_TASK,
    INGEST_TASK,
    PLAN_TASK,
    TRAIN_RANKS_TASK,
    TRAIN_TASK,
)
from worker.celery_app import celery


@celery.task(name=INGEST_TASK)
def ingest_document(doc_id: int) -> str | None:
    """Read one document in the reader box; a redelivery after a crash marks it failed."""
    from worker.ingest import ingest_document as run

    return run(doc_id)


@celery.task(name=TRAIN_TASK, bind=True)
def train_job(self, job_id: int) -> str | None:
    from worker.jobs.run import run_job

    return run_job(job_id, node=self.request.hostname)


@celery.task(name=TRAIN_RANKS_TASK)
def train_ranks(spec_path: str, endpoint: str, run_id: str, nnodes: int) -> int:
    """This machine's ranks of a job that trains on several machines (sent to its node
    queue by the job's machine); returns torchrun's exit code."""
    from worker.distributed.launch import join_ranks

    return join_ranks(spec_path, endpoint, run_id, nnodes)


@celery.task(name=CHAT_TASK, bind=True)
def chat_reply(self, message_id: int) -> str | None:
    """Answer one chat question with the models this worker keeps loaded (worker/chat/)."""
    from worker.chat.reply import answer

    return answer(message_id, node=self.request.hostname)


@celery.task(name=CHAT_STAGE_TASK, bind=True)
def chat_stage(self, endpoint: str, head: str) -> int:
    """The second stage of the chat worker `head`'s model, on this machine, until the chat
    closes it or leaves it idle (worker/chat/tail.py); returns the stage's exit code."""
    from worker.chat.tail import lend_stage

    return lend_stage(endpoint, head, self.request.hostname)


@celery.task(name=CHAT_FORGET_TASK)
def chat_forget(job_id: int | None, token_ids: list[int]) -> int:
    """Delete a deleted conversation's SSD cache."""
    from worker.chat.reply import forget

    return forget(job_id, token_ids)


@celery.task(name=PLAN_TASK)
def plan_dataset(project_id: int, params: dict) -> str | None:
    """Count the training work of a project's documents for the Train panel's estimate."""
    from worker.jobs.dataset_plan import plan_project

    return plan_project(project_id, params)
