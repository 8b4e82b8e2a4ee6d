"""`doctune worker --join` (worker/cli/join.py): a second machine joins with one command. Each
thing that stops it is said in words with what to do, checked against real services: the
session's Redis (and a port where none listens), PostgreSQL databases made for the test, real
folders. Then the whole path: the main machine migrates (and marks its data folder), the
joiner starts a real Celery worker that registers itself, and stops it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.contract.tasks import TRAIN_TASK, node_queue
from app.instance import INSTANCE_FILE, database_instance_id, mark_data_dir
from app.migrate import head_revision
from app.models import Worker
from app.queue import make_celery
from app.settings import settings
from tests.conftest import ROOT, _free_port, wait_for
from tests.migrations.test_migrations import _upgrade, postgres_engine  # noqa: F401  (fixture)
from worker.cli.join import join_problems
from worker.cli.main import main

JOIN_REDIS_DB = 13  # a database of the session's Redis no other test's worker listens on


def _url(engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _problems(monkeypatch, *, redis: str | None, database: str | None, data_dir) -> list[str]:
    """The joiner's checks, with the settings its flags would give."""
    monkeypatch.setattr(settings, "redis_url", redis)
    monkeypatch.setattr(settings, "database_url", database)
    monkeypatch.setattr(settings, "data_dir", data_dir)
    return join_problems()


@pytest.fixture
def main_machine(postgres_engine, tmp_path):  # noqa: F811
    """The main machine's database at the newest migration and its data folder, marked."""
    with postgres_engine.begin() as connection:
        _upgrade(connection)
    with Session(postgres_engine) as session:
        instance_id = database_instance_id(session)
    folder = tmp_path / "shared"
    mark_data_dir(folder, instance_id)
    return _url(postgres_engine), folder


def test_redis_that_cannot_be_reached_is_named_with_what_to_do(monkeypatch, redis_url,
                                                               main_machine):
    database, folder = main_machine
    port = _free_port()  # nothing listens there
    problems = _problems(monkeypatch, redis=f"redis://127.0.0.1:{port}/0", database=database,
                         data_dir=folder)
    assert len(problems) == 1
    assert problems[0].startswith(f"Cannot reach Redis at 127.0.0.1:{port} (")
    assert "listens on its network address" in problems[0]

    wrong = redis_url.replace(redis_url.split("@")[0], "redis://:not-the-password")
    problems = _problems(monkeypatch, redis=wrong, database=database, data_dir=folder)
    port = redis_url.rsplit(":", 1)[1].split("/")[0]
    assert problems == [(f"Redis at 127.0.0.1:{port} refused the password. Put the main "
                         "machine's Redis password in the URL: redis://:PASSWORD@HOST:6379/0.")]
    assert "not-the-password" not in problems[0]

    problems = _problems(monkeypatch, redis=None, database=database, data_dir=folder)
    assert problems[0].startswith("No Redis given. Pass the main machine's Redis with --redis")
    problems = _problems(monkeypatch, redis="http://main.lan:6379", database=database,
                         data_dir=folder)
    assert problems == [("The Redis URL is not one Redis understands (Redis URL must specify "
                         "one of the following schemes (redis://, rediss://, unix://)): "
                         "redis://HOST:6379/0.")]


def test_a_database_that_cannot_be_reached_or_be_shared_is_refused(monkeypatch, redis_url,
                                                                   tmp_path):
    port = _free_port()
    problems = _problems(monkeypatch, redis=redis_url, data_dir=tmp_path,
                         database=f"postgresql://doctune:s3cret@127.0.0.1:{port}/doctune")
    assert len(problems) == 1
    assert problems[0].startswith(
        f"Cannot reach the database postgresql://doctune:***@127.0.0.1:{port}/doctune (")
    assert "Connection refused" in problems[0] and "s3cret" not in problems[0]

    problems = _problems(monkeypatch, redis=redis_url, data_dir=tmp_path,
                         database=f"sqlite:///{tmp_path / 'doctune.db'}")
    assert "Machines join through the main machine's PostgreSQL" in problems[0]
    assert "cannot be shared between machines" in problems[0]

    problems = _problems(monkeypatch, redis=redis_url, data_dir=tmp_path,
                         database="main.lan/doctune")
    assert problems == [("The database URL is not one DocTune understands: "
                         "postgresql://USER:PW@HOST/DB.")]

    problems = _problems(monkeypatch, redis=redis_url, data_dir=tmp_path, database=None)
    assert problems == [("No database given. Pass the main machine's PostgreSQL with --database "
                         "postgresql://USER:PASSWORD@HOST/DB (or set DATABASE_URL).")]


def test_a_database_behind_or_ahead_of_this_doctune_is_never_migrated(
        monkeypatch, redis_url, postgres_engine, tmp_path):  # noqa: F811
    database = _url(postgres_engine)

    def check() -> str:
        (problem,) = _problems(monkeypatch, redis=redis_url, database=database, data_dir=tmp_path)
        return problem

    assert "has no DocTune tables yet: start DocTune on the main machine once" in check()
    with postgres_engine.begin() as connection:
        _upgrade(connection, "0010")
    assert f"is at migration 0010, this DocTune's newest is {head_revision()}" in check()
    assert "A joining worker never migrates" in check()
    with postgres_engine.connect() as connection:  # and it did not
        version = connection.execute(text("SELECT version_num FROM alembic_version")).scalar()
        assert version == "0010"
        connection.execute(text("UPDATE alembic_version SET version_num = '0099'"))
        connection.commit()
    assert "was migrated by a newer DocTune (migration 0099" in check()
    assert "install the main machine's DocTune version here" in check()


