"""Documents: turning received files into rows (pending, duplicate) and showing them."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Literal

from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, SessionTransaction

from app.contract.tasks import INGEST_TASK
from app.db import SessionFactory, utcnow
from app.models import DocStatus, Document, Job, JobState, Project
from app.queue import enqueue_after_commit
from app.services.uploads import ReceivedFile, display_name, human_size

# Files written for this unit of work; deleted again if it rolls back (see the listeners below).
_NEW_FILES = "doctune_new_files"

Fate = Literal["accepted", "duplicate", "refused"]


@dataclass
class UploadOutcome:
    """What became of one uploaded file, for the page and the API."""

    name: str
    fate: Fate
    message: str
    document_id: int | None = None


def register_uploads(
    session: Session, project: Project, received: list[ReceivedFile]
) -> list[UploadOutcome]:
    """Rows for the received files of one upload, in order.

    A file whose content (sha256) matches a pending or extracted document of the project
    becomes a "duplicate" row and its copy is deleted; every other received file becomes a
    "pending" row and its text extraction is queued for after the commit. Refused files get
    no row; their reason is passed through."""
    originals: dict[str, Document] = {
        doc.sha256: doc for doc in reversed(project.documents) if _is_original(doc)
    }
    for item in received:
        if item.path is not None:
            _track_new_file(session, item.path)
    outcomes: list[UploadOutcome] = []
    rows: list[tuple[UploadOutcome, Document]] = []
    for item in received:
        if item.refused or item.path is None or item.kind is None:
            outcomes.append(UploadOutcome(item.name, "refused", item.refused or "Not received."))
            continue
        doc = Document(
            project=project,
            # As given, except NUL, which PostgreSQL cannot store in text.
            original_name=item.original_name.replace("\x00", "\ufffd"),
            stored_name=item.path.name,
            kind=item.kind,
            size_bytes=item.size,
            sha256=item.sha256,
        )
        earlier = originals.get(item.sha256)
        if earlier is not None:
            item.path.unlink(missing_ok=True)  # the earlier copy is the one we keep
            doc.status = DocStatus.duplicate
            outcome = UploadOutcome(
                item.name,
                "duplicate",
                f"Already uploaded as “{display_name(earlier.original_name)}”; "
                "not added again.",
            )
        else:
            doc.status = DocStatus.pending
            originals[item.sha256] = doc
            outcome = UploadOutcome(
                item.name, "accepted", f"Added ({human_size(item.size)}); reading it now."
            )
        session.add(doc)
        outcomes.append(outcome)
        rows.append((outcome, doc))
    if rows:
        # One flush for the lot: each flush walks the project's whole document list, so a
        # flush per file made a folder of thousands of files quadratic.
        session.flush()
    for outcome, doc in rows:
        outcome.document_id = doc.id
        if outcome.fate == "accepted":
            enqueue_after_commit(session, INGEST_TASK, doc.id)
            project.last_change_at = utcnow()  # auto-train's quiet period starts again
    return outcomes


def _is_original(doc: Document) -> bool:
    """A copy that is (or will be) used for training; a failed or retired one may be added
    again."""
    return doc.status in (DocStatus.pending, DocStatus.extracted) and doc.retired_at is None


@dataclass
class DocumentRow:
    """One line of the project's document list."""

    id: int
    name: str
    original_name: str
    kind: str
    size: str
    size_bytes: int
    status: str
    word_count: int
    qa_count: int
    preview: str
    error: str | None
    duplicate_of: str | None
    read_notes: list[str] = field(default_factory=list)  # what the reader skipped
    # Watched folder: the file's path in the inbox, this version's number, when the watcher
    # last saw the file, and why this version is no longer used (None: in use).
    source_path: str | None = None
    version: int = 1
    last_seen: datetime | None = None
    created_at: datetime | None = None
    retired_at: datetime | None = None
    retired_reason: str | None = None
    # The tuned model versions ("v1", "v2", ...) whose training used this document.
    trained_in: list[str] = field(default_factory=list)
    # Earlier versions of the same file, newest first.
    history: list[DocumentRow] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """The extracted amount in words an office worker would use."""
        parts = []
        if self.word_count:
            parts.append(f"{self.word_count:,} words")
        if self.qa_count:
            parts.append(
                f"{self.qa_count:,} question-answer pair" + ("s" if self.qa_count != 1 else "")
            )
        return ", ".join(parts) or "no text found"


