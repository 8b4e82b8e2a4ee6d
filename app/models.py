"""Database rows. The database is the source of truth for projects, documents and jobs."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.db import Base, utcnow


class DocStatus(enum.StrEnum):
    pending = "pending"
    extracted = "extracted"
    duplicate = "duplicate"
    failed = "failed"


class JobState(enum.StrEnum):
    queued = "queued"
    running = "running"
    evaluating = "evaluating"
    done = "done"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobState.done, JobState.failed, JobState.cancelled)


ACTIVE_JOB_STATES = (JobState.queued, JobState.running, JobState.evaluating)


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    documents: Mapped[list[Document]] = relationship(
        back_populates="project", cascade="all, delete-orphan", order_by="Document.id"
    )
    jobs: Mapped[list[Job]] = relationship(
        back_populates="project", cascade="all, delete-orphan", order_by="Job.id.desc()"
    )


class Document(Base):
    __tablename__ = "documents"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    # As the user gave it (may hold any unicode, slashes, 255+ chars); never used as a path.
    original_name: Mapped[str] = mapped_column(Text)
    # Generated; the only name used on disk, under settings.documents_dir.
    stored_name: Mapped[str] = mapped_column(String(80), unique=True)
    kind: Mapped[str] = mapped_column(String(16))  # pdf, docx, html, md, txt, csv, jsonl, ...
    size_bytes: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), default=DocStatus.pending)
    error: Mapped[str | None] = mapped_column(Text, default=None)
    word_count: Mapped[int] = mapped_column(Integer, default=0)
    qa_count: Mapped[int] = mapped_column(Integer, default=0)
    preview: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    extracted_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    project: Mapped[Project] = relationship(back_populates="documents")

    @property
    def usable(self) -> bool:
        return self.status == DocStatus.extracted


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[int] = mapped_column(primary_key=True)
    project_id: Mapped[int] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    state: Mapped[str] = mapped_column(String(16), default=JobState.queued, index=True)
    method: Mapped[str] = mapped_column(String(8), default="lora")  # lora | full
    # Settings asked for (advanced form), then resolved defaults, as JSON dicts.
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    # Which document versions were used: [{"id", "name", "sha256"}].
    sources: Mapped[list[dict[str, Any]]] = mapped_column(JSON, default=list)

    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    loss_history: Mapped[list[list[float]]] = mapped_column(JSON, default=list)  # [[step, loss]]
    tokens_per_s: Mapped[float | None] = mapped_column(Float, default=None)
    eta_s: Mapped[float | None] = mapped_column(Float, default=None)
    phase: Mapped[str] = mapped_column(String(200), default="")  # a short human line

    # Offload engine figures (bytes read/written, GB/s, stall, prefetch hits, peak memory),
    # refreshed while the job runs.
    telemetry: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)

    scores: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    artifacts: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)  # kind -> file path
    error: Mapped[str | None] = mapped_column(Text, default=None)

    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    claimed_by: Mapped[str | None] = mapped_column(String(200), default=None)  # worker node name
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    project: Mapped[Project] = relationship(back_populates="jobs")

    @property
    def job_state(self) -> JobState:
        return JobState(self.state)
