"""The app's session listeners (tasks sent after the commit, new files removed on a rollback)
act on the app's own sessions only: a session made elsewhere in the process is left alone."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.contract.tasks import TRAIN_QUEUE, TRAIN_TASK
from app.db import get_engine, session_factory
from app.queue import enqueue_after_commit
from app.services.documents import _track_new_file


def _sessions() -> tuple[Session, Session]:
    """(one of the app's sessions, a plain Session on the same engine), each in a transaction."""
    own, foreign = session_factory()(), Session(get_engine())
    for session in (own, foreign):
        session.execute(text("SELECT 1"))
    return own, foreign


def test_tasks_leave_on_the_commit_of_the_apps_sessions_only(env):
    own, foreign = _sessions()
    try:
        enqueue_after_commit(foreign, TRAIN_TASK, 1)
        foreign.commit()
        assert env.queue_length(TRAIN_QUEUE) == 0
        enqueue_after_commit(own, TRAIN_TASK, 2)
        own.commit()
        assert env.queue_length(TRAIN_QUEUE) == 1
    finally:
        own.close()
        foreign.close()


def test_a_rollback_removes_the_new_files_of_the_apps_sessions_only(env, tmp_path):
    kept, removed = tmp_path / "kept.txt", tmp_path / "removed.txt"
    for path in (kept, removed):
        path.write_text("uploaded")
    own, foreign = _sessions()
    try:
        _track_new_file(foreign, kept)
        foreign.rollback()
        _track_new_file(own, removed)
        own.rollback()
    finally:
        own.close()
        foreign.close()
    assert kept.is_file() and not removed.exists()