def docs_stamp(session: Session, project_id: int) -> str:
    """A fingerprint of the project's document list, from one cheap query: the page polls
    with it and gets "nothing new" (204) until a document is added, read, retired or seen,
    or a job finishes as a new model version (the list's "In models" column)."""
    versions = (
        select(func.count(Job.id))
        .where(Job.project_id == project_id, Job.state == JobState.done)
        .scalar_subquery()
    )
    row = session.execute(
        select(
            func.count(Document.id),
            func.max(Document.id),
            func.max(Document.extracted_at),
            func.max(Document.retired_at),
            func.max(Document.last_seen_at),
            func.sum(Document.version),
            versions,
        ).where(Document.project_id == project_id)
    ).one()
    return "-".join(str(v.timestamp() if isinstance(v, datetime) else v or 0) for v in row)


def model_versions(project: Project) -> dict[int, str]:
    """Job id -> "v1", "v2", ...: the project's finished (done) jobs in order, each a tuned
    model version that is kept and downloadable."""
    done = sorted(j.id for j in project.jobs if j.state == JobState.done)
    return {job_id: f"v{n}" for n, job_id in enumerate(done, start=1)}


def document_rows(project: Project, include_retired: bool = False) -> list[DocumentRow]:
    """The documents in use, in the order they came; each carries its file's earlier
    versions in `history`. With `include_retired`, documents whose file was deleted from the
    watched folder are listed too (after the others)."""
    originals: dict[str, Document] = {}
    for doc in project.documents:
        if _is_original(doc):
            originals.setdefault(doc.sha256, doc)
    versions = model_versions(project)
    trained: dict[int, list[str]] = {}
    for job in sorted(project.jobs, key=lambda j: j.id):
        label = versions.get(job.id)
        if label is None:
            continue
        for source in job.sources or []:
            if isinstance(source, dict) and isinstance(source.get("id"), int):
                trained.setdefault(source["id"], []).append(label)
    rows: list[DocumentRow] = []
    by_path: dict[str, DocumentRow] = {}
    retired: list[DocumentRow] = []
    for doc in project.documents:
        duplicate_of = None
        if doc.status == DocStatus.duplicate:
            earlier = originals.get(doc.sha256)
            duplicate_of = display_name(earlier.original_name) if earlier else "an earlier file"
        rows.append(
            DocumentRow(
                id=doc.id,
                name=display_name(doc.original_name),
                original_name=doc.original_name,
                kind=doc.kind,
                size=human_size(doc.size_bytes),
                size_bytes=doc.size_bytes,
                status=doc.status,
                word_count=doc.word_count or 0,
                qa_count=doc.qa_count or 0,
                preview=doc.preview or "",
                error=doc.error,
                duplicate_of=duplicate_of,
                read_notes=[str(n) for n in doc.read_notes or []],
                source_path=doc.source_path,
                version=doc.version or 1,
                last_seen=doc.last_seen_at,
                created_at=doc.created_at,
                retired_at=doc.retired_at,
                retired_reason=doc.retired_reason,
                trained_in=trained.get(doc.id, []),
            )
        )
        row = rows[-1]
        if row.retired_at is not None:
            retired.append(rows.pop())
        elif row.source_path is not None:
            by_path[row.source_path] = row
    deleted: list[DocumentRow] = []
    for row in sorted(retired, key=lambda r: (r.version, r.id), reverse=True):
        head = by_path.get(row.source_path) if row.source_path is not None else None
        if head is not None:
            head.history.append(row)
        else:  # its file is gone: the newest version stands for it, older ones in its history
            deleted.append(row)
            if row.source_path is not None:
                by_path[row.source_path] = row
    if include_retired:
        rows.extend(sorted(deleted, key=lambda r: r.id))
    return rows


def _track_new_file(session: Session, path: Path) -> None:
    session.info.setdefault(_NEW_FILES, []).append(path)


@event.listens_for(SessionFactory, "after_commit")
def _keep_new_files(session: Session) -> None:
    session.info.pop(_NEW_FILES, None)


@event.listens_for(SessionFactory, "after_soft_rollback")
def _delete_new_files(session: Session, previous_transaction: SessionTransaction) -> None:
    """Rows that never reached the database leave no files behind."""
    if previous_transaction.nested or previous_transaction.parent is not None:
        return  # a savepoint: the outer transaction may still commit
    for path in session.info.pop(_NEW_FILES, []):
        Path(path).unlink(missing_ok=True)
