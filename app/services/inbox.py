"""The watched folder's side of documents: where a project's inbox is, and what a file found
there does to the project's documents.

A file in the inbox becomes a document through `register_uploads`, exactly as an upload
does (pending + extraction queued after the commit, or a duplicate). On top of that, a
document from the inbox remembers its path: editing the file adds a new version and retires
the old one, deleting the file retires its document, and moving or renaming it (same
content) keeps the document. Retired versions are kept with their files, never deleted."""

from __future__ import annotations

import os
import re
import unicodedata
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db import utcnow
from app.filetypes import kind_for_filename
from app.models import AutoTrain, DocStatus, Document, Project, Retired
from app.services.allowed_folders import allowed_folders, overlaps_data_dir
from app.services.documents import register_uploads
from app.services.errors import InvalidInput
from app.services.uploads import ReceivedFile
from app.settings import settings

# Characters Windows, macOS or a USB stick's FAT would refuse in a folder name.
_UNSAFE = re.compile(r'[<>:"/\\|?*\x00-\x1f\x7f]')
_RESERVED = {
    "con",
    "prn",
    "aux",
    "nul",
    *(f"com{i}" for i in range(1, 10)),
    *(f"lpt{i}" for i in range(1, 10)),
}

# The watcher writes inbox_checked_at at least this often while it runs.
HEARTBEAT_S = 30.0


def safe_folder_name(name: str, project_id: int) -> str:
    """A folder name for a project: its name, minus what a file system would refuse."""
    folder = _UNSAFE.sub("-", unicodedata.normalize("NFC", name))
    folder = "".join(ch for ch in folder if unicodedata.category(ch) not in ("Cc", "Cf"))
    folder = folder.strip().rstrip(". ")
    if not folder.strip("."):
        return f"project-{project_id}"
    if folder.split(".")[0].casefold() in _RESERVED:
        folder += "-"
    return folder


def inbox_folders(projects: Iterable[Project], root: Path) -> dict[int, Path]:
    """Each project's inbox. Two names that give the same folder (“a/b”, “a:b”, “Ab”, “ab” on
    a case-blind disk): the older project keeps it, the newer ones get their number added."""
    out: dict[int, Path] = {}
    taken: set[str] = set()
    for project in sorted(projects, key=lambda p: p.id):
        if project.inbox_path:
            out[project.id] = Path(project.inbox_path).expanduser()
            continue
        folder = safe_folder_name(project.name, project.id)
        if folder.casefold() in taken:
            folder = f"{folder} ({project.id})"
        taken.add(folder.casefold())
        out[project.id] = root / folder
    return out


def inbox_folder(session: Session, project: Project, root: Path) -> Path:
    return inbox_folders(session.scalars(select(Project)), root)[project.id]


# Where a watched folder may be

# What the watcher writes on the project (at most 200 characters) for a folder it refuses.
REFUSED_STATUS = (
    "DocTune may not watch this folder: it is outside the inbox folder and the allowed "
    "folders (DOCTUNE_ALLOWED_FOLDERS), so its files are not read."
)


def allowed_places(root: Path, allowed: Sequence[Path]) -> list[str]:
    """Where watched folders may be, for the page: the inbox root, then the allowed folders."""
    return [str(root), *(str(a) for a in allowed)]


def folder_refusal(folder: Path, root: Path, allowed: Sequence[Path]) -> str | None:
    """Why `folder` may not be watched, in words; None when it may. Every link resolved, it
    must lie inside the inbox root (not be the root itself, which holds every project's
    folder) or be, or lie inside, one of the `allowed` folders. Anything else (the home
    folder, /, /etc) would let whoever sets the folder read those files back."""
    real = Path(os.path.realpath(folder))
    real_root = Path(os.path.realpath(root))
    if real == real_root:
        return (
            f"{folder} holds the folders of every project. Choose a folder inside it, or leave "
            "the field empty for this project's own folder."
        )
    if real.is_relative_to(real_root) or any(
        real.is_relative_to(os.path.realpath(base)) for base in allowed
    ):
        if overlaps_data_dir(real):  # an allowed folder above the data dir, say
            return (
                f"{folder} holds DocTune's own data (its database and every upload) or lies "
                "inside it, so it cannot be watched. Choose another folder."
            )
        return None
    leads = "" if real == Path(os.path.normpath(folder)) else f" (it leads to {real})"
    places = " or inside ".join(allowed_places(root, allowed))
    return (
        f"DocTune only watches folders inside {places}; {folder}{leads} is not. Choose a "
        "folder there, or leave the field empty for this project's own folder. To use "
        "another folder, an admin adds it under Admin, Folders."
    )


