"""What the watcher knows about one project's folder between scans: the files waiting to
hold still (`Candidate`), the documents it already has (`Known`), and the watchdog callback
that wakes the loop when the folder changes (`Events`)."""


from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler

from app.watcher.scan import Seen, ignore_reason

# One project's inbox


@dataclass
class Candidate:
    """A file that is new or changed, waiting to hold still (or to be readable)."""

    sig: tuple[int, int, int]
    since: float  # monotonic time the signature was first seen
    attempts: int = 0  # failed reads so far
    not_before: float = 0.0  # retry no earlier than this
    # The file as the last scan saw it (which file, where a link led); None: changed since,
    # so not read before the next scan has looked at it again.
    seen: Seen | None = None


@dataclass
class Known:
    """An active inbox document: the file at its path is unchanged when size and mtime match.
    A file that could not be read (no content hash) is looked at again on any change,
    permissions included (the change time tells), and once after each watcher start."""

    doc_id: int
    size: int
    mtime_ns: int | None
    unread: bool = False
    ctime_ns: int | None = None

    def matches(self, seen: Seen) -> bool:
        same = (self.size, self.mtime_ns) == (seen.size, seen.mtime_ns)
        return same and (not self.unread or self.ctime_ns == seen.ctime_ns)


class Events(FileSystemEventHandler):
    """watchdog callback (its own thread): mark the inbox for a rescan and wake the loop."""

    def __init__(self, inbox: Inbox, wake: threading.Event) -> None:
        self.inbox = inbox
        self.wake = wake

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        names = [os.path.basename(os.fsdecode(p)) for p in (event.src_path, event.dest_path) if p]
        if not event.is_directory and names and all(ignore_reason(n) for n in names):
            return  # lock and temporary files come and go without changing anything
        self.inbox.event_at = time.monotonic()
        self.wake.set()


class Inbox:
    """What the watcher knows about one project's folder between scans."""

    def __init__(self, project_id: int, root: Path) -> None:
        self.project_id = project_id
        self.root = root
        self.watch = None  # watchdog's handle while events are on
        self.root_id: tuple[int, int] | None = None  # (device, inode) the watch was set on
        self.refused: str | None = None  # why the folder may not be watched, if it may not
        self.status: str | None = None
        self.status_written = 0.0
        self.candidates: dict[str, Candidate] = {}
        self.known: dict[str, Known] = {}
        self.known_loaded = 0.0
        self.missing_since: dict[str, float] = {}
        self.logged_skips: set[str] = set()
        self.event_at = time.monotonic()  # a first scan straight away
        self.scanned_at = 0.0
        self.seen_written = 0.0


