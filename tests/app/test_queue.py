"""Celery set for long jobs (app/queue.py): late acknowledgement, one task at a time, and a
visibility timeout taken from the settings (DOCTUNE_VISIBILITY_TIMEOUT_S)."""

from __future__ import annotations

from app.queue import make_celery
from app.settings import Settings, settings


def test_celery_holds_a_long_job_and_the_visibility_timeout_is_the_setting(monkeypatch):
    monkeypatch.delenv("DOCTUNE_VISIBILITY_TIMEOUT_S", raising=False)
    assert Settings(_env_file=None).visibility_timeout_s == 7 * 24 * 3600  # Redis' own: 1 h
    monkeypatch.setenv("DOCTUNE_VISIBILITY_TIMEOUT_S", "90000")
    assert Settings(_env_file=None).visibility_timeout_s == 90000

    monkeypatch.setattr(settings, "visibility_timeout_s", 1234)
    conf = make_celery().conf
    assert conf.broker_transport_options["visibility_timeout"] == 1234
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
