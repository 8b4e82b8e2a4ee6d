"""The dependency on every route (attached to the app itself, so a new route cannot forget
it): who is asking, whether their role may do this, and the CSRF token of unsafe requests.

- A page or form: a signed-in session cookie. An `/api/` or `/v1/` request: the cookie, or
  `Authorization: Bearer <API token>` (no CSRF token: a token is not sent by a browser
  on its own). Anonymous: pages redirect to /signin, the API answers 401.
- Roles: a viewer reads (GET) and asks the models questions (the chat and
  /v1/chat/completions: conversations are each person's own, and asking changes no
  project); a member does everything on projects; only an admin reaches /admin. Everyone
  may manage their own account (/account) and sign out.
- Unsafe methods with a cookie carry the session's CSRF token: the `X-CSRF-Token` header
  (htmx sends it from <body hx-headers>) or a `csrf_token` form field."""

from __future__ import annotations

import re

from fastapi import HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from app.accounts import service
from app.accounts.models import Role
from app.accounts.service import Visitor
from app.accounts.tokens import same
from app.db import session_scope

COOKIE = "doctune_session"
CSRF_HEADER = "X-CSRF-Token"
CSRF_FIELD = "csrf_token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Open to anyone (the front door's Host and Origin checks still apply). Static files are a
# mount outside the routes.
EXEMPT_PATHS = frozenset({"/signin", "/setup", "/healthz"})
# Every signed-in role may use these, unsafe methods included.
OWN_ACCOUNT_PREFIXES = ("/account", "/signout")
ADMIN_PREFIX = "/admin"
# What a viewer may send besides reading: their own conversations with the models (route
# paths as declared: app/routes/chat.py, app/routes/openai_api.py).
VIEWER_CHAT = re.compile(r"/projects/\{project_id\}/chat(/[a-z]+)?|/chat/.+|/v1/chat/completions")
# Where an API token (Authorization: Bearer) stands in for a session: the JSON API and the
# OpenAI-compatible API.
TOKEN_PREFIXES = ("/api/", "/v1/")


class SignInRequired(Exception):
    """Nobody is signed in (or the token is not valid): see app/main.py's handler."""


def route_path(request: Request) -> str:
    route = request.scope.get("route")
    return getattr(route, "path", request.url.path)


def _identify(cookie: str | None, bearer: str | None) -> Visitor | None:
    with session_scope() as session:
        if bearer is not None:
            return service.visitor_for_api_token(session, bearer)
        if cookie:
            return service.visitor_for_cookie(session, cookie)
    return None


def _bearer(request: Request) -> str | None:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None


async def _sent_csrf(request: Request) -> str | None:
    sent = request.headers.get(CSRF_HEADER)
    if sent is None and request.headers.get("Content-Type", "").startswith(
        "application/x-www-form-urlencoded"
    ):  # a plain form (multipart uploads stream: they send the header)
        sent = (await request.form()).get(CSRF_FIELD)
    return sent if isinstance(sent, str) else None


async def door(request: Request) -> None:
    """Let the request through, or raise SignInRequired (401 / redirect) or 403."""
    path = route_path(request)
    if path in EXEMPT_PATHS:
        return
    bearer = _bearer(request) if path.startswith(TOKEN_PREFIXES) else None
    visitor = await run_in_threadpool(_identify, request.cookies.get(COOKIE), bearer)
    if visitor is None:
        raise SignInRequired()
    request.state.visitor = visitor
    unsafe = request.method not in SAFE_METHODS
    if unsafe and visitor.csrf_token is not None:
        sent = await _sent_csrf(request)
        if sent is None or not same(sent, visitor.csrf_token):
            raise HTTPException(403, "This form has expired (its security token is missing or "
                                     "old). Reload the page and try again.")
    if path.startswith(ADMIN_PREFIX) and visitor.role != Role.admin:
        raise HTTPException(403, "Only an admin can manage accounts.")
    if path.startswith(OWN_ACCOUNT_PREFIXES) or not unsafe or VIEWER_CHAT.fullmatch(path):
        return
    if visitor.role == Role.viewer:
        raise HTTPException(403, "Your account can look but not change anything: ask an "
                                 "admin to make you a member.")


def visitor_of(request: Request) -> Visitor | None:
    """Who the door let in (None on the open pages)."""
    return getattr(request.state, "visitor", None)
