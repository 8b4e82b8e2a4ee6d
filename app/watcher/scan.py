"""Looking at a watched folder without reading any file: which files are candidates, and
which are skipped and why (lock and temporary files, hidden ones, links leading outside).

Pure standard library; app/watcher/loop.py decides what to do with what a scan finds."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

# Names that are never documents: Office owner files ("~$report.docx"), LibreOffice locks
# (".~lock.report.odt#", hidden anyway), editors' and browsers' temporary or partial files.
_IGNORED_SUFFIXES = (
    ".tmp",
    ".temp",
    ".part",
    ".partial",
    ".crdownload",
    ".download",
    ".swp",
    ".swx",
    "~",
)
_SYSTEM_FILES = {"thumbs.db", "desktop.ini", "icon\r"}


def ignore_reason(name: str) -> str | None:
    """Why a file of this name is skipped without being read; None when it is a candidate."""
    lower = name.lower()
    if name.startswith("~$"):
        return "an Office lock file"
    if name.startswith("."):
        return "a hidden file"
    if lower.endswith(_IGNORED_SUFFIXES) or lower.startswith("~wr"):
        return "a temporary or partly downloaded file"
    if lower in _SYSTEM_FILES:
        return "a system file"
    return None


@dataclass(frozen=True)
class Seen:
    """A file as one scan found it. `dev` and `ino` say which file it was: the watcher reads
    it only if what it opens is that same file, so a name swapped for another file (or a
    link re-pointed) after the scan is not read. `target` is where a link led, checked to be
    inside the inbox; the watcher opens that, never the link."""

    size: int
    mtime_ns: int
    ctime_ns: int
    dev: int = 0
    ino: int = 0
    target: str | None = None

    @property
    def sig(self) -> tuple[int, int, int]:
        return (self.size, self.mtime_ns, self.ctime_ns)

    @property
    def ident(self) -> tuple[int, int]:
        return (self.dev, self.ino)


@dataclass
class Scan:
    files: dict[str, Seen] = field(default_factory=dict)  # "/"-separated path -> stat
    skipped: dict[str, str] = field(default_factory=dict)  # path -> why it is not read
    problems: list[str] = field(default_factory=list)  # sub-folders that could not be read


def stat_seen(st: os.stat_result, target: str | None = None) -> Seen:
    return Seen(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino, target)


NOT_REGULAR = "not a regular file (a pipe, device or socket): never opened"


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def scan_folder(root: Path) -> Scan:
    """Every candidate file under `root`, without reading any. Hidden folders are skipped;
    a link is followed only to a file inside `root`, and a hard link only counts when all
    its names are inside `root` (otherwise a file elsewhere would be read through it).
    Pipes, devices and sockets, and links to them, are skipped without being opened (a
    pipe blocks whoever opens it until something writes to it)."""
    out = Scan()
    real_root = os.path.realpath(root)
    by_inode: dict[tuple[int, int], list[tuple[str, int]]] = {}
    links: list[tuple[str, tuple[int, int], int]] = []  # (rel, (dev, inode), link count)
    stack = [("", str(root))]
    while stack:
        rel_dir, dir_path = stack.pop()
        try:
            entries = list(os.scandir(dir_path))
            # A sub-folder swapped for a link after its parent was listed: its listing is
            # of some folder elsewhere, whose names are not the inbox's to show.
            moved = rel_dir and os.path.realpath(dir_path) != os.path.join(real_root, rel_dir)
        except OSError as exc:
            out.problems.append(f"{rel_dir or '.'}: {exc.strerror or exc}")
            continue
        if moved:
            out.skipped[rel_dir] = "a folder replaced by a link while it was looked at"
            continue
        for entry in entries:
            name = entry.name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                out.skipped[rel.encode("utf-8", "replace").decode()] = (
                    "its name is not valid text (UTF-8)"
                )
                continue
            try:
                if entry.is_symlink():
                    target = os.path.realpath(entry.path)
                    if not _inside(target, real_root):
                        out.skipped[rel] = "a link to something outside the inbox"
                        continue
                    st = os.stat(target, follow_symlinks=False)  # resolved: not a link
                    if stat.S_ISDIR(st.st_mode):
                        out.skipped[rel] = "a link to a folder (its files are read where they are)"
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        out.skipped[rel] = f"a link to something {NOT_REGULAR}"
                        continue
                    if ignore_reason(name):
                        continue
                    out.files[rel] = stat_seen(st, target)
                    links.append((rel, (st.st_dev, st.st_ino), st.st_nlink))
                elif entry.is_dir(follow_symlinks=False):
                    if not name.startswith("."):
                        stack.append((rel, entry.path))
                elif entry.is_file(follow_symlinks=False):
                    if ignore_reason(name):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    out.files[rel] = stat_seen(st)
                    if st.st_nlink > 1:
                        by_inode.setdefault((st.st_dev, st.st_ino), []).append((rel, st.st_nlink))
                else:
                    out.skipped[rel] = NOT_REGULAR
            except OSError:
                continue  # gone between listing and looking: the next scan settles it
    outside = set()
    for key, names in by_inode.items():
        if len(names) < names[0][1]:
            outside.add(key)
            for rel, _ in names:
                del out.files[rel]
                out.skipped[rel] = "a hard link to a file outside the inbox"
    for rel, key, nlink in links:  # a link to a file that also has a name elsewhere
        if key in outside or (nlink > 1 and key not in by_inode):
            del out.files[rel]
            out.skipped[rel] = "a link to a file that is also outside the inbox (a hard link)"
    return out
