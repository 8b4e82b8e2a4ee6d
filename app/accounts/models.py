"""Account rows. Tokens are kept only as SHA-256 hashes: a copy of the database signs
nobody in."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import Boolean, DateTime, ForeignKey, String, false
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.db import Base, utcnow


class Role(enum.StrEnum):
    admin = "admin"  # everything, and accounts
    member = "member"  # projects: upload, train, cancel, download, folder settings
    viewer = "viewer"  # reads projects, scores and downloads


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    # None until the person opens their invitation link and picks a password.
    password_hash: Mapped[str | None] = mapped_column(String(200), default=None)
    role: Mapped[str] = mapped_column(String(20), default=Role.member.value)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    sessions: Mapped[list[SignInSession]] = relationship(back_populates="user")
    tokens: Mapped[list[ApiToken]] = relationship(back_populates="user")


class SignInSession(Base):
    """A browser's signed-in session: the cookie holds the token, this row its hash."""

    __tablename__ = "sessions"

    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # Sent back in forms and the X-CSRF-Token header; random per session.
    csrf_token: Mapped[str] = mapped_column(String(64))
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    user: Mapped[User] = relationship(back_populates="sessions")


class ApiToken(Base):
    """A personal token for the JSON API (`Authorization: Bearer ...`), shown once."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    label: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    user: Mapped[User] = relationship(back_populates="tokens")


class SignInLink(Base):
    """A one-time link: the first start's setup link (no user: it makes the admin) or a
    colleague's invitation (their user, who picks a password)."""

    __tablename__ = "sign_in_links"

    id: Mapped[int] = mapped_column(primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    user_id: Mapped[int | None] = mapped_column(
        ForeignKey("users.id", ondelete="CASCADE"), default=None, index=True
    )
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime)
    used_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
