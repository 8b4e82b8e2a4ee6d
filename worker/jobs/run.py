"""Run one training job: claim its row, run the pipeline, record progress and results.

The database row is the truth. This module turns the pipeline's hooks into row updates
(throttled, so a fast tiny model does not hammer SQLite) and its outcome into a final
state the user can read: done, failed (with a reason in words) or cancelled."""

from __future__ import annotations

import logging
import shutil
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path

from sqlalchemy import update

from app.contract.results import JobResults
from app.db import session_scope, utcnow
from app.models import Job, JobState
from app.settings import settings
from offload import OffloadBudgetError
from worker.errors import UserFacingError, ran_out_of
from worker.ingest import load_source_docs
from worker.jobs.inputs import plan_inputs
from worker.jobs.pipeline import Cancelled, Hooks, run_pipeline

log = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 2.0
# A job whose heartbeat is older than this belongs to a dead worker (see reconcile.py).
STALE_AFTER = timedelta(minutes=10)


def job_workdir(job_id: int) -> Path:
    return settings.jobs_dir / str(job_id)


def job_swap_dir(job_id: int) -> Path:
    """Where the offload engine pages while the job trains (removed when it ends)."""
    return settings.swap_dir / str(job_id)


def claim(job_id: int, node: str) -> bool:
    """Atomically take a queued job (or one orphaned by `node`'s previous life)."""
    now = utcnow()
    with session_scope() as session:
        res = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.state == JobState.queued, Job.cancel_requested.is_(False))
            .values(state=JobState.running, claimed_by=node, heartbeat_at=now,
                    attempts=Job.attempts + 1, phase="Starting")
        )
        if res.rowcount == 1:
            job = session.get(Job, job_id)
            if job.started_at is None:
                job.started_at = now
            return True
        job = session.get(Job, job_id)
        if job is not None and job.state == JobState.queued and job.cancel_requested:
            _finish(session, job, JobState.cancelled, phase="Cancelled before it started")
    return False


def _finish(session, job: Job, state: JobState, phase: str, error: str | None = None) -> None:
    job.state, job.phase, job.error = state, phase, error
    job.finished_at = utcnow()
    job.eta_s = None


class _RowHooks:
    """Pipeline hooks that write to the job row, at most every HEARTBEAT_EVERY_S."""

    def __init__(self, job_id: int):
        self.job_id = job_id
        self._last_write = 0.0
        self._pending: dict = {}
        self._losses: list[list[float]] = []
        self._cancel = False
        self._settled: dict = {}  # the settings the job's dataset decided, for Job.params

    def hooks(self) -> Hooks:
        return Hooks(on_phase=self.on_phase, on_progress=self.on_progress,
                     should_cancel=self.should_cancel, on_settings=self.on_settings)

    def on_settings(self, settled: dict) -> None:
        self._settled.update(settled)
        self.flush()

    def on_phase(self, state: str, text: str) -> None:
        self._pending.update(state=state, phase=text)
        self.flush()

    def on_progress(self, p: dict) -> None:
        if p.get("loss") is not None:
            self._losses.append([int(p["step"]), round(float(p["loss"]), 5)])
        self._pending.update(step=int(p["step"]), total_steps=int(p["total_steps"]),
                             tokens_per_s=p.get("tokens_per_s"), eta_s=p.get("eta_s"))
        if p.get("telemetry") is not None:  # the offload engine's memory and disk figures
            self._pending["telemetry"] = p["telemetry"]
        if time.monotonic() - self._last_write >= HEARTBEAT_EVERY_S or p["step"] == p["total_steps"]:
            self.flush()

    def should_cancel(self) -> bool:
        if time.monotonic() - self._last_write >= HEARTBEAT_EVERY_S:
            self.flush()
        return self._cancel

    def flush(self) -> None:
        with session_scope() as session:
            job = session.get(Job, self.job_id)
            if job is None:
                self._cancel = True
                return
            for key, value in self._pending.items():
                setattr(job, key, value)
            if self._settled:
                job.params = {**job.params, **self._settled}
            if self._losses:
                # Resumed jobs replay from their checkpoint: keep one point per step.
                merged = {int(s): l for s, l in job.loss_history} | {s: l for s, l in self._losses}
                job.loss_history = [[s, merged[s]] for s in sorted(merged)]
            job.heartbeat_at = utcnow()
            self._cancel = job.cancel_requested
        self._pending.clear()
        self._settled.clear()
        self._losses.clear()
        self._last_write = time.monotonic()


