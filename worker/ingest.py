"""Extract one uploaded document and record the outcome on its row.

The reader runs in a box (worker/extract/sandbox.py: a child process under the memory, CPU
and wall-clock limits of settings.reader_*), so a hostile file fails in words and the worker
lives on. Each document is read once: the attempt is committed on its row before the reader
starts, and a task delivered again for a document already attempted (its worker died
mid-read, so the broker redelivered it) marks it failed instead of reading it again.

The extracted text lives next to the original in the documents folder:
`<stored_name>.txt` (plain text) and `<stored_name>.qa.json` (question-answer pairs)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from sqlalchemy.orm import Session

from app.contract.documents import qa_file, text_file
from app.db import session_scope, utcnow
from app.models import DocStatus, Document
from app.settings import settings
from worker.dataset.corpus import SourceDoc
from worker.extract import ExtractionError
from worker.extract.sandbox import ReaderLimits, extract_boxed
from worker.files import write_text_atomic

log = logging.getLogger(__name__)

INTERNAL_ERROR = (
    "DocTune could not read this file because of an internal error. "
    "Try saving it again (or as PDF) and upload it once more."
)
READ_BEFORE = (
    "DocTune started reading this file before and that reading never finished (the reader "
    "or its worker stopped), so it will not try again. If the file opens on your computer, "
    "save it again (or as PDF) and upload the copy."
)



MAX_NOTES = 20
MAX_NOTE_CHARS = 300


def _notes(warnings: list[str]) -> list[str] | None:
    """The reader's notes as stored: at most MAX_NOTES, each cut to MAX_NOTE_CHARS."""
    notes = [w if len(w) <= MAX_NOTE_CHARS else w[: MAX_NOTE_CHARS - 1] + "…"
             for w in warnings[:MAX_NOTES]]
    if len(warnings) > MAX_NOTES:
        notes.append(f"… and {len(warnings) - MAX_NOTES:,} more notes like these.")
    return notes or None

def reader_limits() -> ReaderLimits:
    """The reader box's limits, from settings."""
    return ReaderLimits(
        memory_bytes=settings.reader_memory_mb * 2**20,
        cpu_s=settings.reader_cpu_s,
        timeout_s=settings.reader_timeout_s,
    )


def text_path(stored_name: str) -> Path:
    return text_file(settings.documents_dir, stored_name)


def qa_path(stored_name: str) -> Path:
    return qa_file(settings.documents_dir, stored_name)


def ingest_document(doc_id: int) -> str | None:
    """Extract document `doc_id` if still pending; returns its new status (None: nothing to do).
    A document some earlier delivery already started reading is marked failed, not read."""
    with session_scope() as session:  # commits the attempt before the reader starts
        doc = session.get(Document, doc_id)
        if doc is None or doc.status != DocStatus.pending:
            return None
        if doc.read_attempts:
            log.warning("document %s was already being read (since %s); marked failed",
                        doc_id, doc.read_started_at)
            doc.status, doc.error, doc.extracted_at = DocStatus.failed, READ_BEFORE, utcnow()
            return DocStatus.failed
        doc.read_attempts += 1
        doc.read_started_at = utcnow()
        stored_name, kind = doc.stored_name, doc.kind

    status, error, fields = DocStatus.extracted, None, {}
    try:
        result = extract_boxed(settings.documents_dir / stored_name, kind, reader_limits())
        write_text_atomic(text_path(stored_name), result.text)
        write_text_atomic(qa_path(stored_name), json.dumps(result.qa_pairs, ensure_ascii=False))
        fields = {
            "word_count": result.word_count,
            "qa_count": len(result.qa_pairs),
            "preview": result.preview(),
            "read_notes": _notes(result.warnings),
        }
    except ExtractionError as exc:
        status, error = DocStatus.failed, str(exc)
    except Exception:  # a library bug must not take the worker down or leave "pending"
        log.exception("extraction of document %s failed", doc_id)
        status, error = DocStatus.failed, INTERNAL_ERROR

    with session_scope() as session:
        doc = session.get(Document, doc_id)
        if doc is None:  # deleted meanwhile
            return None
        doc.status, doc.error, doc.extracted_at = status, error, utcnow()
        for key, value in fields.items():
            setattr(doc, key, value)
    return status


def load_source_docs(session: Session, doc_ids: list[int]) -> list[SourceDoc]:
    """The extracted documents `doc_ids` as training input (missing or failed ones skipped)."""
    docs: list[SourceDoc] = []
    for doc_id in doc_ids:
        doc = session.get(Document, doc_id)
        if doc is None or doc.status != DocStatus.extracted:
            continue
        try:
            text = text_path(doc.stored_name).read_text(encoding="utf-8")
            pairs = json.loads(qa_path(doc.stored_name).read_text(encoding="utf-8"))
        except OSError:
            log.warning("extracted text of document %s is missing; skipped", doc_id)
            continue
        docs.append(
            SourceDoc(doc.original_name, doc.sha256, text, [tuple(p) for p in pairs], doc.version)
        )
    return docs
