"""What accounts can do: users, sign-in sessions, one-time links and API tokens. Each
function works inside the caller's database session; the caller commits."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from app.accounts.models import ApiToken, Role, SignInLink, SignInSession, User
from app.accounts.passwords import hash_password, password_problem, verify_password
from app.accounts.tokens import new_token, token_hash
from app.db import utcnow
from app.settings import settings

# "last seen" is written at most this often, not on every request.
_SEEN_EVERY = timedelta(minutes=1)


@dataclass(frozen=True)
class Visitor:
    """Who is asking: from a session cookie (with its CSRF token) or an API token."""

    user_id: int
    name: str
    role: Role
    csrf_token: str | None  # None for an API token: no browser, no CSRF
    session_id: int | None = None


class InvalidInput(ValueError):
    """Account input that cannot be used; `errors` maps a form field to a plain message.
    (Not app.services.errors': the services import the models, which import these.)"""

    def __init__(self, message: str, errors: dict[str, str]) -> None:
        super().__init__(message)
        self.message = message
        self.errors = errors


class NotFound(LookupError):
    """No such account or token: a 404."""


def _invalid(field: str, message: str) -> InvalidInput:
    return InvalidInput(message, {field: message})


# Users


def admin_exists(session: Session) -> bool:
    return session.scalar(
        select(func.count()).select_from(User).where(User.role == Role.admin.value)
    ) > 0


def _clean_name(name: str) -> str:
    name = " ".join(name.split())
    if not name:
        raise _invalid("name", "Enter a name.")
    if len(name) > 100:
        raise _invalid("name", "Use a name of at most 100 characters.")
    return name


def create_user(session: Session, name: str, role: Role | str,
                password: str | None = None) -> User:
    """A new account; without a password until its invitation link is opened."""
    name = _clean_name(name)
    role = Role(role)
    taken = session.scalar(select(User).where(func.lower(User.name) == name.lower()))
    if taken is not None:
        raise _invalid("name", f"There is already an account named {name}.")
    if password is not None and (problem := password_problem(password)):
        raise _invalid("password", problem)
    user = User(name=name, role=role.value,
                password_hash=hash_password(password) if password is not None else None)
    session.add(user)
    session.flush()
    return user


def list_users(session: Session) -> list[User]:
    return list(session.scalars(select(User).order_by(User.name)))


def get_user(session: Session, user_id: int) -> User:
    user = session.get(User, user_id)
    if user is None:
        raise NotFound("There is no such account.")
    return user


def _other_active_admins(session: Session, user: User) -> int:
    return session.scalar(
        select(func.count()).select_from(User).where(
            User.role == Role.admin.value, User.disabled.is_(False), User.id != user.id
        )
    )


def change_user(session: Session, user: User, *, role: str | None = None,
                disabled: bool | None = None) -> None:
    """A new role, or disabled / enabled again. The last admin stays an admin."""
    new_role = Role(role) if role else Role(user.role)
    new_disabled = user.disabled if disabled is None else disabled
    losing_admin = user.role == Role.admin.value and (new_role != Role.admin or new_disabled)
    if losing_admin and _other_active_admins(session, user) == 0:
        raise _invalid("role", "DocTune needs at least one admin: make another one first.")
    user.role = new_role.value
    user.disabled = new_disabled
    if new_disabled:
        revoke_sessions(session, user)


# Sign-in


def authenticate(session: Session, name: str, password: str) -> User | None:
    """The enabled user with this name and password, or None."""
    wanted = " ".join(name.split()).lower()
    user = session.scalar(select(User).where(func.lower(User.name) == wanted))
    ok = verify_password(user.password_hash if user else None, password)
    return user if ok and user is not None and not user.disabled else None


def start_session(session: Session, user: User) -> str:
    """A new signed-in session (a fresh token at every sign-in); returns the cookie value."""
    token = new_token()
    session.add(SignInSession(token_hash=token_hash(token), csrf_token=new_token(), user=user))
    session.flush()
    return token


def visitor_for_cookie(session: Session, token: str) -> Visitor | None:
    row = session.scalar(
        select(SignInSession).where(SignInSession.token_hash == token_hash(token))
    )
    now = utcnow()
    if row is None or row.revoked_at is not None or row.user.disabled:
        return None
    if now - row.last_seen_at > timedelta(days=settings.session_idle_days):
        return None
    if now - row.last_seen_at > _SEEN_EVERY:
        row.last_seen_at = now
    user = row.user
    return Visitor(user.id, user.name, Role(user.role), row.csrf_token, row.id)


def end_session(session: Session, session_id: int) -> None:
    row = session.get(SignInSession, session_id)
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()


def revoke_sessions(session: Session, user: User) -> None:
    session.execute(
        update(SignInSession)
        .where(SignInSession.user_id == user.id, SignInSession.revoked_at.is_(None))
        .values(revoked_at=utcnow())
    )


def change_password(session: Session, user: User, current: str, new: str,
                    keep_session_id: int | None) -> None:
    """A new password (the current one proves it is them); every other session of theirs
    is signed out."""
    if not verify_password(user.password_hash, current):
        raise _invalid("current", "That is not your current password.")
    if problem := password_problem(new):
        raise _invalid("password", problem)
    user.password_hash = hash_password(new)
    session.execute(
        update(SignInSession)
        .where(SignInSession.user_id == user.id, SignInSession.revoked_at.is_(None),
               SignInSession.id != (keep_session_id or -1))
        .values(revoked_at=utcnow())
    )


# One-time links: the setup link (no user yet: it makes the admin) and invitations


def new_link(session: Session, user: User | None = None) -> str:
    """A one-time sign-in link's token. A new setup link retires the older unused ones."""
    now = utcnow()
    if user is None:
        session.execute(
            update(SignInLink)
            .where(SignInLink.user_id.is_(None), SignInLink.used_at.is_(None))
            .values(used_at=now)
        )
    token = new_token()
    session.add(SignInLink(token_hash=token_hash(token), user_id=user.id if user else None,
                           expires_at=now + timedelta(hours=settings.sign_in_link_hours)))
    session.flush()
    return token


def setup_token_if_needed(session: Session) -> str | None:
    """The first start's setup link token, while no admin exists; None after that."""
    return None if admin_exists(session) else new_link(session)


def open_link(session: Session, token: str) -> SignInLink | None:
    """The link if it is unused and unexpired (and, for the setup link, no admin exists)."""
    link = session.scalar(select(SignInLink).where(SignInLink.token_hash == token_hash(token)))
    if link is None or link.used_at is not None or link.expires_at < utcnow():
        return None
    if link.user_id is None and admin_exists(session):
        return None
    if link.user_id is not None and session.get(User, link.user_id).disabled:
        return None
    return link


def use_link(session: Session, link: SignInLink, name: str, password: str) -> User:
    """Redeem the link: the setup link makes `name` the admin; an invitation sets its
    user's password. Either way the link is spent."""
    if problem := password_problem(password):
        raise _invalid("password", problem)
    if link.user_id is None:
        user = create_user(session, name, Role.admin, password)
    else:
        user = get_user(session, link.user_id)
        user.password_hash = hash_password(password)
    link.used_at = utcnow()
    return user


def link_user(session: Session, link: SignInLink) -> User | None:
    return session.get(User, link.user_id) if link.user_id is not None else None


# API tokens


def create_api_token(session: Session, user: User, label: str) -> str:
    """A new personal API token; the clear token is returned once and never stored."""
    label = " ".join(label.split())[:100] or "API token"
    token = new_token()
    session.add(ApiToken(token_hash=token_hash(token), user=user, label=label))
    session.flush()
    return token


def visitor_for_api_token(session: Session, token: str) -> Visitor | None:
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == token_hash(token)))
    if row is None or row.revoked_at is not None or row.user.disabled:
        return None
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at > _SEEN_EVERY:
        row.last_used_at = now
    return Visitor(row.user.id, row.user.name, Role(row.user.role), None)


def tokens_of(session: Session, user: User) -> list[ApiToken]:
    return list(session.scalars(
        select(ApiToken).where(ApiToken.user_id == user.id).order_by(ApiToken.created_at.desc())
    ))


def revoke_api_token(session: Session, user: User, token_id: int) -> None:
    row = session.get(ApiToken, token_id)
    if row is None or row.user_id != user.id:
        raise NotFound("There is no such token.")
    if row.revoked_at is None:
        row.revoked_at = utcnow()


def last_seen(user: User) -> datetime | None:
    return max((s.last_seen_at for s in user.sessions), default=None)
