"""Reading one file of a watched folder that held still: the very file the scan saw.

What is opened is the path itself (never through a link at its end) or, for a link, the
place inside the inbox it led to when the scan looked; it must still be the same file
(device and inode), or it waits for the next scan. Nothing here blocks: stat does not open
a file, and `receive_local_file` opens without waiting and reads only a regular file, so a
FIFO (which blocks a plain open until something writes to it) stops nothing."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from app.services.inbox import InboxItem
from app.services.uploads import ReceivedFile, human_size, receive_local_file
from app.settings import settings
from app.watcher.scan import Seen, stat_seen
from app.watcher.state import Candidate, Inbox

log = logging.getLogger("doctune.watcher")


def read_candidate(inbox: Inbox, rel: str, *, retries: int, stable_s: float) -> InboxItem | None:
    """Copy one file that held still; None when it is not ready (changed, gone, locked,
    replaced since the scan). A file still unreadable after `retries` tries comes back as
    failed, with the reason."""
    cand = inbox.candidates[rel]
    seen = cand.seen
    assert seen is not None
    path = inbox.root / rel
    source = Path(seen.target) if seen.target else path
    try:
        before = stat_seen(os.stat(source, follow_symlinks=False), seen.target)
    except FileNotFoundError:
        del inbox.candidates[rel]
        return None
    except OSError as exc:
        reason = f"Could not read the file ({exc.strerror})."
        return _failed_read(inbox, rel, cand, reason, retries, stable_s)
    if before != seen or (seen.target and os.path.realpath(path) != seen.target):
        _rescan_first(inbox, rel, before)  # changed, replaced, or a link re-pointed
        return None
    if before.size > settings.max_upload_bytes:
        received = ReceivedFile(
            original_name=path.name,
            refused=f"Too large: the limit is {human_size(settings.max_upload_bytes)} per file.",
        )
    else:
        received = receive_local_file(
            source,
            dest_dir=settings.documents_dir,
            max_file_bytes=settings.max_upload_bytes,
            expect=seen.ident,
            name=path.name,
            within=inbox.root,
        )
    try:
        after = stat_seen(os.stat(source, follow_symlinks=False), seen.target)
    except OSError:
        after = None
    if after is None or after != before:  # written to (or replaced) while we read it
        if received.path is not None:
            received.path.unlink(missing_ok=True)
        if after is None:
            del inbox.candidates[rel]
        else:
            _rescan_first(inbox, rel, after)
        return None
    if received.retryable:
        return _failed_read(inbox, rel, cand, received.refused or "", retries, stable_s)
    return InboxItem(rel, received, before.size, before.mtime_ns)


def _rescan_first(inbox: Inbox, rel: str, now_seen: Seen) -> None:
    """The file changed since the scan: wait for it to hold still again, and for a scan to
    look at it (which file it is, where a link leads) before it is read."""
    inbox.candidates[rel] = Candidate(now_seen.sig, time.monotonic())
    inbox.event_at = time.monotonic()


def _failed_read(
    inbox: Inbox, rel: str, cand: Candidate, reason: str, retries: int, stable_s: float
) -> InboxItem | None:
    cand.attempts += 1
    if cand.attempts < retries:
        cand.not_before = time.monotonic() + stable_s * 2 ** (cand.attempts - 1)
        log.info("inbox %s: %r not readable yet (%s); will try again", inbox.root, rel, reason)
        return None
    log.warning(
        "inbox %s: giving up on %r after %d tries: %s", inbox.root, rel, cand.attempts, reason
    )
    size, mtime_ns = cand.sig[0], cand.sig[1]
    received = ReceivedFile(
        original_name=rel.rsplit("/", 1)[-1],
        refused=f"{reason} Tried {cand.attempts} times; DocTune tries again when the file changes.",
    )
    return InboxItem(rel, received, size, mtime_ns)
