"""Database rows. The database is the source of truth for projects, documents and jobs."""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    false,
    text,
)
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


class AutoTrain(enum.StrEnum):
    """When the watched folder queues training by itself."""

    off = "off"
    changes = "changes"  # once the documents have been unchanged for auto_quiet_s
    nightly = "nightly"  # every day at auto_nightly_at (local time), if anything changed


class Retired(enum.StrEnum):
    """Why a document version is no longer used for training (kept, never deleted)."""

    replaced = "replaced"  # its file was edited: a newer version took its place
    deleted = "deleted"  # its file was deleted from the watched folder


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)

    # The watched folder. None: settings.inbox_dir / a folder named after the project.
    inbox_path: Mapped[str | None] = mapped_column(Text, default=None)
    # What the watcher last found there ("ok", "missing", "not a folder", ...) and when.
    inbox_status: Mapped[str | None] = mapped_column(String(200), default=None)
    inbox_checked_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    # Last time a document was added, changed or retired: the auto-train quiet period
    # counts from here.
    last_change_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    auto_train: Mapped[str] = mapped_column(
        String(16), default=AutoTrain.off, server_default=AutoTrain.off.value
    )
    # "After changes": seconds the documents must stay unchanged before a job is queued.
    auto_quiet_s: Mapped[int] = mapped_column(Integer, default=600, server_default=text("600"))
    auto_nightly_at: Mapped[str] = mapped_column(String(5), default="02:00", server_default="02:00")
    # When the nightly check last ran (it runs at most once per day).
    auto_fired_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    # New jobs start from the current tuned version ("latest") or from the base model ("base").
    start_from: Mapped[str] = mapped_column(String(8), default="latest", server_default="latest")
    # The tuned version in use (a done job of this project); None: the latest done job.
    # No foreign key: projects and jobs would reference each other.
    current_job_id: Mapped[int | None] = mapped_column(Integer, default=None)
    # The training work its documents make ({"plan": app.contract.dataset_plan's shape or
    # None, "requested": {"key", "at"}}): counted by the worker, read by the Train panel.
    dataset_plan: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)

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
    # What the reader skipped, in words ("Could not read the text on 2 of 9 pages."), shown
    # beside the document; None when nothing was skipped.
    read_notes: Mapped[list[str] | None] = mapped_column(JSON, default=None)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)
    extracted_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    # Reading it: how many times a worker started (a redelivered task finds 1 and marks the
    # file failed instead of reading it again), and when the last one started.
    read_attempts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    read_started_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)

    # Watched folder: the file's path inside the project's inbox ("/"-separated); None for
    # uploads. A path has one active version; edits add versions, older ones are retired.
    source_path: Mapped[str | None] = mapped_column(Text, default=None)
    version: Mapped[int] = mapped_column(Integer, default=1, server_default=text("1"))
    # The file's modification time when this version was read: a rescan that finds the same
    # size and time skips the file without reading it.
    source_mtime_ns: Mapped[int | None] = mapped_column(BigInteger, default=None)
    last_seen_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    retired_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)
    retired_reason: Mapped[str | None] = mapped_column(String(16), default=None)  # Retired

    project: Mapped[Project] = relationship(back_populates="documents")

    @property
    def usable(self) -> bool:
        return self.status == DocStatus.extracted and self.retired_at is None

    @property
    def retired(self) -> bool:
        return self.retired_at is not None


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

    # What a finished job measured, each JSON column in its app.contract shape: the scores
    # before and after training (app.contract.scores), the training set's counts and notes,
    # the training run's figures, and the downloads that could not be made (app.contract.results).
    scores: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    dataset: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    # What the Train panel estimated when the job was queued ({"train_s", "steps"}): a
    # finished job's measured phases against it calibrate the next estimates
    # (app/services/planner.py).
    estimate: Mapped[dict[str, Any] | None] = mapped_column(JSON, default=None)
    export_errors: Mapped[dict[str, str] | None] = mapped_column(JSON, default=None)  # kind -> why
    artifacts: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)  # kind -> file path
    error: Mapped[str | None] = mapped_column(Text, default=None)

    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Queued by the watched folder's auto-train rather than the Train button.
    auto: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The tuned version this job starts from (incremental training); None: the base model.
    parent_job_id: Mapped[int | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="SET NULL"), default=None
    )
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


class AllowedFolder(Base):
    """A folder an admin allowed watched folders in (besides the inbox root and
    DOCTUNE_ALLOWED_FOLDERS); see app/services/allowed_folders.py."""

    __tablename__ = "allowed_folders"

    id: Mapped[int] = mapped_column(primary_key=True)
    path: Mapped[str] = mapped_column(String(1000), unique=True)
    added_by: Mapped[str] = mapped_column(String(100))
    added_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


class Worker(Base):
    """A Celery worker process on some machine, as it registered itself when it became ready
    (worker/registry.py); the admin's Workers page. What it runs is the jobs it claimed
    (Job.claimed_by is this node name)."""

    __tablename__ = "workers"

    id: Mapped[int] = mapped_column(primary_key=True)
    node: Mapped[str] = mapped_column(String(200), unique=True)  # Celery's, e.g. "train@host"
    host: Mapped[str] = mapped_column(String(200))
    queues: Mapped[list[str]] = mapped_column(JSON, default=list)
    hardware: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # contract.workers
    version: Mapped[str] = mapped_column(String(40))  # DocTune's, on that machine
    started_at: Mapped[datetime] = mapped_column(DateTime)
    # Refreshed every contract.workers.HEARTBEAT_EVERY_S while it runs.
    last_seen_at: Mapped[datetime] = mapped_column(DateTime)
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime, default=None)  # shut down
    # The job whose training ranks it runs for another machine's worker (one job on several
    # machines, worker/distributed/nodes.py reserves it); None, or a job no longer running:
    # free to lend.
    lending_to: Mapped[int | None] = mapped_column(Integer, default=None)
    # The chat worker (its node name) whose model's second stage this worker holds (a chat
    # on two machines, worker/chat/head.py reserves it); None: no chat. Jobs leave it be.
    chat_stage_of: Mapped[str | None] = mapped_column(String(200), default=None)


class Instance(Base):
    """This DocTune's id: one row, made by migration 0011. The main machine writes the same
    id into its data folder (app/instance.py), so a machine that joins can tell that the
    folder it mounted belongs to this database."""

    __tablename__ = "instance"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, default=utcnow)


# The account tables live in app/accounts/models.py and the audit log in app/audit.py;
# imported here so that Base.metadata (Alembic, the migration test) knows every table. The
# chat's tables (app/chat/models.py, which imports this module's) are registered by
# app/tables.py.
from app import audit as _audit  # noqa: F401
from app.accounts import models as _accounts_models  # noqa: F401
