"""The Celery worker application: `celery -A worker.celery_app worker -Q train|ingest`."""

from __future__ import annotations

import logging

from celery.signals import worker_ready

from app.contract.tasks import INGEST_QUEUE, TRAIN_QUEUE
from app.queue import make_celery

celery = make_celery("doctune-worker")
celery.conf.update(
    include=["worker.tasks"],
    worker_hijack_root_logger=False,
    worker_max_tasks_per_child=50,  # torch caches are returned to the OS now and then
)


@worker_ready.connect
def _reconcile_on_start(sender, **_kwargs) -> None:
    """A train worker that starts resumes jobs left running by a crashed one; an ingest
    worker fails the documents a crashed one was reading."""
    queues = {q.name for q in sender.app.amqp.queues.consume_from.values()} if sender else set()
    if INGEST_QUEUE in queues:
        from worker.reconcile import fail_abandoned_reads

        fail_abandoned_reads()
    if TRAIN_QUEUE in queues:
        from worker.reconcile import requeue_orphaned_jobs

        requeue_orphaned_jobs(node=sender.hostname)
        _measure_machine()


def _measure_machine() -> None:
    """Measure disk and CPU speed once, in a child process, for the Train button's estimate."""
    from worker.training.machine_profile import start_measuring

    try:
        start_measuring()
    except Exception:  # an estimate is a nicety: never keep the worker from starting
        logging.getLogger(__name__).exception("could not start measuring this machine")
