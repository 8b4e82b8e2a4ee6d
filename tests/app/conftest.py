"""Web app test setup: a real SQLite file with the migrations applied, in a temporary data
dir, and a real Redis as the Celery broker (db 15 of the test session's private Redis).

Self-contained on purpose: `app.settings.settings` is a module-level singleton that may
have been created before this file runs, so instead of environment variables the fixture
points the live settings object, the database engine and the Celery client at the test
locations, and puts them back afterwards."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from fastapi.testclient import TestClient

from tests.app.web import local_client

REDIS_DB = 15


@dataclass
class AppEnv:
    data_dir: Path
    redis_url: str

    @property
    def redis(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def queue_length(self, queue: str) -> int:
        """Messages waiting in a Celery queue (kombu's Redis transport: a list named after it)."""
        return int(self.redis.llen(queue))

    def stored_files(self) -> list[Path]:
        """Every file under the data dir's documents folder (partial uploads included)."""
        from app.settings import settings

        root = settings.documents_dir
        return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def _reset_engine() -> None:
    import app.db

    if app.db._engine is not None:
        app.db._engine.dispose()
    app.db._engine = None  # the next session binds app.db.SessionFactory to a new engine


def _point_celery_at(url: str) -> None:
    from kombu import pools

    from app.queue import celery_client

    celery_client.conf.broker_url = url
    # kombu keeps its connection and producer pools in registries keyed by the broker's
    # address: a pool closed but left registered is handed out again to the next client of
    # that address ("Acquire on closed pool", when the app tests' package fixture is set up a
    # second time in one run). reset() closes every pool and empties the registries.
    pools.reset()
    celery_client._pool = None
    celery_client.amqp._producer_pool = None


@pytest.fixture(scope="package")  # put back before the other packages' tests run
def app_env(tmp_path_factory, redis_url) -> Iterator[AppEnv]:
    from app.migrate import upgrade_to_head
    from app.queue import celery_client
    from app.settings import settings

    # The session's private Redis (tests/conftest.py), on a database of its own: the Celery
    # worker process of the end-to-end tests listens on db 0 and must not see these tasks.
    redis_url = redis_url.rsplit("/", 1)[0] + f"/{REDIS_DB}"

    saved = {
        "data_dir": settings.data_dir,
        "redis_url": settings.redis_url,
        "database_url": settings.database_url,
        "broker": celery_client.conf.broker_url,
    }
    data_dir = tmp_path_factory.mktemp("doctune-app-data")
    settings.data_dir = data_dir
    settings.redis_url = redis_url
    settings.database_url = None  # always the SQLite file in the temporary data dir
    _reset_engine()
    _point_celery_at(redis_url)
    upgrade_to_head()
    try:
        yield AppEnv(data_dir=data_dir, redis_url=redis_url)
    finally:
        _reset_engine()
        settings.data_dir = saved["data_dir"]
        settings.redis_url = saved["redis_url"]
        settings.database_url = saved["database_url"]
        _point_celery_at(saved["broker"])


@pytest.fixture
def env(app_env: AppEnv) -> Iterator[AppEnv]:
    """A clean slate per test: no rows, no stored files, empty queues, default limits."""
    from sqlalchemy import delete

    from app.accounts.models import User
    from app.audit import AuditEvent
    from app.db import session_scope
    from app.models import AllowedFolder, Document, Job, Project, Worker
    from app.settings import settings

    limits = (settings.max_upload_mb, settings.max_files_per_upload)
    door = (settings.allowed_hosts, settings.max_request_mb, settings.min_free_disk_mb)
    app_env.redis.flushdb()
    yield app_env
    settings.max_upload_mb, settings.max_files_per_upload = limits
    settings.allowed_hosts, settings.max_request_mb, settings.min_free_disk_mb = door
    with session_scope() as session:
        session.execute(delete(Job))
        session.execute(delete(Document))
        session.execute(delete(Project))
        session.execute(delete(User))  # their sessions, tokens and links go with them
        session.execute(delete(AuditEvent))
        session.execute(delete(AllowedFolder))
        session.execute(delete(Worker))
    for sub in ("documents", "jobs"):
        shutil.rmtree(app_env.data_dir / sub, ignore_errors=True)
    app_env.redis.flushdb()


@pytest.fixture
def client(env: AppEnv) -> Iterator[TestClient]:
    from app.main import create_app

    with local_client(create_app()) as test_client:  # the app's own address as Host and Origin
        yield test_client
