"""The watcher's loop: projects -> folders -> scans -> documents, plus auto-train (see the
package docstring for what counts as a finished file)."""


from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator

from sqlalchemy import select, update
from watchdog.observers import Observer

from app import audit
from app.audit import Action
from app.db import session_scope, utcnow
from app.models import AutoTrain, Document, Project
from app.services.allowed_folders import allowed_folders
from app.services.autotrain import auto_train_step
from app.services.inbox import (
    HEARTBEAT_S,
    REFUSED_STATUS,
    InboxItem,
    folder_refusal,
    inbox_folders,
    register_inbox_files,
    retire_missing,
)
from app.settings import settings
from app.watcher.read import read_candidate
from app.watcher.scan import Scan, scan_folder
from app.watcher.state import Candidate, Events, Inbox, Known

log = logging.getLogger("doctune.watcher")

BATCH = 100  # files read and recorded per transaction
REFRESH_PROJECTS_S = 1.0  # how often the list of projects (and their folders) is reread
AUTO_EVERY_S = 1.0  # how often auto-train looks at the projects that use it
STATUS_EVERY_S = HEARTBEAT_S / 2


class Watcher:
    """The loop: projects -> folders -> scans -> documents, plus auto-train."""

    def __init__(self) -> None:
        self.stable_s = settings.watch_stable_s
        self.rescan_s = settings.watch_rescan_s
        self.retries = max(1, settings.watch_retries)
        self.debounce_s = min(1.0, self.stable_s / 2)
        self.tick_s = min(0.5, self.stable_s / 3)
        self.wake = threading.Event()
        self.observer = Observer()
        self.inboxes: dict[int, Inbox] = {}
        self.projects_read = 0.0
        self.auto_at = 0.0
        self.auto_projects: set[int] = set()

    # The loop

    def run(self, stop: threading.Event) -> None:
        self.observer.start()
        log.info(
            "watching %s (stable after %.1f s, rescan every %.0f s)",
            settings.inbox_dir,
            self.stable_s,
            self.rescan_s,
        )
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except Exception:  # the watcher never dies: log, wait a moment, go on
                    log.exception("watcher step failed; trying again")
                    stop.wait(1.0)
                self.wake.wait(self.tick_s)
                self.wake.clear()
        finally:
            self.observer.stop()
            self.observer.join(timeout=5)

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.projects_read >= REFRESH_PROJECTS_S:
            self.read_projects()
            self.projects_read = now
        for inbox in list(self.inboxes.values()):
            try:
                self.step(inbox)
            except Exception:
                log.exception("inbox of project %s: step failed", inbox.project_id)
        if self.auto_projects and time.monotonic() - self.auto_at >= AUTO_EVERY_S:
            self.auto_at = time.monotonic()
            self.auto_train()

    def read_projects(self) -> None:
        created: list[int] = []
        with session_scope() as session:
            projects = list(session.scalars(select(Project)))
            folders = inbox_folders(projects, settings.inbox_dir)
            for project in projects:
                if project.inbox_status is None and project.inbox_path is None:
                    created.append(project.id)  # a new project: make its default folder once
            self.auto_projects = {p.id for p in projects if p.auto_train != AutoTrain.off}
            allowed = allowed_folders(session)
        for project_id in set(self.inboxes) - set(folders):
            self._unwatch(self.inboxes.pop(project_id))
        for project_id, root in folders.items():
            inbox = self.inboxes.get(project_id)
            if inbox is not None and inbox.root != root:
                self._unwatch(inbox)
                inbox = None
            if inbox is None:
                inbox = self.inboxes[project_id] = Inbox(project_id, root)
            # Checked on every read, not only when the folder was set: a link changed since,
            # or a folder taken off the allowed ones, stops the watching.
            inbox.refused = folder_refusal(root, settings.inbox_dir, allowed)
            if inbox.refused is not None:
                continue
            if project_id in created:
                try:
                    root.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    log.warning("cannot create inbox %s: %s", root, exc)

    # One inbox

    def step(self, inbox: Inbox) -> None:
        now = time.monotonic()
        if inbox.refused is not None:
            self._unwatch(inbox)
            inbox.candidates.clear()
            inbox.missing_since.clear()
            if inbox.refused not in inbox.logged_skips:
                inbox.logged_skips.add(inbox.refused)
                log.warning("inbox %s: not watched: %s", inbox.root, inbox.refused)
            self._set_status(inbox, REFUSED_STATUS)
            return
        try:
            st = os.stat(inbox.root)
            present = stat.S_ISDIR(st.st_mode)
        except OSError:
            present = False
        if not present:
            self._unwatch(inbox)
            inbox.candidates.clear()
            inbox.missing_since.clear()
            self._set_status(
                inbox,
                (
                    f"The folder {inbox.root} is missing: it was deleted or renamed, or its drive "
                    "is not connected. Documents already added are kept; DocTune picks the "
                    "folder up again as soon as it is back."
                ),
            )
            return
        if (st.st_dev, st.st_ino) != inbox.root_id:  # new, or deleted and made again
            self._unwatch(inbox)
            try:
                inbox.watch = self.observer.schedule(
                    Events(inbox, self.wake), str(inbox.root), recursive=True
                )
            except Exception as exc:  # noqa: BLE001  (e.g. the inotify limit: scans still work)
                log.warning(
                    "no file events for %s (%s); rescanning every %.0f s",
                    inbox.root,
                    exc,
                    self.rescan_s,
                )
            inbox.root_id = (st.st_dev, st.st_ino)
            inbox.event_at = now
        self._set_status(inbox, "ok")

        if now - inbox.known_loaded >= self.rescan_s:
            self._load_known(inbox)
        scan_due = now - inbox.scanned_at >= self.rescan_s or (
            inbox.event_at >= inbox.scanned_at and now - inbox.scanned_at >= self.debounce_s
        )
        if scan_due:
            inbox.scanned_at = now
            self._apply_scan(inbox, scan_folder(inbox.root), now)
        self._take_stable(inbox)
        self._retire_deleted(inbox)

    def _apply_scan(self, inbox: Inbox, found: Scan, now: float) -> None:
        for rel, reason in found.skipped.items():
            if rel not in inbox.logged_skips:
                inbox.logged_skips.add(rel)
                log.info("inbox %s: ignoring %r: %s", inbox.root, rel, reason)
        for problem in found.problems:
            if problem not in inbox.logged_skips:
                inbox.logged_skips.add(problem)
                log.warning("inbox %s: cannot read sub-folder %r", inbox.root, problem)
        for rel, seen in found.files.items():
            known = inbox.known.get(rel)
            if known is not None and known.matches(seen):
                inbox.candidates.pop(rel, None)
                continue
            cand = inbox.candidates.get(rel)
            if cand is None or cand.sig != seen.sig:
                inbox.candidates[rel] = Candidate(seen.sig, now, seen=seen)
            elif cand.seen != seen:  # same size and times, but another file (or link target)
                cand.seen = seen
        for rel in list(inbox.candidates):
            if rel not in found.files:
                del inbox.candidates[rel]  # gone before it was complete
        for rel in inbox.known:
            if rel in found.files:
                inbox.missing_since.pop(rel, None)
            else:
                inbox.missing_since.setdefault(rel, now)
        if now - inbox.seen_written >= settings.watch_seen_every_s:
            present = [k.doc_id for rel, k in inbox.known.items() if rel in found.files]
            _touch_seen(present)
            inbox.seen_written = now

    def _take_stable(self, inbox: Inbox) -> None:
        """Read the files that held still, BATCH at a time, and record them."""
        while True:
            now = time.monotonic()
            due = sorted(
                rel
                for rel, c in inbox.candidates.items()
                if now - c.since >= self.stable_s and now >= c.not_before and c.seen is not None
            )
            if not due:
                return
            items: list[InboxItem] = []
            for rel in due:
                if len(items) >= BATCH:
                    break
                item = self._read(inbox, rel)
                if item is not None:
                    items.append(item)
            if items:
                self._record(inbox, items)
            if len(due) <= BATCH:
                return

    def _read(self, inbox: Inbox, rel: str) -> InboxItem | None:
        """Copy one file that held still; None when it is not ready (see app/watcher/read.py)."""
        return read_candidate(inbox, rel, retries=self.retries, stable_s=self.stable_s)

    def _record(self, inbox: Inbox, items: list[InboxItem]) -> None:
        try:
            with session_scope() as session:
                project = session.get(Project, inbox.project_id)
                if project is None:
                    raise LookupError("project deleted")
                results = register_inbox_files(session, project, items, set(inbox.missing_since))
                if read := [r.rel for r in results if r.effect in ("added", "version", "failed")]:
                    audit.record(session, Action.folder_read, actor=audit.WATCHER,
                                 subject=f"project “{project.name}”", detail=audit.listed(read))
                docs = {d.id: d for d in project.documents}
                updates = {}
                ctimes = {rel: c.sig[2] for rel, c in inbox.candidates.items()}
                for res in results:
                    doc = docs.get(res.document_id) if res.document_id else None
                    if doc is not None:
                        updates[res.rel] = Known(
                            doc.id,
                            doc.size_bytes,
                            doc.source_mtime_ns,
                            not doc.sha256,
                            ctimes.get(res.rel),
                        )
                    if res.moved_from:
                        updates[res.moved_from] = None
        except Exception:
            log.exception("inbox %s: could not record %d files; will retry", inbox.root, len(items))
            for item in items:
                if item.received.path is not None:
                    item.received.path.unlink(missing_ok=True)
                cand = inbox.candidates.get(item.rel)
                if cand is not None:
                    cand.not_before = time.monotonic() + 1.0
            return
        for rel, known in updates.items():
            if known is None:
                inbox.known.pop(rel, None)
                inbox.missing_since.pop(rel, None)
            else:
                inbox.known[rel] = known
        for item in items:
            inbox.candidates.pop(item.rel, None)
        for res in results:
            if res.effect != "unchanged":
                log.info(
                    "inbox %s: %s %r%s",
                    inbox.root,
                    res.effect,
                    res.rel,
                    f" ({res.message})" if res.message else "",
                )

    def _retire_deleted(self, inbox: Inbox) -> None:
        now = time.monotonic()
        gone = [
            rel
            for rel, since in inbox.missing_since.items()
            if now - since >= self.stable_s and not os.path.lexists(inbox.root / rel)
        ]
        if not gone:
            return
        with session_scope() as session:
            project = session.get(Project, inbox.project_id)
            if project is None:
                return
            retire_missing(session, project, gone)
        for rel in gone:
            inbox.known.pop(rel, None)
            inbox.missing_since.pop(rel, None)
            log.info("inbox %s: retired %r (file deleted)", inbox.root, rel)

    def _load_known(self, inbox: Inbox) -> None:
        with session_scope() as session:
            rows = session.execute(
                select(
                    Document.id,
                    Document.source_path,
                    Document.size_bytes,
                    Document.source_mtime_ns,
                    Document.sha256,
                ).where(
                    Document.project_id == inbox.project_id,
                    Document.retired_at.is_(None),
                    Document.source_path.is_not(None),
                )
            ).all()
        old = inbox.known
        inbox.known = {}
        for doc_id, path, size, mtime, digest in rows:
            ctime = old[path].ctime_ns if path in old and old[path].doc_id == doc_id else None
            inbox.known[path] = Known(doc_id, size, mtime, not digest, ctime)
        inbox.missing_since = {
            rel: t for rel, t in inbox.missing_since.items() if rel in inbox.known
        }
        inbox.known_loaded = time.monotonic()

    def _set_status(self, inbox: Inbox, status: str) -> None:
        now = time.monotonic()
        if status == inbox.status and now - inbox.status_written < STATUS_EVERY_S:
            return
        if status != inbox.status:
            (log.info if status == "ok" else log.warning)("inbox %s: %s", inbox.root, status)
        with session_scope() as session:
            session.execute(
                update(Project)
                .where(Project.id == inbox.project_id)
                .values(inbox_status=status[:200], inbox_checked_at=utcnow())
            )
        inbox.status, inbox.status_written = status, now

    def _unwatch(self, inbox: Inbox) -> None:
        if inbox.watch is not None:
            try:
                self.observer.unschedule(inbox.watch)
            except Exception as exc:  # noqa: BLE001  (already gone with its folder)
                log.debug("unschedule %s: %s", inbox.root, exc)
            inbox.watch = None
        inbox.root_id = None

    # Auto-train

    def auto_train(self) -> None:
        for project_id in sorted(self.auto_projects):
            try:
                with session_scope() as session:
                    project = session.get(Project, project_id)
                    if project is None:
                        continue
                    step = auto_train_step(session, project, utcnow())
                if step.action in ("queued", "absorbed"):
                    log.info(
                        "project %s: auto-train %s job %s", project_id, step.action, step.job_id
                    )
            except Exception:
                log.exception("auto-train of project %s failed; trying again", project_id)


def _chunks(ids: list[int], n: int = 500) -> Iterator[list[int]]:
    for i in range(0, len(ids), n):
        yield ids[i : i + n]


def _touch_seen(doc_ids: list[int]) -> None:
    if not doc_ids:
        return
    now = utcnow()
    with session_scope() as session:
        for chunk in _chunks(doc_ids):
            session.execute(
                update(Document)
                .where(Document.id.in_(chunk))
                .values(last_seen_at=now)
                .execution_options(synchronize_session=False)
            )


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()

    def _stop(*_args) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    settings.inbox_dir.mkdir(parents=True, exist_ok=True)
    Watcher().run(stop)
    return 0

