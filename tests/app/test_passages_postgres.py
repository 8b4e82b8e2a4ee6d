"""The documents' passages found by PostgreSQL's full-text search (app/chat/passages.py's
other dialect; the chat tests run on SQLite's FTS5): a fresh database with the migrations
applied, the same office texts, the same hostile queries."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.chat import passages
from app.chat.models import Passage
from app.db import utcnow
from app.models import DocStatus, Document, Project
from tests.migrations.test_migrations import _upgrade, postgres_engine  # noqa: F401

TEXTS = {
    "handbook.txt": "Annual leave is 25 days a year. The office opens at 8:00.",
    "logistics.txt": "Orders over 500 units are signed off by Dana Ruiz, Head of Logistics.",
    "kettle.txt": "The Model K7 kettle draws 2200 watts and holds 1.7 litres.",
}


def test_postgres_search_ranks_the_passage_that_answers(postgres_engine):  # noqa: F811
    with postgres_engine.begin() as conn:
        _upgrade(conn)
    with Session(postgres_engine) as session:
        project = Project(name="Office")
        session.add(project)
        session.flush()
        ids = {}
        for i, (name, body) in enumerate(TEXTS.items()):
            doc = Document(project=project, original_name=name, stored_name=f"s{i}.txt",
                           kind="txt", size_bytes=len(body), sha256=f"{i:064d}",
                           status=DocStatus.extracted)
            session.add(doc)
            session.flush()
            session.add(Passage(project_id=project.id, document_id=doc.id, ord=0, text=body))
            ids[name] = doc.id
        session.flush()
        [first, *_] = passages.search(session, project, "How much does the kettle hold?")
        assert first.document_id == ids["kettle.txt"]
        [first, *_] = passages.search(session, project, "who signs off big orders")
        assert first.document_id == ids["logistics.txt"]  # "signs" finds "signed": stemming
        for hostile in ("kettle' OR 1=1 --", "kettle & !", "(((", "a:*", "watts)|"):
            found = passages.search(session, project, hostile)
            assert all(f.document_id in ids.values() for f in found), hostile
        assert passages.search(session, project, "?!") == []
        session.get(Document, ids["kettle.txt"]).retired_at = utcnow()
        session.flush()
        found = passages.search(session, project, "kettle watts litres")
        assert ids["kettle.txt"] not in {f.document_id for f in found}
