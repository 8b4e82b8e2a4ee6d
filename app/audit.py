"""The audit log: who signed in, uploaded, trained, downloaded and changed settings, for the
admin (/admin/audit). One row per event, written in the same transaction as the change it
records, so a change that rolls back leaves no entry and an entry always names a change that
happened. Rows are never updated; an account deleted later keeps its name on its rows."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import DateTime, ForeignKey, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column
from starlette.requests import Request

from app.db import Base, utcnow


class Action(enum.StrEnum):
    """What happened; the value is stored, the label shown."""

    signed_in = "signed_in"
    sign_in_refused = "sign_in_refused"
    signed_out = "signed_out"
    set_up = "set_up"
    joined = "joined"
    password_changed = "password_changed"
    token_created = "token_created"
    token_revoked = "token_revoked"
    account_invited = "account_invited"
    account_changed = "account_changed"
    folder_allowed = "folder_allowed"
    folder_removed = "folder_removed"
    project_created = "project_created"
    uploaded = "uploaded"
    folder_read = "folder_read"
    folder_settings = "folder_settings"
    training_started = "training_started"
    job_cancelled = "job_cancelled"
    version_chosen = "version_chosen"
    downloaded = "downloaded"

    @property
    def label(self) -> str:
        return LABELS[self]


LABELS = {
    Action.signed_in: "Signed in",
    Action.sign_in_refused: "Sign-in refused",
    Action.signed_out: "Signed out",
    Action.set_up: "Set up DocTune (first admin)",
    Action.joined: "Accepted an invitation",
    Action.password_changed: "Changed their password",
    Action.token_created: "Created an API token",
    Action.token_revoked: "Revoked an API token",
    Action.account_invited: "Invited a colleague",
    Action.account_changed: "Changed an account",
    Action.folder_allowed: "Allowed a folder",
    Action.folder_removed: "Removed an allowed folder",
    Action.project_created: "Created a project",
    Action.uploaded: "Uploaded documents",
    Action.folder_read: "Read files from a watched folder",
    Action.folder_settings: "Changed watched-folder settings",
    Action.training_started: "Started training",
    Action.job_cancelled: "Cancelled a job",
    Action.version_chosen: "Chose the version in use",
    Action.downloaded: "Downloaded",
}

# Who acts when no person does.
WATCHER = "folder watcher"
AUTO_TRAIN = "auto-train"

_LIMITS = {"actor": 100, "subject": 200, "detail": 1000, "address": 64}


class AuditEvent(Base):
    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime, default=utcnow, index=True)
    # The account that acted (None for DocTune's own work, or after the account is gone);
    # `actor` keeps the name shown then, or the part of DocTune that acted.
    user_id: Mapped[int | None] = mapped_column(
        Integer, ForeignKey("users.id", ondelete="SET NULL"), default=None, index=True
    )
    actor: Mapped[str] = mapped_column(String(_LIMITS["actor"]))
    action: Mapped[str] = mapped_column(String(40), index=True)
    subject: Mapped[str] = mapped_column(String(_LIMITS["subject"]), default="")
    detail: Mapped[str] = mapped_column(String(_LIMITS["detail"]), default="")
    address: Mapped[str | None] = mapped_column(String(_LIMITS["address"]), default=None)

    @property
    def label(self) -> str:
        try:
            return Action(self.action).label
        except ValueError:  # written by a newer DocTune
            return self.action


def _cut(value: str | None, field: str) -> str:
    value = " ".join((value or "").split())
    limit = _LIMITS[field]
    return value if len(value) <= limit else value[: limit - 1] + "…"


def record(
    session: Session,
    action: Action,
    *,
    actor: str,
    user_id: int | None = None,
    subject: str = "",
    detail: str = "",
    address: str | None = None,
) -> AuditEvent:
    """Add one event to the caller's transaction (committed with the change it records)."""
    event = AuditEvent(
        action=Action(action).value, actor=_cut(actor, "actor"), user_id=user_id,
        subject=_cut(subject, "subject"), detail=_cut(detail, "detail"),
        address=_cut(address, "address") if address else None,
    )
    session.add(event)
    return event


def record_request(
    request: Request, session: Session, action: Action, subject: str = "", detail: str = "",
    *, user_id: int | None = None, actor: str | None = None,
) -> AuditEvent:
    """An event by whoever the door let in (app/accounts/door.py), from the request's
    client address; `user_id`/`actor` name the person where the door did not (sign-in)."""
    visitor = getattr(request.state, "visitor", None)
    if visitor is not None:
        user_id = visitor.user_id if user_id is None else user_id
        actor = actor or visitor.name
    address = request.client.host if request.client else None
    return record(session, action, actor=actor or "someone signed out", user_id=user_id,
                  subject=subject, detail=detail, address=address)


def listed(names: list[str], most: int = 10) -> str:
    """"a.pdf, b.docx and 3 more": the detail of an event about several files."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


@dataclass(frozen=True)
class Filter:
    """The admin page's choice: one account (by id), one action, events older than an id."""

    user_id: int | None = None
    action: str | None = None
    before_id: int | None = None


def events(session: Session, wanted: Filter, limit: int | None = 50) -> list[AuditEvent]:
    """Newest first."""
    query = select(AuditEvent).order_by(AuditEvent.id.desc())
    if wanted.user_id is not None:
        query = query.where(AuditEvent.user_id == wanted.user_id)
    if wanted.action:
        query = query.where(AuditEvent.action == wanted.action)
    if wanted.before_id is not None:
        query = query.where(AuditEvent.id < wanted.before_id)
    if limit is not None:
        query = query.limit(limit)
    return list(session.scalars(query))
