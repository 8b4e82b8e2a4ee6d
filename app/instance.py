"""This DocTune's id, in its database and in its data folder.

The database and the data folder belong together: rows name files in the folder (uploads,
job folders, models). A machine that joins (`doctune worker --join`) connects to the
database and mounts the folder over the network; were they two different DocTunes', its jobs
would read and write the wrong files. Migration 0011 puts an id in the database (the
`instance` table); the main machine writes it into INSTANCE_FILE in its data folder each
time it migrates (`doctune up`, `doctune web --migrate`), with the folder's path there; a
joining worker compares both (worker/cli/join.py) and never writes either.

The path matters because a job that runs on several machines (worker/distributed/) hands its
ranks one spec of absolute paths (the model, the job's folder). Downloads are recorded
relative to the folder (Settings.stored_path), so they do not depend on it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.db import session_scope
from app.models import Instance
from app.settings import settings

INSTANCE_FILE = "instance.json"


@dataclass(frozen=True)
class FolderMark:
    """What the main machine wrote into its data folder."""

    instance_id: str
    path: str  # the folder's absolute path on the main machine


def database_instance_id(session: Session) -> str | None:
    return session.scalar(select(Instance.id).order_by(Instance.created_at).limit(1))


def read_mark(data_dir: Path) -> FolderMark | None:
    """The mark in `data_dir`, or None where there is none that can be read."""
    try:
        found = json.loads((data_dir / INSTANCE_FILE).read_text(encoding="utf-8"))
        return FolderMark(str(found["instance_id"]), str(found["path"]))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def mark_data_dir(data_dir: Path, instance_id: str) -> None:
    """Write `instance_id` and `data_dir`'s path into it (a temp file renamed: a joiner never
    reads half). The database is the truth: a folder that held another id (its old database
    deleted, say) takes this one."""
    mark = FolderMark(instance_id, str(data_dir.absolute()))
    if read_mark(data_dir) == mark:
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    temp = data_dir / f".{INSTANCE_FILE}.{os.getpid()}"
    temp.write_text(json.dumps({"instance_id": mark.instance_id, "path": mark.path}) + "\n",
                    encoding="utf-8")
    os.replace(temp, data_dir / INSTANCE_FILE)


def claim_data_dir() -> None:
    """Mark this machine's data folder as the current database's (after migrating)."""
    with session_scope() as session:
        instance_id = database_instance_id(session)
    if instance_id is not None:
        mark_data_dir(settings.data_dir, instance_id)
