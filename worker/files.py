"""Files written whole or not at all: a crash leaves the old file or the new one, never half.

Every stage may import this module (standard library only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "fsync_file", "write_json_atomic", "write_text_atomic"]


def fsync_file(path: Path) -> None:
    """Make the contents of the file at `path` durable."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(folder: Path) -> None:
    """Make the entries of `folder` (a rename into it, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temp file next to it, fsynced, then renamed
    into place. The temp name carries the process id, so two processes writing the same file
    do not write into each other's temp file; the last rename wins."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as JSON (indented one space, non-ASCII kept as is), written atomically."""
    write_text_atomic(path, json.dumps(data, indent=1, ensure_ascii=False))