# What the watcher reports


@dataclass
class InboxItem:
    """One complete file the watcher read (or failed to read) at `rel` in the inbox."""

    rel: str  # "/"-separated path inside the inbox
    received: ReceivedFile
    size: int
    mtime_ns: int


Effect = Literal["unchanged", "added", "version", "moved", "restored", "failed"]


@dataclass
class InboxResult:
    rel: str
    effect: Effect
    document_id: int | None
    message: str = ""
    moved_from: str | None = None  # "moved"/"restored": the path it had before


def register_inbox_files(
    session: Session, project: Project, items: list[InboxItem], missing: set[str]
) -> list[InboxResult]:
    """Record what the watcher found, in order; `missing` holds the paths of documents whose
    files are gone from the inbox right now (a file with their content is theirs, moved).

    The copies in `items` are kept (as new documents) or deleted (content already known)."""
    now = utcnow()
    docs = list(project.documents)
    active: dict[str, Document] = {}
    max_version: dict[str, int] = {}
    by_sha: dict[str, list[Document]] = {}
    for doc in docs:
        if doc.source_path is None:
            continue
        max_version[doc.source_path] = max(max_version.get(doc.source_path, 0), doc.version)
        if doc.retired_at is None:
            active[doc.source_path] = doc
        if doc.sha256:
            by_sha.setdefault(doc.sha256, []).append(doc)

    results: list[InboxResult | None] = []
    new: list[tuple[int, InboxItem]] = []  # (index in results, item) for register_uploads
    failed: list[tuple[int, Document]] = []  # rows whose ids are known after the flush
    for item in items:
        current = active.get(item.rel)
        received = item.received
        if received.refused is not None or received.path is None:
            reason = received.refused or "Could not read the file."
            if current is not None and not current.sha256 and current.error == reason:
                current.source_mtime_ns, current.size_bytes = item.mtime_ns, item.size
                current.last_seen_at = now
                results.append(InboxResult(item.rel, "unchanged", current.id, reason))
                continue
            version = max_version.get(item.rel, 0) + 1
            if current is not None:
                _retire(current, Retired.replaced, now)
            doc = _failed_document(project, item, reason, version, now)
            session.add(doc)
            active[item.rel], max_version[item.rel] = doc, version
            project.last_change_at = now
            results.append(None)
            failed.append((len(results) - 1, doc))
            continue

        sha = received.sha256
        if current is not None and current.sha256 == sha:  # touched, or saved unchanged
            received.path.unlink(missing_ok=True)
            current.source_mtime_ns, current.last_seen_at = item.mtime_ns, now
            results.append(InboxResult(item.rel, "unchanged", current.id))
            continue
        if current is None:
            moved = _moved_from(by_sha.get(sha, []), missing)
            if moved is not None:
                received.path.unlink(missing_ok=True)
                effect: Effect = "restored" if moved.retired_at is not None else "moved"
                old_path = moved.source_path
                if active.get(old_path) is moved:
                    del active[old_path]
                missing.discard(old_path)
                moved.source_path, moved.source_mtime_ns = item.rel, item.mtime_ns
                moved.last_seen_at = now
                if moved.retired_at is not None:
                    moved.retired_at = moved.retired_reason = None
                    project.last_change_at = now
                active[item.rel] = moved
                results.append(
                    InboxResult(item.rel, effect, moved.id, f"from {old_path}", old_path)
                )
                continue
        if current is not None:
            _retire(current, Retired.replaced, now)
            del active[item.rel]
        results.append(None)
        new.append((len(results) - 1, item))

    if failed:
        session.flush()
    for index, doc in failed:
        results[index] = InboxResult(doc.source_path or "", "failed", doc.id, doc.error or "")
    if new:
        outcomes = register_uploads(session, project, [item.received for _, item in new])
        for (index, item), outcome in zip(new, outcomes, strict=True):
            doc = session.get(Document, outcome.document_id) if outcome.document_id else None
            if doc is None:  # refused on the way in: cannot happen for a received file
                results[index] = InboxResult(item.rel, "failed", None, outcome.message)
                continue
            version = max_version.get(item.rel, 0) + 1
            doc.source_path, doc.version = item.rel, version
            doc.source_mtime_ns, doc.last_seen_at = item.mtime_ns, now
            active[item.rel], max_version[item.rel] = doc, version
            by_sha.setdefault(doc.sha256, []).append(doc)
            results[index] = InboxResult(
                item.rel, "version" if version > 1 else "added", doc.id, outcome.message
            )
        project.last_change_at = now
    return [r for r in results if r is not None]


