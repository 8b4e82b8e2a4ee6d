"""Where a project's watched folder may be: the inbox root, the folders in
DOCTUNE_ALLOWED_FOLDERS (set by whoever runs DocTune) and the folders an admin adds on
/admin/folders. app/services/inbox.py's folder_refusal applies the list, when a folder is set
and again on every scan."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import AllowedFolder
from app.services.errors import InvalidInput, NotFound
from app.settings import settings


def allowed_folders(session: Session) -> list[Path]:
    """The configured folders, then the admin's, in the order they were added."""
    added = session.scalars(select(AllowedFolder.path).order_by(AllowedFolder.id))
    return [*settings.allowed_folders, *(Path(p) for p in added)]


def overlaps_data_dir(folder: Path) -> bool:
    """Whether `folder` (links resolved) holds DocTune's data folder or lies inside it: its
    database, Redis password and every project's uploads must never be read as documents.
    The inbox root is the one place inside it that may be watched (when it is put there)."""
    real = Path(os.path.realpath(folder))
    data = Path(os.path.realpath(settings.data_dir))
    inbox = Path(os.path.realpath(settings.inbox_dir))
    return data.is_relative_to(real) or (real.is_relative_to(data)
                                         and not real.is_relative_to(inbox))


@dataclass(frozen=True)
class FolderRow:
    """One line of the admin's list."""

    id: int | None  # None: from DOCTUNE_ALLOWED_FOLDERS (not removable here)
    path: str
    added_by: str
    exists: bool


def folder_rows(session: Session) -> list[FolderRow]:
    rows = [FolderRow(None, str(p), "DOCTUNE_ALLOWED_FOLDERS", p.is_dir())
            for p in settings.allowed_folders]
    for row in session.scalars(select(AllowedFolder).order_by(AllowedFolder.id)):
        rows.append(FolderRow(row.id, row.path, row.added_by, Path(row.path).is_dir()))
    return rows


def _refusal(raw: str, session: Session) -> str | Path:
    """The folder to add, or why it cannot be added, in words."""
    raw = raw.strip()
    if not raw:
        return "Enter the folder's full path, e.g. /srv/shared/handbooks."
    if "\x00" in raw or len(raw) > 1000:
        return "This folder path cannot be used."
    folder = Path(raw).expanduser()
    if not folder.is_absolute():
        return "Please give the folder's full path, e.g. /srv/shared/handbooks."
    folder = Path(os.path.normpath(folder))
    real = Path(os.path.realpath(folder))
    if not real.is_dir():
        return f"There is no folder at {folder} on this computer (or DocTune may not open it)."
    if real == Path(real.anchor):
        return "The whole disk cannot be allowed: choose the folder that holds the documents."
    if real == Path(os.path.realpath(Path.home())):
        return ("A whole home folder cannot be allowed: it holds private files and "
                "passwords. Choose the folder inside it that holds the documents.")
    if overlaps_data_dir(real):
        return (f"{folder} holds DocTune's own data (its database and every upload), or lies "
                "inside it: choose another folder.")
    for known in [settings.inbox_dir, *allowed_folders(session)]:
        if real.is_relative_to(os.path.realpath(known)):
            return f"Folders in {folder} may already be watched (it is inside {known})."
    return folder


def add_folder(session: Session, raw: str, added_by: str) -> AllowedFolder:
    """Allow watched folders in (or under) `raw`. Raises InvalidInput in words."""
    wanted = _refusal(raw, session)
    if isinstance(wanted, str):
        raise InvalidInput(wanted, {"path": wanted})
    row = AllowedFolder(path=str(wanted), added_by=added_by[:100])
    session.add(row)
    session.flush()
    return row


def remove_folder(session: Session, folder_id: int) -> AllowedFolder:
    """Take a folder off the list: projects watching in it stop being read at the next scan
    (their page says why). Their documents stay."""
    row = session.get(AllowedFolder, folder_id)
    if row is None:
        raise NotFound("There is no such allowed folder.")
    session.delete(row)
    session.flush()
    return row