def _peers(node: str, job_id: int):
    """Which other machines train this job with this one (DOCTUNE_TRAIN_NODES > 1): a
    function, asked when training starts and again after a lost machine; the workers it
    finds are reserved for the job until it ends (run_job releases them)."""
    if settings.train_nodes <= 1:
        return None
    from worker.distributed.nodes import PeerFinder

    return PeerFinder(settings.train_nodes - 1, node, job_id)


def run_job(job_id: int, node: str | None = None) -> str | None:
    """Run job `job_id` to a final state; returns that state (None if not ours to run)."""
    node = node or socket.gethostname()
    if not claim(job_id, node):
        return None
    with session_scope() as session:
        job = session.get(Job, job_id)
        params = dict(job.params)
        attempt = job.attempts  # names this run's rendezvous (a retried job gets another)
        # Incremental: new documents + a replay sample, from the previous version's adapter
        # (LoRA) or merged model (full fine-tuning).
        plan = plan_inputs(session, job, job_workdir(job_id))
        params.update(plan.params)
        docs = load_source_docs(session, plan.doc_ids)

    row = _RowHooks(job_id)
    workdir = job_workdir(job_id)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        if not docs:
            raise UserFacingError(
                "None of this job's documents has usable text any more. "
                "Upload documents, wait until they show as extracted, then train again."
            )
        budget = settings.offload_budget_mb * 2**20 if settings.offload_budget_mb else None
        result = run_pipeline(docs, params, settings.base_model, settings.models_dir, workdir,
                              row.hooks(), swap_dir=job_swap_dir(job_id), budget_bytes=budget,
                              start_adapter=plan.start_adapter,
                              start_model=plan.start_model,
                              stream_base=settings.stream_base_model,
                              device=settings.device,
                              processes=settings.train_processes,
                              parallel=settings.train_parallel,
                              peers=_peers(node, job_id), run_id=f"job{job_id}-{attempt}",
                              scores_cache=settings.data_dir / "cache" / "before-scores")
        record = JobResults.from_pipeline(result)  # each part in its app.contract shape
    except Cancelled:
        outcome = (JobState.cancelled, "Cancelled", None)
    except UserFacingError as exc:  # written for the user (worker.errors)
        outcome = (JobState.failed, "Failed", str(exc))
    except Exception as exc:  # the user gets words, the log gets the trace
        log.exception("job %s failed", job_id)
        (workdir / "error.log").write_text(traceback.format_exc(), encoding="utf-8")
        outcome = (JobState.failed, "Failed", _plain_error(exc))
    else:
        outcome = (JobState.done, "Done", None)

    row.flush()
    if settings.train_nodes > 1:  # the ranks released them; after a crash there, here
        from worker.distributed.nodes import release_peers

        release_peers(job_id)
    # The swap is scratch: a resumed job rebuilds it from its checkpoint.
    shutil.rmtree(job_swap_dir(job_id), ignore_errors=True)
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job is None:
            return None
        if outcome[0] == JobState.done:
            job.params = result["params"]
            job.scores, job.dataset = record.scores, record.dataset
            job.metrics, job.export_errors = record.metrics, record.export_errors
            # Relative to the data folder: a joined machine mounts it elsewhere (README).
            job.artifacts = {k: settings.stored_path(v) for k, v in result["artifacts"].items()}
            job.step = job.total_steps
            job.project.current_job_id = job.id  # a new version is the one in use
        _finish(session, job, *outcome)
    if outcome[0] == JobState.done:
        shutil.rmtree(workdir / "checkpoint", ignore_errors=True)  # the exports are what's kept
    return outcome[0]


# What the user reads when a job stops for a reason not written for them; the details are in
# the worker's log and the job's error.log.
INTERNAL_ERROR = (
    "Training stopped because something went wrong inside DocTune (the details are in the "
    "worker's log). Your documents and project are unaffected; you can train again."
)


def _plain_error(exc: Exception) -> str:
    """The job's error in words for an exception not raised as UserFacingError: what ran
    out, or the generic INTERNAL_ERROR (never the exception's own text)."""
    if isinstance(exc, OffloadBudgetError):  # the offload engine's own words, about memory
        return ("Training needs more memory than DocTune may use on this machine "
                f"({str(exc).splitlines()[0][:200]}). Try a shorter maximum sequence length, "
                "LoRA instead of full fine-tuning, or a larger DOCTUNE_OFFLOAD_BUDGET_MB.")
    exhausted = ran_out_of(exc)
    if exhausted == "disk":
        return ("The disk is full: training pages part of the model to the DocTune data "
                "folder. Free some space there and train again.")
    if exhausted == "memory":
        return ("Training ran out of memory. Try a shorter maximum sequence length or LoRA "
                "instead of full fine-tuning.")
    return INTERNAL_ERROR
