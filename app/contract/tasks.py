"""The Celery tasks the web app sends by name and the worker runs, and their queues."""

from __future__ import annotations

INGEST_QUEUE = "ingest"
TRAIN_QUEUE = "train"

INGEST_TASK = "doctune.ingest_document"  # (document id)
TRAIN_TASK = "doctune.train_job"  # (job id)

ROUTES = {INGEST_TASK: {"queue": INGEST_QUEUE}, TRAIN_TASK: {"queue": TRAIN_QUEUE}}
