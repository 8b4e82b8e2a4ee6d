"""Sign-in, the setup / invitation link, sign-out, your own account (API tokens) and the
admin's account list. The door (app/accounts/door.py) leaves /signin and /setup open."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, HTTPException, Request
from fastapi.responses import RedirectResponse, Response

from app.accounts import limiter
from app.accounts import service as accounts
from app.accounts.door import COOKIE, visitor_of
from app.accounts.models import Role, User
from app.accounts.service import InvalidInput, NotFound
from app.audit import Action, record_request
from app.db import RowId, SessionDep
from app.settings import settings

from .templating import render

router = APIRouter()


def _next_page(value: str | None) -> str:
    """Only a path on this site (never //elsewhere): no open redirect."""
    if value and value.startswith("/") and not value.startswith(("//", "/\\")):
        return value
    return "/"


def _signed_in(request: Request, token: str, to: str) -> Response:
    response = RedirectResponse(to, status_code=303)
    response.set_cookie(
        COOKIE, token, httponly=True, samesite="lax", secure=request.url.scheme == "https",
        max_age=settings.session_idle_days * 86400, path="/",
    )
    return response


def _found(function, *args):
    try:
        return function(*args)
    except NotFound as exc:
        raise HTTPException(404, str(exc)) from exc


def _me(request: Request, session: SessionDep) -> User:
    visitor = visitor_of(request)
    assert visitor is not None  # the door let nobody else in
    return accounts.get_user(session, visitor.user_id)


# Sign-in and out


@router.get("/signin", name="signin")
def signin_page(request: Request, next: str = "/") -> Response:
    return render(request, "signin.html", {"next": _next_page(next), "name": "", "error": None})


@router.post("/signin", name="signin_post")
def signin(
    request: Request,
    session: SessionDep,
    name: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
    next: Annotated[str, Form()] = "/",
) -> Response:
    address = request.client.host if request.client else "?"
    context = {"next": _next_page(next), "name": name}
    wait = limiter.wait_s(name, address)
    if wait > 0:
        minutes = max(1, round(wait / 60))
        error = (f"Too many sign-in attempts. Wait {minutes} minute{'s' * (minutes > 1)} "
                 "and try again.")
        return render(request, "signin.html", {**context, "error": error}, status_code=429)
    user = accounts.authenticate(session, name, password)
    if user is None:
        limiter.failed(name, address)
        record_request(request, session, Action.sign_in_refused, f"name “{name[:100]}”",
                       actor="someone signed out")
        return render(request, "signin.html",
                      {**context, "error": "That name and password do not match an account."},
                      status_code=401)
    record_request(request, session, Action.signed_in, user_id=user.id, actor=user.name)
    return _signed_in(request, accounts.start_session(session, user), _next_page(next))


@router.post("/signout", name="signout")
def signout(request: Request, session: SessionDep) -> Response:
    visitor = visitor_of(request)
    if visitor is not None and visitor.session_id is not None:
        accounts.end_session(session, visitor.session_id)
        record_request(request, session, Action.signed_out)
    response = RedirectResponse("/signin", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


# The one-time links: setup (the first admin) and invitations


def _open_link(session: SessionDep, token: str):
    link = accounts.open_link(session, token)
    if link is None:
        raise HTTPException(403, "This sign-in link has been used, has expired or is not "
                                 "valid. Ask your DocTune admin for a new one (or restart "
                                 "DocTune for a new setup link, while it has no admin).")
    return link


@router.get("/setup", name="setup")
def setup_page(request: Request, session: SessionDep, token: str = "") -> Response:
    link = _open_link(session, token)
    user = accounts.link_user(session, link)
    context = {"token": token, "invited": user, "name": user.name if user else "", "errors": {}}
    return render(request, "setup.html", context)


@router.post("/setup", name="setup_post")
def setup(
    request: Request,
    session: SessionDep,
    token: Annotated[str, Form()] = "",
    name: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
) -> Response:
    link = _open_link(session, token)
    invited = accounts.link_user(session, link)
    try:
        user = accounts.use_link(session, link, name, password)
    except InvalidInput as exc:
        context = {"token": token, "invited": invited, "name": name, "errors": exc.errors}
        return render(request, "setup.html", context, status_code=422)
    record_request(request, session, Action.set_up if invited is None else Action.joined,
                   user_id=user.id, actor=user.name)
    return _signed_in(request, accounts.start_session(session, user), "/")


# Your own account: API tokens


def _account_page(request: Request, session: SessionDep, new_token: str | None = None,
                  status_code: int = 200, **extra) -> Response:
    me = _me(request, session)
    context = {"me": me, "tokens": accounts.tokens_of(session, me), "new_token": new_token,
               "errors": {}, "password_changed": False, **extra}
    return render(request, "account.html", context, status_code=status_code)


@router.post("/account/password", name="change_password")
def change_password(
    request: Request,
    session: SessionDep,
    current: Annotated[str, Form()] = "",
    password: Annotated[str, Form()] = "",
) -> Response:
    visitor = visitor_of(request)
    keep = visitor.session_id if visitor else None
    try:
        accounts.change_password(session, _me(request, session), current, password, keep)
    except InvalidInput as exc:
        return _account_page(request, session, errors=exc.errors, status_code=422)
    record_request(request, session, Action.password_changed)
    return _account_page(request, session, password_changed=True)


@router.get("/account", name="account")
def account_page(request: Request, session: SessionDep) -> Response:
    return _account_page(request, session)


@router.post("/account/tokens", name="create_token")
def create_token(
    request: Request, session: SessionDep, label: Annotated[str, Form()] = ""
) -> Response:
    token = accounts.create_api_token(session, _me(request, session), label)
    record_request(request, session, Action.token_created, f"token “{label.strip()[:100]}”")
    return _account_page(request, session, new_token=token, status_code=201)


@router.post("/account/tokens/{token_id}/revoke", name="revoke_token")
def revoke_token(request: Request, session: SessionDep, token_id: RowId) -> Response:
    _found(accounts.revoke_api_token, session, _me(request, session), token_id)
    record_request(request, session, Action.token_revoked, f"token {token_id}")
    return RedirectResponse("/account", status_code=303)


# The admin's list of accounts


def _admin_page(request: Request, session: SessionDep, **extra) -> Response:
    status_code = extra.pop("status_code", 200)
    context = {
        "users": accounts.list_users(session),
        "roles": [r.value for r in Role],
        "errors": {},
        "invite_link": None,
        "invited_name": None,
        "base_url": str(request.base_url).rstrip("/"),
        **extra,
    }
    return render(request, "admin_users.html", context, status_code=status_code)


@router.get("/admin/users", name="admin_users")
def admin_users(request: Request, session: SessionDep) -> Response:
    return _admin_page(request, session)


@router.post("/admin/users", name="invite_user")
def invite_user(
    request: Request,
    session: SessionDep,
    name: Annotated[str, Form()] = "",
    role: Annotated[str, Form()] = Role.member.value,
) -> Response:
    if role not in {r.value for r in Role}:
        role = Role.member.value
    try:
        user = accounts.create_user(session, name, role)
    except InvalidInput as exc:
        return _admin_page(request, session, errors=exc.errors, status_code=422)
    token = accounts.new_link(session, user)
    record_request(request, session, Action.account_invited, f"account “{user.name}”",
                   f"role: {user.role}")
    link = f"{str(request.base_url).rstrip('/')}/setup?token={token}"
    return _admin_page(request, session, invite_link=link, invited_name=user.name,
                       status_code=201)


@router.post("/admin/users/{user_id}", name="change_user")
def change_user(
    request: Request,
    session: SessionDep,
    user_id: RowId,
    role: Annotated[str | None, Form()] = None,
    action: Annotated[str | None, Form()] = None,
) -> Response:
    user = _found(accounts.get_user, session, user_id)
    if role is not None and role not in {r.value for r in Role}:
        role = None
    disabled = {"disable": True, "enable": False}.get(action or "")
    try:
        accounts.change_user(session, user, role=role, disabled=disabled)
    except InvalidInput as exc:
        session.rollback()
        return _admin_page(request, session, errors=exc.errors, status_code=422)
    state = "disabled" if user.disabled else "enabled"
    record_request(request, session, Action.account_changed, f"account “{user.name}”",
                   f"role: {user.role}, {state}")
    return RedirectResponse("/admin/users", status_code=303)
