"""Conversation rows. A conversation talks to one model: the base model (job_id None) or a
finished job's version; it is deleted with that version and with its owner."""

from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Integer, String, Text, false
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.db import Base, utcnow


class ReplyState(enum.StrEnum):
    queued = "queued"
    running = "running"
    done = "done"
    stopped = "stopped"  # the user pressed Stop: what came so far is kept
    failed = "failed"

    @property
    def finished(self) -> bool:
        return self in (ReplyState.done, ReplyState.stopped, ReplyState.failed)


# Ids are never reused (SQLite's AUTOINCREMENT; PostgreSQL's sequences never do): a reply's
# Redis stream and Stop flag are named by its id (app/contract/chat.py), and a new reply
# taking a deleted one's id would read the old reply's events.
NEVER_REUSE_IDS = {"sqlite_autoincrement": True}


class Conversation(Base):
    __tablename__ = "conversations"
    __table_args__ = NEVER_REUSE_IDS

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), default=None, index=True)
    title: Mapped[str] = mapped_column(String(200), default="New conversation")
    # "page": the chat page's; "api": one request to /v1/chat/completions (not listed).
    origin: Mapped[str] = mapped_column(String(8), default="page")
    # Answers from the project's documents: passages found for each question are put in
    # the prompt and the reply names them (app/chat/passages.py).
    use_documents: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Two conversations asked the same questions side by side share this (the compare view).
    compare_group: Mapped[str | None] = mapped_column(String(32), default=None, index=True)
    # A saved context: kept under this name, new conversations start from its history (and
    # so from its cache on the SSD: no prefill of what it already read).
    saved_as: Mapped[str | None] = mapped_column(String(100), default=None)
    # The whole history as the model's token ids (prompts as the chat template made them,
    # replies as generated), written by the chat worker only: a follow-up extends these
    # ids, never a re-tokenized text, so the SSD cache of the history matches exactly.
    token_ids: Mapped[list[int]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    messages: Mapped[list[ChatMessage]] = relationship(
        back_populates="conversation", order_by="ChatMessage.id", cascade="all, delete-orphan")


class ChatMessage(Base):
    __tablename__ = "chat_messages"
    __table_args__ = NEVER_REUSE_IDS

    id: Mapped[int] = mapped_column(primary_key=True)
    conversation_id: Mapped[int] = mapped_column(
        ForeignKey("conversations.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))  # user | assistant | system (API only)
    content: Mapped[str] = mapped_column(Text, default="")
    # A question as the model reads it when it differs from what was typed: with the
    # passages from the documents before it. The reply's `sources` name those documents.
    prompt_content: Mapped[str | None] = mapped_column(Text, default=None)
    sources: Mapped[list[dict] | None] = mapped_column(JSON, default=None)
    # Replies only: their state, sampling temperature (0: greedy), the generated token ids,
    # how they were made (app.contract.chat.ReplyStats) and, when failed, why in words.
    state: Mapped[str] = mapped_column(String(16), default=ReplyState.done.value)
    temperature: Mapped[float] = mapped_column(Float, default=0.0)
    max_new_tokens: Mapped[int | None] = mapped_column(Integer, default=None)  # None: the most
    token_ids: Mapped[list[int] | None] = mapped_column(JSON, default=None)
    stats: Mapped[dict | None] = mapped_column(JSON, default=None)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    conversation: Mapped[Conversation] = relationship(back_populates="messages")

    @property
    def reply_state(self) -> ReplyState:
        return ReplyState(self.state)


class Passage(Base):
    """A piece of a document's extracted text (about a paragraph), found by full-text search
    for the chat's "use my documents" (app/chat/passages.py). The search index itself is
    the database's: SQLite FTS5 (the passages_fts table, kept by triggers) or PostgreSQL's
    full-text search (an expression index); see migration 0008."""

    __tablename__ = "passages"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(
        ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    document_id: Mapped[int] = mapped_column(
        ForeignKey("documents.id", ondelete="CASCADE"), index=True)
    ord: Mapped[int] = mapped_column(Integer)  # its place in the document
    text: Mapped[str] = mapped_column(Text)
