"""The worker registry: each Celery worker's row in `workers` (app.models.Worker), read by the
admin's Workers page.

A worker registers when it is ready (worker/celery_app.py), refreshes its last_seen_at every
HEARTBEAT_EVERY_S from a daemon thread, and marks itself stopped when it shuts down. One that
dies without shutting down (killed, its machine lost) just stops refreshing, and the page
calls it offline ONLINE_WITHIN_S later.

A thread rather than Celery's `heartbeat_sent` signal: that signal rides on the worker's
event heartbeats, which do not run when events are off (`--without-heartbeat` with
`--without-gossip`), come every 2 s, and run on the consumer's own loop, where a slow database
would hold up the taking of tasks. The thread waits on an Event, so stopping it is immediate,
and as a daemon it never keeps the process from exiting."""

from __future__ import annotations

import logging
import socket
import threading
from importlib.metadata import PackageNotFoundError, version

from sqlalchemy import select, update

from app.contract.workers import HEARTBEAT_EVERY_S
from app.db import session_scope, utcnow
from app.models import Worker
from worker.hardware import detect

log = logging.getLogger(__name__)

# node -> the stop signal of its heartbeat thread (a process runs one Celery worker; tests
# may register several nodes in one process).
_heartbeats: dict[str, threading.Event] = {}


def doctune_version() -> str:
    try:
        return version("doctune")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def register(node: str, queues: list[str]) -> None:
    """Write (or rewrite, after a restart) `node`'s row: this machine, its queues and
    hardware, started and seen now."""
    now = utcnow()
    with session_scope() as session:
        row = session.scalar(select(Worker).where(Worker.node == node)) or Worker(node=node)
        row.host, row.queues = socket.gethostname(), sorted(queues)
        row.hardware, row.version = detect().model_dump(), doctune_version()
        row.started_at = row.last_seen_at = now
        row.stopped_at = None
        row.chat_stage_of = None  # a chat stage it held before a restart is gone
        session.add(row)


def beat(node: str) -> None:
    with session_scope() as session:
        session.execute(update(Worker).where(Worker.node == node).values(last_seen_at=utcnow()))


def mark_stopped(node: str) -> None:
    now = utcnow()
    with session_scope() as session:
        session.execute(update(Worker).where(Worker.node == node)
                        .values(last_seen_at=now, stopped_at=now))


def _beat_until(node: str, stop: threading.Event, every_s: float) -> None:
    while not stop.wait(every_s):
        try:
            beat(node)
        except Exception:  # a database that is away for a while must not end the heartbeat
            log.exception("could not refresh worker %s in the registry", node)


def start(node: str, queues: list[str], every_s: float = HEARTBEAT_EVERY_S) -> None:
    """Register `node` and keep its row fresh until `stop(node)`."""
    register(node, queues)
    stop_signal = _heartbeats[node] = threading.Event()
    threading.Thread(target=_beat_until, args=(node, stop_signal, every_s),
                     name=f"registry heartbeat {node}", daemon=True).start()


def stop(node: str) -> None:
    """End `node`'s heartbeat and mark it stopped (nothing if it never registered)."""
    stop_signal = _heartbeats.pop(node, None)
    if stop_signal is not None:
        stop_signal.set()
        mark_stopped(node)
