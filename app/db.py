"""Database engine, the declarative Base and the session dependency."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated

from fastapi import Depends, Path
from sqlalchemy import MetaData, create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from app.settings import settings

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        eng = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(eng, "connect")
        def _sqlite_pragmas(dbapi_conn, _record):  # several processes share the file
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return eng
    return create_engine(url, pool_pre_ping=True)


# The app's own sessions all come from here. Session events the app relies on (tasks sent
# after the commit in app/queue.py, uploaded files removed on a rollback in
# app/services/documents.py) listen on this factory, so a session made any other way (a
# library's, a test's, an Alembic migration's) is left alone. Bound to the engine on first use.
SessionFactory: sessionmaker[Session] = sessionmaker(expire_on_commit=False)

_engine: Engine | None = None


def get_engine() -> Engine:
    global _engine
    if _engine is None:
        if settings.sqlalchemy_url.startswith("sqlite"):
            settings.data_dir.mkdir(parents=True, exist_ok=True)
        _engine = make_engine(settings.sqlalchemy_url)
        SessionFactory.configure(bind=_engine)
    return _engine


def session_factory() -> sessionmaker[Session]:
    """SessionFactory, bound to the engine of the current settings."""
    get_engine()
    return SessionFactory


@contextmanager
def session_scope() -> Iterator[Session]:
    """A unit of work outside a request (tasks, CLI): commit on success, else roll back."""
    session = session_factory()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def get_session() -> Iterator[Session]:
    with session_scope() as session:
        yield session


# scope="function": commit (or roll back) before the response is sent, so a redirect never
# reaches a row that is not committed yet and a failed commit is reported, not swallowed.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]

# A row id from an address. Past what an id column holds the database driver raises instead of
# finding nothing (SQLite: OverflowError; PostgreSQL's integer: out of range), so such an id is
# refused before it gets there: a path that names no row is a 404 (app.main).
MAX_ROW_ID = 2**31 - 1
RowId = Annotated[int, Path(ge=1, le=MAX_ROW_ID)]
