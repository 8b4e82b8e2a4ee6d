"""Apply the Alembic migrations (the only way the schema changes), and say where a database
stands against them (a joining worker checks, and never migrates)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

from app.instance import claim_data_dir

ROOT = Path(__file__).resolve().parent.parent


def alembic_config() -> Config:
    cfg = Config(str(ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(ROOT / "migrations"))
    return cfg


def upgrade_to_head() -> None:
    """Migrate, then mark the data folder as this database's (app/instance.py): whoever
    migrates is the main machine."""
    command.upgrade(alembic_config(), "head")
    claim_data_dir()


def database_revision(connection: Connection) -> str | None:
    """The migration the database at `connection` is at; None: it has no DocTune tables."""
    return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    """The newest migration this DocTune has."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def known_revisions() -> set[str]:
    scripts = ScriptDirectory.from_config(alembic_config())
    return {script.revision for script in scripts.walk_revisions()}
