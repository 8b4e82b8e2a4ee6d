"""The Alembic migrations build the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import uuid
from datetime import datetime

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

import app.tables  # noqa: F401  (every table on Base.metadata)
from app.db import Base, make_engine
from app.migrate import alembic_config

PG_ADMIN_URL = os.environ.get(
    "TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _upgrade(connection, revision: str = "head") -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, revision)


def _downgrade(connection, revision: str = "base") -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.downgrade(cfg, revision)


def _not_a_model_table(name, type_, _parent_names) -> bool:
    """The passages' full-text index (SQLite: an FTS5 virtual table and its shadow tables;
    PostgreSQL: an expression index) is made by migration 0008 on purpose and has no
    model; everything else must match the models."""
    return not (name or "").startswith(("passages_fts", "ix_passages_fts"))


def _assert_matches_models(engine) -> None:
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"include_name": _not_a_model_table})
        diff = compare_metadata(context, Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    assert {"projects", "documents", "jobs"} <= set(inspect(engine).get_table_names())


def test_sqlite_upgrade_matches_models_and_downgrades(tmp_path):
    engine = make_engine(f"sqlite:///{tmp_path / 'm.db'}")
    with engine.begin() as conn:
        _upgrade(conn)
    _assert_matches_models(engine)
    with engine.begin() as conn:
        _downgrade(conn)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}


@pytest.fixture
def postgres_engine():
    try:
        admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        admin.connect().close()
    except Exception as exc:
        if os.environ.get("DOCTUNE_REQUIRE_POSTGRES"):
            raise
        pytest.skip(f"no PostgreSQL at {PG_ADMIN_URL}: {exc}")
    name = f"doctune_test_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    engine = make_engine(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}")
    yield engine
    engine.dispose()
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE "{name}" WITH (FORCE)'))
    admin.dispose()


def test_postgres_upgrade_matches_models_and_downgrades(postgres_engine):
    with postgres_engine.begin() as conn:
        _upgrade(conn)
    _assert_matches_models(postgres_engine)
    with postgres_engine.begin() as conn:
        _downgrade(conn)
    assert set(inspect(postgres_engine).get_table_names()) <= {"alembic_version"}


# A done job as the worker wrote it before 0004: dataset stats, training figures and export
# errors inside `scores`, next to the scores themselves.
_SIDE = {"perplexity": 12.5, "n_probes": 2, "n_recalled": 1, "probes": []}
_OLD_SCORES = {
    "before": _SIDE | {"n_recalled": 0},
    "after": _SIDE,
    "dataset": {"n_train_examples": 9, "notes": ["2 recall probes from 1 document(s)."]},
    "metrics": {"train_seconds": 3.5, "tokens_per_s": 800.0, "final_loss": 1.25, "steps": 4,
                "tokens": 2048},
    "export_errors": {"gguf-q8_0": "The GGUF file (q8_0) could not be made: the disk is full."},
}
_JOB_0003 = sa.table(
    "jobs",
    *(sa.column(name) for name in (
        "id", "project_id", "state", "method", "step", "total_steps", "phase",
        "cancel_requested", "attempts", "auto", "created_at",
    )),
    *(sa.column(name, sa.JSON()) for name in (
        "params", "sources", "loss_history", "scores", "artifacts",
    )),
)  # fmt: skip


def _scores_move_out_and_back(engine) -> None:
    with engine.begin() as conn:
        _upgrade(conn, "0003")
        conn.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"),
                     {"t": datetime(2026, 1, 1)})
        row = {"project_id": 1, "state": "done", "method": "lora", "step": 4, "total_steps": 4,
               "phase": "Done", "cancel_requested": False, "attempts": 1, "auto": False,
               "created_at": datetime(2026, 1, 1), "params": {}, "sources": [],
               "loss_history": [], "artifacts": {}}
        conn.execute(sa.insert(_JOB_0003), [
            row | {"id": 1, "scores": _OLD_SCORES},
            row | {"id": 2, "scores": None, "state": "failed"},  # no scores: left alone
        ])
    with engine.begin() as conn:
        _upgrade(conn)
    jobs = sa.Table("jobs", sa.MetaData(), autoload_with=engine)
    with engine.connect() as conn:
        by_id = {r["id"]: r for r in conn.execute(sa.select(jobs)).mappings()}
    moved = by_id[1]
    assert moved["scores"] == {"before": _OLD_SCORES["before"], "after": _OLD_SCORES["after"]}
    for name in ("dataset", "metrics", "export_errors"):
        assert moved[name] == _OLD_SCORES[name], name
    assert by_id[2]["scores"] is None and by_id[2]["dataset"] is None

    with engine.begin() as conn:
        _downgrade(conn, "0003")
    assert {"dataset", "metrics", "export_errors"}.isdisjoint(
        c["name"] for c in inspect(engine).get_columns("jobs")
    )
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(_JOB_0003.c.id, _JOB_0003.c.scores).order_by(_JOB_0003.c.id)
        ).all()
    assert rows == [(1, _OLD_SCORES), (2, None)]


def test_sqlite_moves_results_out_of_scores_and_back(tmp_path):
    _scores_move_out_and_back(make_engine(f"sqlite:///{tmp_path / 'm.db'}"))


def test_postgres_moves_results_out_of_scores_and_back(postgres_engine):
    _scores_move_out_and_back(postgres_engine)


# 0005: a document row from before the reader box counts as never attempted.
def _read_attempts_added_and_removed(engine) -> None:
    with engine.begin() as conn:
        _upgrade(conn, "0004")
        conn.execute(text("INSERT INTO projects (id, name, created_at) VALUES (1, 'p', :t)"),
                     {"t": datetime(2026, 1, 1)})
        conn.execute(text(
            "INSERT INTO documents (id, project_id, original_name, stored_name, kind, size_bytes,"
            " sha256, status, word_count, qa_count, preview, created_at, version) VALUES (7, 1,"
            " 'a.txt', 'x.txt', 'txt', 3, 'abc', 'pending', 0, 0, '', :t, 1)"
        ), {"t": datetime(2026, 1, 1)})  # fmt: skip
    with engine.begin() as conn:
        _upgrade(conn, "0005")
    with engine.connect() as conn:
        row = conn.execute(text(
            "SELECT read_attempts, read_started_at, status FROM documents WHERE id = 7"
        )).one()  # fmt: skip
    assert tuple(row) == (0, None, "pending")
    with engine.begin() as conn:
        _downgrade(conn, "0004")
    names = {c["name"] for c in inspect(engine).get_columns("documents")}
    assert {"read_attempts", "read_started_at"}.isdisjoint(names) and "status" in names


def test_sqlite_documents_get_read_attempts(tmp_path):
    _read_attempts_added_and_removed(make_engine(f"sqlite:///{tmp_path / 'm.db'}"))


def test_postgres_documents_get_read_attempts(postgres_engine):
    _read_attempts_added_and_removed(postgres_engine)
