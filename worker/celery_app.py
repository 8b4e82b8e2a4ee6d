"""The Celery worker application: `celery -A worker.celery_app worker -Q train|ingest|chat`."""

from __future__ import annotations

import logging

from celery.signals import celeryd_after_setup, worker_process_init, worker_ready, worker_shutdown

from app.contract.tasks import INGEST_QUEUE, TRAIN_QUEUE, node_host, node_queue
from app.db import get_engine
from app.queue import make_celery
from worker import registry

log = logging.getLogger(__name__)
_measuring = None  # the machine measurement's child process, ended when the worker stops

celery = make_celery("doctune-worker")
celery.conf.update(
    include=["worker.tasks"],
    worker_hijack_root_logger=False,
    worker_max_tasks_per_child=50,  # torch caches are returned to the OS now and then
)


def _queues(app) -> set[str]:
    return {q.name for q in app.amqp.queues.consume_from.values()}


@celeryd_after_setup.connect
def _consume_node_queue(sender, instance, **_kwargs) -> None:
    """A train worker also consumes its machine's own queue (app.contract.tasks.node_queue),
    so that a part of a job can be sent to this machine. Added here, after -Q is applied (the
    way Celery's documentation adds a per-node queue), so every way of starting a train worker
    has it: `doctune up`, `doctune worker [--join]`, docker compose, celery by hand."""
    if TRAIN_QUEUE in _queues(instance.app):
        instance.app.amqp.queues.select_add(node_queue(node_host(sender)))


@worker_ready.connect
def _on_ready(sender, **_kwargs) -> None:
    """Every worker registers itself (worker/registry.py). A train worker that starts resumes
    jobs left running by a crashed one; an ingest worker fails the documents a crashed one was
    reading."""
    queues = _queues(sender.app)
    _register(sender.hostname, queues)
    if INGEST_QUEUE in queues:
        from worker.reconcile import fail_abandoned_reads

        fail_abandoned_reads()
    if TRAIN_QUEUE in queues:
        from worker.reconcile import requeue_orphaned_jobs

        requeue_orphaned_jobs(node=sender.hostname)
        _measure_machine()


@worker_shutdown.connect
def _on_shutdown(sender, **_kwargs) -> None:
    if _measuring is not None:
        from worker.training.machine_profile import stop_measuring

        stop_measuring(_measuring)
    try:
        registry.stop(sender.hostname)
    except Exception:  # the page will call it offline a little later instead of stopped
        log.exception("could not mark this worker stopped in the registry")


@worker_process_init.connect
def _fresh_connections(**_kwargs) -> None:
    """A pool child starts its own database connections: the parent keeps using the ones it
    made (the start-up reconciling, the registry's heartbeat thread), and a connection or a
    pool lock shared across fork breaks both sides. SQLAlchemy's advice for fork: dispose
    without closing, so the parent's connections stay good."""
    get_engine().dispose(close=False)


def _register(node: str, queues: set[str]) -> None:
    try:
        registry.start(node, sorted(queues))
    except Exception:  # the admin's list is a nicety: never keep the worker from starting
        log.exception("could not register this worker")


def _measure_machine() -> None:
    """Measure disk and CPU speed once, in a child process, for the Train button's estimate."""
    from worker.training.machine_profile import start_measuring

    global _measuring
    try:
        _measuring = start_measuring()
    except Exception:  # an estimate is a nicety: never keep the worker from starting
        log.exception("could not start measuring this machine")
