"""Files written whole or not at all (a crash leaves the old file or the new one, never half),
and files known by their content (a model folder's digest, hashed once per process).

Every stage may import this module (standard library only).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["file_sha256", "fsync_dir", "fsync_file", "model_digest", "write_json_atomic",
           "write_text_atomic"]

# What a model folder's digest covers (model_digest).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_NAMES = ("config.json", "adapter_config.json")


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


_hashes: dict[tuple[str, int, int, int], str] = {}
_hashes_lock = threading.Lock()


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes, remembered by (path, inode, size, mtime_ns): a model's
    weights are hashed once per process, not on every turn (~0.3 s for SmolLM2's 540 MB).
    A file rewritten in place with its size and mtime kept would not be noticed."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_ino, st.st_size, st.st_mtime_ns)
    with _hashes_lock:
        known = _hashes.get(key)
    if known is not None:
        return known
    with open(real, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    with _hashes_lock:
        _hashes[key] = digest
    return digest


def model_digest(folder: str | os.PathLike) -> str:
    """A model folder's identity: the SHA-256 of its weights files and of the configs that
    change its arithmetic (LoRA's rank and alpha live in adapter_config.json); not the
    tokenizer. Raises ValueError for a folder without weights."""
    folder = Path(folder)
    files = sorted(
        p for p in folder.iterdir()
        if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name in CONFIG_NAMES)
    )
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise ValueError(f"{folder} holds no weights files")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{file_sha256(p)}\n".encode())
    return h.hexdigest()
