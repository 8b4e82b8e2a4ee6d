"""The private Redis (app/redis_server.py): a real redis-server behind a password that only
this user can read, with CONFIG disabled, and the password never on a command line."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis

from app.redis_server import (
    port_open,
    private_redis_password,
    private_redis_url,
    redis_binary,
    start_private_redis,
)


def _refused(**kwargs) -> redis.Redis:
    """A client that asks once: redis-py retries a refused connection with backoff (about
    4 s), which says nothing more about the refusal."""
    return redis.Redis(retry=None, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def private(tmp_path):
    """A private redis-server of its own, started as the launcher starts one."""
    folder = tmp_path / "data dir with \"odd\" name" / "redis"
    port = _free_port()
    proc = start_private_redis(folder, port)
    yield folder, port, proc
    proc.terminate()
    proc.wait(timeout=10)


def test_without_the_password_a_connection_is_refused(private):
    folder, port, _ = private
    with pytest.raises(redis.AuthenticationError):
        _refused(port=port).ping()
    with pytest.raises(redis.AuthenticationError):
        _refused(port=port, password="guessed-wrong-0123456789").ping()
    client = redis.Redis.from_url(private_redis_url(folder, port))
    assert client.ping()
    client.lpush("ingest", b"task")
    assert client.llen("ingest") == 1


def test_the_password_file_is_private_and_the_password_is_not_on_the_command_line(private):
    folder, _, proc = private
    password_file = folder / "password"
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    password = private_redis_password(folder)
    assert len(password) >= 32
    assert password_file.read_text().strip() == password  # made once, read back the same
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert password.encode() not in cmdline
    assert (folder / "appendonly.aof").exists() or (folder / "appendonlydir").is_dir()


def test_config_is_disabled(private):
    folder, port, _ = private
    client = redis.Redis.from_url(private_redis_url(folder, port))
    with pytest.raises(redis.ResponseError, match="unknown command"):
        client.config_get("requirepass")
    with pytest.raises(redis.ResponseError, match="unknown command"):
        client.config_set("dir", "/tmp")


def test_a_private_redis_left_running_by_a_killed_launcher_is_replaced(private):
    """`kill -9` of `doctune up` leaves its Redis running: the next start recognises its own
    (it answers to this data dir's password), stops it and starts afresh, the queue kept."""
    folder, port, orphan = private
    redis.Redis.from_url(private_redis_url(folder, port)).lpush("ingest", b"queued")
    with pytest.raises(RuntimeError, match="already in use"):
        start_private_redis(folder, port)  # only the launcher, holding the lock, replaces it
    proc = start_private_redis(folder, port, replace_left_over=True)
    try:
        assert orphan.wait(timeout=10) == 0  # shut down, not killed
        client = redis.Redis.from_url(private_redis_url(folder, port))
        assert client.lrange("ingest", 0, -1) == [b"queued"]  # the AOF kept it
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_port_held_by_something_else_is_refused_in_words(tmp_path):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"Port {port} is already in use"):
            start_private_redis(tmp_path / "redis", port, timeout_s=2, replace_left_over=True)


@pytest.mark.parametrize("password", [None, "someone-elses-password-0123"])
def test_someone_elses_redis_is_left_running(tmp_path, password):
    """A Redis without a password, or with another, is not ours to stop."""
    port = _free_port()
    theirs = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--save", "", "--dir", str(tmp_path)]
        + (["--requirepass", password] if password else []),
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_open(port) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(RuntimeError, match=f"Port {port} is already in use"):
            start_private_redis(tmp_path / "redis", port, timeout_s=2, replace_left_over=True)
        assert theirs.poll() is None and redis.Redis(port=port, password=password).ping()
    finally:
        theirs.terminate()
        theirs.wait(timeout=10)


def test_a_password_file_others_can_read_is_refused(tmp_path):
    folder = tmp_path / "redis"
    private_redis_password(folder)
    os.chmod(folder / "password", 0o644)
    with pytest.raises(RuntimeError, match="only you"):
        private_redis_password(folder)


def test_the_test_suites_own_redis_wants_the_password_too(redis_url):
    """tests/conftest.py starts its Redis through the same code (unless TEST_REDIS_URL)."""
    if "TEST_REDIS_URL" in os.environ:
        pytest.skip("an external Redis (TEST_REDIS_URL) is used as given")
    assert redis.Redis.from_url(redis_url).ping()
    port = redis.Redis.from_url(redis_url).connection_pool.connection_kwargs["port"]
    with pytest.raises(redis.AuthenticationError):
        _refused(port=port).ping()
