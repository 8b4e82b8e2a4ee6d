"""A test client that talks to the app the way its own pages do: at a loopback address on the
configured port (the front door refuses any other Host) and with that address as its Origin
(refused on unsafe methods without it). Tests of the front door itself set their own headers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient


def local_url() -> str:
    """Where the app's own pages live: http://127.0.0.1:<DOCTUNE_PORT>."""
    from app.settings import settings

    return f"http://127.0.0.1:{settings.port}"


def local_client(app: FastAPI, **kwargs: Any) -> TestClient:
    """A TestClient on the app's own address, sending its Origin with every request."""
    headers = {"Origin": local_url(), **kwargs.pop("headers", {})}
    return TestClient(app, base_url=local_url(), headers=headers, **kwargs)


@contextmanager
def serve_app(app_env: Any, log_name: str) -> Iterator[int]:
    """The web app in its own uvicorn process on a free loopback port (yielded), with
    DOCTUNE_PORT set to it (the front door answers on the configured port only) and the
    session's data dir and Redis; its output goes to `log_name` in the data dir."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.update(DOCTUNE_DATA_DIR=str(app_env.data_dir), REDIS_URL=app_env.redis_url,
               DOCTUNE_PORT=str(port))
    env.pop("DATABASE_URL", None)
    log = Path(app_env.data_dir) / log_name
    root = Path(__file__).resolve().parents[2]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)],
            cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None:
                raise RuntimeError(log.read_text())
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
