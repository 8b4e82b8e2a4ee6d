"""The Celery tasks the web app sends by name and the worker runs, and their queues."""

from __future__ import annotations

INGEST_QUEUE = "ingest"
TRAIN_QUEUE = "train"
CHAT_QUEUE = "chat"  # one reply at a time, the models kept loaded (worker/chat/)


def node_queue(host: str) -> str:
    """The queue only the train workers of machine `host` consume (on top of TRAIN_QUEUE), so
    that a part of a job can be sent to that machine."""
    return f"node.{host}"


INGEST_TASK = "doctune.ingest_document"  # (document id)
TRAIN_TASK = "doctune.train_job"  # (job id)
CHAT_TASK = "doctune.chat_reply"  # (chat message id)
CHAT_FORGET_TASK = "doctune.chat_forget"  # (job id or None, the conversation's token ids)
# (project id, the settings the dataset is planned with): app.contract.dataset_plan
PLAN_TASK = "doctune.plan_dataset"

ROUTES = {INGEST_TASK: {"queue": INGEST_QUEUE}, TRAIN_TASK: {"queue": TRAIN_QUEUE},
          CHAT_TASK: {"queue": CHAT_QUEUE}, CHAT_FORGET_TASK: {"queue": CHAT_QUEUE},
          PLAN_TASK: {"queue": INGEST_QUEUE}}
