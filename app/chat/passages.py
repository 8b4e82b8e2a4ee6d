""""Use my documents": the project's extracted text cut into passages, found for a question
by the database's own full-text search (SQLite FTS5 with BM25 ranking, or PostgreSQL's
ts_rank), and put before the question with the names of the documents they come from.

Passages are made the first time a project's documents are searched, and for each new
document after that (from the reader's text files beside the originals); a retired version
of a file is not searched. The question's words are matched with OR (any of them), each as a
quoted term, so nothing a user types is read as search syntax."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.chat.models import Passage
from app.contract.documents import qa_file, text_file
from app.models import DocStatus, Document, Project
from app.services.uploads import display_name
from app.settings import settings

PASSAGE_WORDS = 120  # about a paragraph
TOP_K = 4
_WORD = re.compile(r"[^\W_]+", re.UNICODE)


def split_passages(body: str, words: int = PASSAGE_WORDS) -> list[str]:
    """Paragraphs, merged up to about `words` words; a longer paragraph is cut at sentence
    ends (or, lacking those, every `words` words)."""
    out: list[str] = []
    current: list[str] = []
    count = 0
    for para in re.split(r"\n\s*\n", body):
        para = " ".join(para.split())
        if not para:
            continue
        pieces = re.split(r"(?<=[.!?])\s+", para) if len(para.split()) > words else [para]
        for piece in pieces:
            n = len(piece.split())
            if current and count + n > words:
                out.append(" ".join(current))
                current, count = [], 0
            while n > words:  # one very long sentence
                split = piece.split()
                out.append(" ".join(split[:words]))
                piece, n = " ".join(split[words:]), n - words
            current.append(piece)
            count += n
    if current:
        out.append(" ".join(current))
    return out


def document_text(doc: Document) -> str:
    """The document's extracted text ("" when the reader left none)."""
    path = text_file(settings.documents_dir, doc.stored_name)
    return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""


def passages_of(body: str, pairs: list) -> list[str]:
    """A document's passages: its text cut by split_passages, then each question-answer
    pair (from a Q&A file) as one passage of its own."""
    found = split_passages(body)
    return found + [f"Q: {q}\nA: {a}" for q, a in pairs if isinstance(q, str) and isinstance(a, str)]


def _document_passages(doc: Document) -> list[str]:
    qa = qa_file(settings.documents_dir, doc.stored_name)
    pairs = []
    if qa.is_file():
        try:
            pairs = json.loads(qa.read_text(encoding="utf-8"))
        except ValueError:
            pass
    return passages_of(document_text(doc), pairs if isinstance(pairs, list) else [])


def index_project(session: Session, project: Project) -> int:
    """Make the passages of the project's read documents that have none yet; how many."""
    have = set(session.scalars(select(Passage.document_id).where(
        Passage.project_id == project.id).distinct()))
    made = 0
    for doc in project.documents:
        if doc.status != DocStatus.extracted or doc.retired_at is not None or doc.id in have:
            continue
        for i, body in enumerate(_document_passages(doc)):
            session.add(Passage(project_id=project.id, document_id=doc.id, ord=i, text=body))
            made += 1
    session.flush()
    return made


def _terms(question: str) -> list[str]:
    return list(dict.fromkeys(w.lower() for w in _WORD.findall(question)))[:64]


def fts5_query(question: str) -> str:
    """The question as an SQLite FTS5 MATCH expression: its words ORed, each a quoted term
    ("" when it has none)."""
    return " OR ".join('"' + t.replace('"', '""') + '"' for t in _terms(question))


@dataclass(frozen=True)
class Found:
    passage_id: int
    document_id: int
    name: str
    text: str


def search(session: Session, project: Project, question: str, k: int = TOP_K) -> list[Found]:
    """The `k` passages of the project's documents in use that best match `question`."""
    index_project(session, project)
    terms = _terms(question)
    if not terms:
        return []
    if session.get_bind().dialect.name == "sqlite":
        query = fts5_query(question)
        rows = session.execute(text(
            "SELECT p.id FROM passages_fts JOIN passages p ON p.id = passages_fts.rowid "
            "JOIN documents d ON d.id = p.document_id "
            "WHERE passages_fts MATCH :q AND p.project_id = :pid AND d.retired_at IS NULL "
            "ORDER BY bm25(passages_fts) LIMIT :k"), {"q": query, "pid": project.id, "k": k})
    else:
        query = " | ".join(re.sub(r"[^\w]", "", t) for t in terms if re.sub(r"[^\w]", "", t))
        rows = session.execute(text(
            "SELECT p.id FROM passages p JOIN documents d ON d.id = p.document_id, "
            "to_tsquery('english', :q) q "
            "WHERE p.project_id = :pid AND d.retired_at IS NULL "
            "AND to_tsvector('english', p.text) @@ q "
            "ORDER BY ts_rank(to_tsvector('english', p.text), q) DESC, p.id LIMIT :k"),
            {"q": query, "pid": project.id, "k": k})
    ids = [row[0] for row in rows]
    passages = {p.id: p for p in session.scalars(select(Passage).where(Passage.id.in_(ids)))}
    docs = {d.id: d for d in project.documents}
    return [Found(i, passages[i].document_id, display_name(docs[passages[i].document_id]
                                                           .original_name), passages[i].text)
            for i in ids if i in passages and passages[i].document_id in docs]


def prompt_with(question: str, found: list[Found]) -> str:
    """The question as the model reads it, the passages before it."""
    if not found:
        return question
    blocks = "\n\n".join(f"[{n}] From “{f.name}”:\n{f.text}" for n, f in enumerate(found, 1))
    return (f"Answer from these passages of our documents. If they do not say, say that you "
            f"do not know.\n\n{blocks}\n\nQuestion: {question}")


def sources(found: list[Found]) -> list[dict]:
    """The documents a reply drew on, each once, in the order found."""
    seen: dict[int, dict] = {}
    for f in found:
        seen.setdefault(f.document_id, {"document_id": f.document_id, "name": f.name})
    return list(seen.values())
