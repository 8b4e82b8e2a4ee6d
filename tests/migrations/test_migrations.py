"""The Alembic migrations build the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
import uuid

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from app.db import Base, make_engine
from app.migrate import alembic_config

PG_ADMIN_URL = os.environ.get(
    "TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _upgrade(connection) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, "head")


def _downgrade(connection) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.downgrade(cfg, "base")


def _assert_matches_models(engine) -> None:
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
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