def test_the_data_folder_must_be_the_main_machines(monkeypatch, redis_url, main_machine,
                                                   tmp_path):
    database, shared = main_machine

    def check(folder) -> list[str]:
        return _problems(monkeypatch, redis=redis_url, database=database, data_dir=folder)

    assert check(shared) == []
    (problem,) = check(tmp_path / "not-mounted")
    assert problem.startswith(f"The data folder {tmp_path / 'not-mounted'} does not exist on this")

    # Permissions do not stop root; sysfs refuses new files to everyone.
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    read_only = read_only if os.geteuid() != 0 else Path("/sys")
    (problem,) = check(read_only)
    assert problem.startswith(f"This machine cannot write in the data folder {read_only} (")

    empty = tmp_path / "empty"
    empty.mkdir()
    (problem,) = check(empty)
    assert problem.startswith(f"{empty} is not the main machine's data folder: it has no "
                              f"{INSTANCE_FILE} file")

    other = tmp_path / "other"
    mark_data_dir(other, "0a8a7e55-0000-4000-8000-000000000000")
    (problem,) = check(other)
    assert problem.startswith(f"{other} belongs to another DocTune than the database: its "
                              f"{INSTANCE_FILE} says 0a8a7e55-0000-4000-8000-000000000000")

    # The right folder at another path: a job's ranks on two machines get one spec of paths.
    elsewhere = tmp_path / "mnt-doctune"
    elsewhere.symlink_to(shared)
    (problem,) = check(elsewhere)
    assert problem == (f"The main machine's data folder is mounted at {elsewhere} here but is "
                       f"{shared} there: mount it at {shared} on this machine too. A job that "
                       "runs on several machines hands them its files by that path.")


def _doctune(args: list[str], env_extra: dict[str, str], **popen) -> subprocess.Popen:
    env = dict(os.environ, **env_extra)
    return subprocess.Popen([sys.executable, "-m", "worker.cli", *args], cwd=ROOT, env=env,
                            **popen)


def test_doctune_worker_join_says_what_is_wrong_and_starts_nothing(tmp_path):
    port = _free_port()
    proc = _doctune(["worker", "--join", "--redis", f"redis://127.0.0.1:{port}/0",
                     "--database", f"sqlite:///{tmp_path / 'x.db'}",
                     "--data-dir", str(tmp_path / "missing")], {},
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert [line.split(":")[0] for line in err.splitlines() if line] == ["Cannot join"] * 3
    assert f"Cannot reach Redis at 127.0.0.1:{port}" in err
    assert "Machines join through the main machine's PostgreSQL" in err
    assert f"The data folder {tmp_path / 'missing'} does not exist" in err


def test_doctune_worker_takes_only_the_queues_doctune_up_runs(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["worker", "--queues", "train,gpu"])
    assert exited.value.code == 2
    assert "'gpu': the queues are ingest, train, chat" in capsys.readouterr().err


def _registered(engine) -> Worker | None:
    with Session(engine) as session:
        return session.scalar(select(Worker).where(Worker.host == socket.gethostname()))


def test_a_machine_joins_with_one_command_and_registers_as_a_worker(
        postgres_engine, redis_url, tmp_path):  # noqa: F811
    database, shared = _url(postgres_engine), tmp_path / "shared"
    # The main machine: `doctune up` / `doctune web --migrate` migrate through this function.
    subprocess.run([sys.executable, "-c", "from app.migrate import upgrade_to_head as u; u()"],
                   cwd=ROOT, env=dict(os.environ, DATABASE_URL=database,
                                      DOCTUNE_DATA_DIR=str(shared)), check=True, timeout=120)
    assert (shared / INSTANCE_FILE).is_file()

    broker = redis_url.rsplit("/", 1)[0] + f"/{JOIN_REDIS_DB}"
    log = tmp_path / "join.log"
    with open(log, "wb") as out:
        joiner = _doctune(
            ["worker", "--join", "--redis", broker, "--database", database,
             "--data-dir", str(shared)],
            # A base model that is not there: the worker's one-time measuring of this machine
            # (a child process, for the Train panel) gives up at once instead of taking minutes.
            {"DOCTUNE_BASE_MODEL": str(tmp_path / "no-model")},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        row = wait_for(lambda: _registered(postgres_engine), 120, "the joined worker's row",
                       joiner)
        host = socket.gethostname()
        assert row.node == f"train@{host}" and row.stopped_at is None
        assert row.queues == sorted(["train", node_queue(host)])
        assert row.hardware["cores"] == os.cpu_count()

        # A task sent to this machine's own queue reaches it (a job id no row has: the claim
        # finds nothing and the task ends at once).
        client = make_celery()
        client.conf.broker_url = broker
        sent = client.send_task(TRAIN_TASK, args=[987654321], queue=node_queue(host))
        wait_for(lambda: f"Task {TRAIN_TASK}[{sent.id}] succeeded" in log.read_text(), 60,
                 "the task sent to the node queue", joiner)
        client.close()

        os.killpg(joiner.pid, signal.SIGINT)  # Ctrl-C in its terminal: every process gets it
        assert joiner.wait(timeout=60) == 0
        assert _registered(postgres_engine).stopped_at is not None
    finally:
        if joiner.poll() is None:
            os.killpg(joiner.pid, signal.SIGKILL)
            joiner.wait()
    assert "Joining the DocTune whose data folder is" in log.read_text()
