"""`doctune worker --join`: before a worker on another machine starts, check that it reaches
the main machine's Redis and PostgreSQL, that the database is at this DocTune's newest
migration, and that the data folder it was given is the main machine's (the id in its
INSTANCE_FILE is the database's), at the main machine's path. Each problem is said in words
with what to do about it. Nothing is changed: a joining worker never migrates and never writes
the mark (app/instance.py: the main machine does both)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import redis
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from app.instance import INSTANCE_FILE, database_instance_id, read_mark
from app.migrate import database_revision, head_revision, known_revisions
from app.settings import settings

CONNECT_TIMEOUT_S = 10  # an address that drops packets must not hang the check for minutes

START_MAIN = ("start DocTune on the main machine once (`doctune up`, or `doctune web "
              "--migrate`): it migrates the database and marks its data folder")


def _engine() -> Engine:
    """The main machine's database, one connection at a time (the checks are over at once)."""
    return create_engine(settings.sqlalchemy_url, poolclass=NullPool,
                         connect_args={"connect_timeout": CONNECT_TIMEOUT_S})


def redis_problem() -> str | None:
    if not settings.redis_url:
        return ("No Redis given. Pass the main machine's Redis with --redis "
                "redis://HOST:6379/0 (or set REDIS_URL). The private Redis `doctune up` starts "
                "listens on 127.0.0.1 only: for other machines, run a Redis of your own on the "
                "main machine and set REDIS_URL there too.")
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                      socket_timeout=CONNECT_TIMEOUT_S)
    except ValueError as exc:
        return f"The Redis URL is not one Redis understands ({exc}): redis://HOST:6379/0."
    kwargs = client.connection_pool.connection_kwargs
    where = f"{kwargs.get('host', '?')}:{kwargs.get('port', 6379)}"
    try:
        client.ping()
    except redis.AuthenticationError:
        return (f"Redis at {where} refused the password. Put the main machine's Redis password "
                "in the URL: redis://:PASSWORD@HOST:6379/0.")
    except redis.RedisError as exc:
        return (f"Cannot reach Redis at {where} ({str(exc).rstrip('.')}). Check the address "
                "and port, that the main machine's Redis listens on its network address (its "
                "`bind` setting, not only 127.0.0.1) and that no firewall blocks the port from "
                "this machine.")
    finally:
        client.close()
    return None


def database_problem() -> str | None:
    if not settings.database_url:
        return ("No database given. Pass the main machine's PostgreSQL with --database "
                "postgresql://USER:PASSWORD@HOST/DB (or set DATABASE_URL).")
    try:
        url = make_url(settings.sqlalchemy_url)
    except ArgumentError:
        return "The database URL is not one DocTune understands: postgresql://USER:PW@HOST/DB."
    shown = make_url(settings.database_url).render_as_string(hide_password=True)  # as given
    if url.get_backend_name() != "postgresql":
        return (f"Machines join through the main machine's PostgreSQL; {shown} is not one. A "
                "SQLite file cannot be shared between machines (its locking is unreliable over "
                "network folders): run the main machine on PostgreSQL (DATABASE_URL) and pass "
                "the same URL here.")
    engine = _engine()
    try:
        with engine.connect() as connection:
            current = database_revision(connection)
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0].rstrip(".")
        return (f"Cannot reach the database {shown} ({reason}). Check the address, that "
                "PostgreSQL on the main machine listens on its network address "
                "(listen_addresses) and lets this machine in (pg_hba.conf), and the user and "
                "password.")
    finally:
        engine.dispose()
    head = head_revision()
    if current is None:
        return f"The database {shown} has no DocTune tables yet: {START_MAIN}."
    if current not in known_revisions():
        return (f"The database {shown} was migrated by a newer DocTune (migration {current}; "
                f"this one knows up to {head}): install the main machine's DocTune version here.")
    if current != head:
        return (f"The database {shown} is at migration {current}, this DocTune's newest is "
                f"{head}. A joining worker never migrates: update DocTune on the main machine "
                f"and {START_MAIN}.")
    return None


def data_dir_problem(with_database: bool) -> str | None:
    """What is wrong with the data folder: missing or read-only; and, `with_database`
    (reached and at the newest migration), not the main machine's or not at its path."""
    return _folder_problem(settings.data_dir) or (
        _mark_problem(settings.data_dir) if with_database else None)


def _folder_problem(folder: Path) -> str | None:
    if not folder.is_dir():
        return (f"The data folder {folder} does not exist on this machine. Mount the main "
                "machine's data folder here (shared over NFS or SMB) and pass its path with "
                "--data-dir (or set DOCTUNE_DATA_DIR).")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return (f"This machine cannot write in the data folder {folder} ({exc.strerror}). Mount "
                "it read-write for the user that runs the worker: jobs write their checkpoints "
                "and models there.")
    return None


def _mark_problem(folder: Path) -> str | None:
    mark = read_mark(folder)
    engine = _engine()
    try:
        with Session(engine) as session:
            theirs = database_instance_id(session)
    finally:
        engine.dispose()
    if mark is None:
        return (f"{folder} is not the main machine's data folder: it has no {INSTANCE_FILE} "
                "file, which DocTune writes there on the main machine. Mount the folder the main "
                f"machine uses as DOCTUNE_DATA_DIR, or {START_MAIN}.")
    if mark.instance_id != theirs:
        return (f"{folder} belongs to another DocTune than the database: its {INSTANCE_FILE} "
                f"says {mark.instance_id}, the database {theirs}. Mount the data folder of the "
                "main machine that uses this database.")
    if mark.path != str(folder.absolute()):
        return (f"The main machine's data folder is mounted at {folder} here but is "
                f"{mark.path} there: mount it at {mark.path} on this machine too. A job that "
                "runs on several machines hands them its files by that path.")
    return None


def join_problems() -> list[str]:
    """Everything that stops this machine from joining (empty: it can)."""
    database = database_problem()
    found = [redis_problem(), database, data_dir_problem(with_database=database is None)]
    return [problem for problem in found if problem is not None]
