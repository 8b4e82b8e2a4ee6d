"""The first start's one-time setup link (as Jupyter prints its token link)."""

from __future__ import annotations

from app.accounts import service
from app.db import session_scope


def setup_link(address: str) -> str | None:
    """While no admin exists, a fresh one-time link on `address` that makes whoever opens
    it the admin (older unused setup links stop working); None once there is one."""
    with session_scope() as session:
        token = service.setup_token_if_needed(session)
    return f"{address}/setup?token={token}" if token else None