def _moved_from(same_content: list[Document], missing: set[str]) -> Document | None:
    """The document a file with this content was moved or renamed from, if any: an active
    one whose file is gone, else one retired because its file was deleted (a move noticed in
    two steps, or a file put back from the bin)."""
    gone = [d for d in same_content if d.retired_at is None and d.source_path in missing]
    if gone:
        return max(gone, key=lambda d: d.id)
    deleted = [d for d in same_content if d.retired_reason == Retired.deleted]
    if deleted:
        return max(deleted, key=lambda d: (d.retired_at, d.id))
    return None


def _retire(doc: Document, reason: Retired, now: datetime) -> None:
    doc.retired_at, doc.retired_reason = now, reason


def _failed_document(
    project: Project, item: InboxItem, reason: str, version: int, now: datetime
) -> Document:
    """A row for a file that could not be taken (unsupported, too large, unreadable), so the
    page shows it with the reason; it has no stored copy and no content hash."""
    name = item.rel.rsplit("/", 1)[-1]
    return Document(
        project=project,
        original_name=name.replace("\x00", "\ufffd"),
        stored_name=f"{uuid.uuid4().hex}.none",
        kind=(kind_for_filename(name) or name.rpartition(".")[2][:16].lower() or "file")
        if "." in name
        else "file",
        size_bytes=item.size,
        sha256="",
        status=DocStatus.failed,
        error=reason,
        source_path=item.rel,
        version=version,
        source_mtime_ns=item.mtime_ns,
        last_seen_at=now,
        extracted_at=now,
    )


def retire_missing(session: Session, project: Project, paths: Iterable[str]) -> list[int]:
    """Retire the active documents of files deleted from the inbox; returns their ids."""
    wanted = set(paths)
    now = utcnow()
    retired = []
    for doc in project.documents:
        if doc.retired_at is None and doc.source_path in wanted:
            _retire(doc, Retired.deleted, now)
            retired.append(doc.id)
    if retired:
        project.last_change_at = now
        session.flush()
    return retired


# Settings on the project page

QUIET_MINUTES = (1, 24 * 60)


@dataclass
class InboxSettings:
    inbox_path: str | None
    auto_train: str
    auto_quiet_s: int
    auto_nightly_at: str
    start_from: str


