"""Documents: turning received files into rows (pending, duplicate) and showing them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sqlalchemy import event
from sqlalchemy.orm import Session, SessionTransaction

from app.models import DocStatus, Document, Project
from app.queue import INGEST_TASK, enqueue_after_commit
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
            session.add(doc)
            session.flush()
            outcomes.append(
                UploadOutcome(
                    item.name,
                    "duplicate",
                    f"Already uploaded as “{display_name(earlier.original_name)}”; "
                    "not added again.",
                    doc.id,
                )
            )
            continue
        doc.status = DocStatus.pending
        session.add(doc)
        session.flush()
        enqueue_after_commit(session, INGEST_TASK, doc.id)
        originals[item.sha256] = doc
        outcomes.append(
            UploadOutcome(
                item.name, "accepted", f"Added ({human_size(item.size)}); reading it now.", doc.id
            )
        )
    return outcomes


def _is_original(doc: Document) -> bool:
    """A copy that is (or will be) used for training; a failed one may be uploaded again."""
    return doc.status in (DocStatus.pending, DocStatus.extracted)


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


def document_rows(project: Project) -> list[DocumentRow]:
    originals: dict[str, Document] = {}
    for doc in project.documents:
        if _is_original(doc):
            originals.setdefault(doc.sha256, doc)
    rows = []
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
            )
        )
    return rows


def _track_new_file(session: Session, path: Path) -> None:
    session.info.setdefault(_NEW_FILES, []).append(path)


@event.listens_for(Session, "after_commit")
def _keep_new_files(session: Session) -> None:
    session.info.pop(_NEW_FILES, None)


@event.listens_for(Session, "after_soft_rollback")
def _delete_new_files(session: Session, previous_transaction: SessionTransaction) -> None:
    """Rows that never reached the database leave no files behind."""
    if previous_transaction.nested or previous_transaction.parent is not None:
        return  # a savepoint: the outer transaction may still commit
    for path in session.info.pop(_NEW_FILES, []):
        Path(path).unlink(missing_ok=True)
