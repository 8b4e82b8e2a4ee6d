"""What a dead worker left behind, put right on the next worker's start (worker/reconcile.py),
against the migrated test database."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from app.db import session_scope, utcnow
from app.models import DocStatus, Document
from app.services.projects import create_project
from worker.ingest import READ_BEFORE
from worker.reconcile import ABANDONED_READ_MARGIN, fail_abandoned_reads


def _document(project_id: int, **fields) -> int:
    with session_scope() as s:
        doc = Document(project_id=project_id, original_name="notes.txt",
                       stored_name=f"{uuid.uuid4().hex}.txt", kind="txt", size_bytes=10,
                       sha256=uuid.uuid4().hex, status=DocStatus.pending, **fields)
        s.add(doc)
        s.flush()
        return doc.id


def test_a_read_abandoned_by_a_dead_worker_is_failed_in_words_and_no_other(migrated_db):
    with session_scope() as s:
        project_id = create_project(s, f"reconcile {time.monotonic_ns()}").id
    timeout = timedelta(seconds=120)
    long_ago = utcnow() - timeout - ABANDONED_READ_MARGIN - timedelta(minutes=1)
    abandoned = _document(project_id, read_attempts=1, read_started_at=long_ago)
    # Still within the reader's wall clock (plus margin): another worker may be reading it.
    reading = _document(project_id, read_attempts=1, read_started_at=utcnow())
    queued = _document(project_id)  # never started: its task is still on the queue

    failed = fail_abandoned_reads(timeout_s=timeout.total_seconds())

    assert abandoned in failed and reading not in failed and queued not in failed
    with session_scope() as s:
        rows = {i: s.get(Document, i) for i in (abandoned, reading, queued)}
        assert rows[abandoned].status == DocStatus.failed
        assert rows[abandoned].error == READ_BEFORE
        assert rows[reading].status == rows[queued].status == DocStatus.pending
    assert abandoned not in fail_abandoned_reads(timeout_s=timeout.total_seconds())