def parse_inbox_form(
    form: dict[str, str], allowed: Sequence[Path] | None = None
) -> InboxSettings:
    """The watched-folder form: folder (empty: the default), auto-train mode, quiet minutes,
    nightly time, and where new jobs start. Raises InvalidInput with one message per field.
    `allowed`: the allowed folders (default: DOCTUNE_ALLOWED_FOLDERS only)."""
    allowed = settings.allowed_folders if allowed is None else allowed
    errors: dict[str, str] = {}
    raw_path = (form.get("inbox_path") or "").strip()
    inbox_path: str | None = None
    if raw_path:
        path = Path(raw_path).expanduser()
        if not path.is_absolute():
            errors["inbox_path"] = "Please give the folder's full path, e.g. /home/me/Documents."
        elif "\x00" in raw_path or len(raw_path) > 1000:
            errors["inbox_path"] = "This folder path cannot be used."
        elif refusal := folder_refusal(path, settings.inbox_dir, allowed):
            errors["inbox_path"] = refusal
        else:
            inbox_path = str(path)
    mode = (form.get("auto_train") or AutoTrain.off).strip()
    if mode not in AutoTrain.__members__:
        errors["auto_train"] = "Please choose off, after changes, or nightly."
    quiet_s = 600
    raw_quiet = (form.get("auto_quiet_min") or "10").strip()
    try:
        minutes = float(raw_quiet.replace(",", "."))
        if not QUIET_MINUTES[0] <= minutes <= QUIET_MINUTES[1]:
            raise ValueError
        quiet_s = round(minutes * 60)
    except ValueError:
        errors["auto_quiet_min"] = (
            f"The quiet time must be a number of minutes from {QUIET_MINUTES[0]} to "
            f"{QUIET_MINUTES[1]}."
        )
    nightly = (form.get("auto_nightly_at") or "02:00").strip()
    match = re.fullmatch(r"(\d{1,2}):(\d{2})", nightly)
    if not match or int(match[1]) > 23 or int(match[2]) > 59:
        errors["auto_nightly_at"] = "Please give the time as hours:minutes, e.g. 02:00."
    else:
        nightly = f"{int(match[1]):02d}:{match[2]}"
    start_from = (form.get("start_from") or "latest").strip()
    if start_from not in ("latest", "base"):
        errors["start_from"] = "Please choose the latest tuned version or the base model."
    if errors:
        raise InvalidInput("Some watched-folder settings need a fix.", errors)
    return InboxSettings(inbox_path, mode, quiet_s, nightly, start_from)


def update_inbox_settings(session: Session, project: Project, form: dict[str, str]) -> Project:
    wanted = parse_inbox_form(form, allowed_folders(session))
    if wanted.inbox_path != project.inbox_path:
        project.inbox_status, project.inbox_checked_at = None, None  # the watcher looks again
    project.inbox_path = wanted.inbox_path
    if wanted.auto_train == AutoTrain.nightly and (
        wanted.auto_train != project.auto_train or wanted.auto_nightly_at != project.auto_nightly_at
    ):
        project.auto_fired_at = utcnow()  # the first look is at the next set time, not now
    project.auto_train = wanted.auto_train
    project.auto_quiet_s = wanted.auto_quiet_s
    project.auto_nightly_at = wanted.auto_nightly_at
    project.start_from = wanted.start_from
    session.flush()
    return project


@dataclass
class InboxView:
    """The watched-folder panel of the project page."""

    path: str
    custom: bool
    state: Literal["ok", "missing", "refused", "unchecked", "no-watcher"]
    message: str | None
    auto_train: str
    auto_quiet_min: float
    auto_nightly_at: str
    start_from: str
    allowed: list[str]  # where a watched folder may be


def inbox_view(
    session: Session, project: Project, root: Path, now: datetime | None = None
) -> InboxView:
    now = now or utcnow()
    path = inbox_folder(session, project, root)
    status = project.inbox_status
    checked = project.inbox_checked_at
    allowed = allowed_folders(session)
    refusal = folder_refusal(path, root, allowed)
    if refusal is not None:
        state, message = "refused", f"{refusal} This folder is not watched."
    elif checked is None:
        state, message = (
            "unchecked",
            (
                "The folder watcher has not looked at this folder yet. It starts with DocTune "
                "(make up); if it keeps saying this, the watcher is not running."
            ),
        )
    elif now - checked > timedelta(seconds=3 * HEARTBEAT_S):
        state, message = (
            "no-watcher",
            (
                "The folder watcher is not running, so files put in this folder are not picked up "
                "right now. Restart DocTune (make up) to start it."
            ),
        )
    elif status and status != "ok":
        state, message = "missing", status
    else:
        state, message = "ok", None
    return InboxView(
        path=str(path),
        custom=project.inbox_path is not None,
        state=state,
        message=message,
        auto_train=project.auto_train,
        auto_quiet_min=round(project.auto_quiet_s / 60, 1),
        auto_nightly_at=project.auto_nightly_at,
        start_from=project.start_from,
        allowed=allowed_places(root, allowed),
    )
