"""Projects: create, list, look up, and what their documents add up to."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from app.models import DocStatus, Document, Project
from app.services.errors import InvalidInput, NotFound

MAX_NAME_CHARS = 100


def clean_project_name(raw: str) -> str:
    """The name as stored: outer whitespace trimmed, inner runs of whitespace made one space.

    Raises InvalidInput when nothing is left, it is too long, or it holds control characters
    (they would be invisible on the page and make two names look the same)."""
    name = re.sub(r"\s+", " ", raw or "").strip()
    if not name:
        raise InvalidInput(
            "Please give the project a name.", {"name": "Please give the project a name."}
        )
    if any(unicodedata.category(ch) in ("Cc", "Cf") for ch in name):
        msg = "The name contains invisible control characters; please type it again."
        raise InvalidInput(msg, {"name": msg})
    if len(name) > MAX_NAME_CHARS:
        msg = f"The name is {len(name)} characters long; please keep it to {MAX_NAME_CHARS}."
        raise InvalidInput(msg, {"name": msg})
    return name


def create_project(session: Session, raw_name: str) -> Project:
    """A new, empty project. Names are unique, ignoring upper/lower case."""
    name = clean_project_name(raw_name)
    wanted = name.casefold()
    for existing in session.scalars(select(Project.name)):
        if existing.casefold() == wanted:
            msg = f"There is already a project called “{existing}”. Please choose another name."
            raise InvalidInput(msg, {"name": msg})
    project = Project(name=name)
    session.add(project)
    session.flush()
    return project


def list_projects(session: Session) -> list[Project]:
    """All projects, newest first, with their documents and jobs loaded (for the counts)."""
    stmt = (
        select(Project)
        .options(selectinload(Project.documents), selectinload(Project.jobs))
        .order_by(Project.created_at.desc(), Project.id.desc())
    )
    return list(session.scalars(stmt))


def get_project(session: Session, project_id: int) -> Project:
    project = session.get(Project, project_id)
    if project is None:
        raise NotFound(f"There is no project number {project_id}. It may have been deleted.")
    return project


@dataclass
class Corpus:
    """What a project's documents add up to: the numbers behind the Train button."""

    n_documents: int = 0
    n_pending: int = 0
    n_extracted: int = 0
    n_duplicate: int = 0
    n_failed: int = 0
    n_words: int = 0
    n_qa: int = 0
    n_retired: int = 0  # earlier versions and deleted files: kept, not trained on
    usable: list[Document] = field(default_factory=list)


def corpus_of(project: Project) -> Corpus:
    """Counts over the documents in use (retired versions are left out of every count)."""
    corpus = Corpus()
    for doc in project.documents:
        if doc.retired_at is not None:
            corpus.n_retired += 1
            continue
        corpus.n_documents += 1
        if doc.status == DocStatus.pending:
            corpus.n_pending += 1
        elif doc.status == DocStatus.extracted:
            corpus.n_extracted += 1
            corpus.n_words += doc.word_count or 0
            corpus.n_qa += doc.qa_count or 0
            corpus.usable.append(doc)
        elif doc.status == DocStatus.duplicate:
            corpus.n_duplicate += 1
        else:
            corpus.n_failed += 1
    return corpus
