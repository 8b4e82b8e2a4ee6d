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


def sign_in_as(role: str = "admin", name: str | None = None) -> tuple[str, str]:
    """A signed-in session for an account of `role` (made once, named after the role unless
    `name` is given), created in the database the way /signin does: (cookie, CSRF token)."""
    from sqlalchemy import select

    from app.accounts import service
    from app.accounts.models import SignInSession, User
    from app.accounts.tokens import token_hash
    from app.db import session_scope

    name = name or f"test {role}"
    with session_scope() as session:
        user = session.scalar(select(User).where(User.name == name))
        if user is None:
            user = service.create_user(session, name, role)
        token = service.start_session(session, user)
        csrf = session.scalar(select(SignInSession.csrf_token)
                              .where(SignInSession.token_hash == token_hash(token)))
    return token, csrf


def signed_in_headers(role: str = "admin", name: str | None = None) -> dict[str, str]:
    """The session cookie and CSRF header of a signed-in `role` (see sign_in_as)."""
    from app.accounts.door import COOKIE, CSRF_HEADER

    token, csrf = sign_in_as(role, name)
    return {"Cookie": f"{COOKIE}={token}", CSRF_HEADER: csrf}


def local_client(app: FastAPI, *, role: str | None = "admin", **kwargs: Any) -> TestClient:
    """A TestClient on the app's own address, sending its Origin with every request, signed
    in as an account of `role` (an admin unless told; None: anonymous)."""
    signed_in = signed_in_headers(role) if role else {}
    headers = {"Origin": local_url(), **signed_in, **kwargs.pop("headers", {})}
    return TestClient(app, base_url=local_url(), headers=headers, **kwargs)


@contextmanager
def serve_app(app_env: Any, log_name: str, *, tls: tuple[Path, Path] | None = None,
              extra_env: dict[str, str] | None = None) -> Iterator[int]:
    """The web app in its own uvicorn process on a free loopback port (yielded), with
    DOCTUNE_PORT set to it (the front door answers on the configured port only) and the
    session's data dir and Redis; its output goes to `log_name` in the data dir.
    `tls` = (certificate, key): HTTPS, started as the launcher starts it (DOCTUNE_TLS_* set,
    uvicorn's --ssl-* flags); `extra_env`: more settings for that process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ)
    env.update(DOCTUNE_DATA_DIR=str(app_env.data_dir), REDIS_URL=app_env.redis_url,
               DOCTUNE_PORT=str(port), **(extra_env or {}))
    env.pop("DATABASE_URL", None)
    cmd = [sys.executable, "-m", "uvicorn", "app.main:app", "--port", str(port)]
    if tls is not None:
        env.update(DOCTUNE_TLS_CERTFILE=str(tls[0]), DOCTUNE_TLS_KEYFILE=str(tls[1]))
        cmd += ["--ssl-certfile", str(tls[0]), "--ssl-keyfile", str(tls[1])]
    log = Path(app_env.data_dir) / log_name
    root = Path(__file__).resolve().parents[2]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
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


def add_session_cookie(context: Any, base_url: str, role: str = "admin") -> str:
    """Sign a Playwright browser context in as `role` (a session made as /signin makes one):
    its cookie for `base_url`. Returns the session's CSRF token."""
    from app.accounts.door import COOKIE

    token, csrf = sign_in_as(role)
    context.add_cookies([{"name": COOKIE, "value": token, "url": base_url,
                          "httpOnly": True, "sameSite": "Lax"}])
    return csrf
