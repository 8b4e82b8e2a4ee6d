"""The index of one cache directory, shared by every KVStore on it in this process: which
block files exist (every namespace), their tree (parent -> children), their bytes and last
use; the on-disk cap and least-recently-used eviction; the I/O threads.

Built at start from the files themselves (`read_head`: the header and the ids after it, a
few KiB per file), never from an index file that could disagree with them. A file that
cannot be read, whose key is not the hash of its parent and ids, of another format version,
or whose parent is gone is removed then, as are temp files of processes that are gone.

Last use is the file's mtime (set with os.utime), so the order survives a restart. A chain
used at time T stamps its block at depth d with T - d nanoseconds: the tail of a chain is
older than its head, so eviction (oldest first) shortens a chain from its end and a
partially evicted chain is still a valid, shorter prefix. Removing a block removes its
subtree (nothing could reach it any more). One lock guards all of it: one store may be used
by a generating thread while another thread forgets or drops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field

from .._io import IOExecutor, probe_o_direct
from ._blockfile import SUFFIX, BlockError, Head, file_name, is_stale_tmp, read_head
from ._keys import block_key, namespace_digest, root_key

log = logging.getLogger("offload.kvcache")

NAMESPACE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass
class Entry:
    head: Head
    path: str
    stamp: int  # last use, ns since the epoch (the file's mtime)


@dataclass
class Ledger:
    directory: str
    o_direct: bool
    io: IOExecutor
    io_threads: int
    lock: threading.RLock = field(default_factory=threading.RLock)
    entries: dict[bytes, Entry] = field(default_factory=dict)
    children: dict[bytes, set[bytes]] = field(default_factory=dict)  # parent -> child keys
    total_bytes: int = 0
    cap_bytes: int | None = None
    users: int = 0
    scanned_files: int = 0
    removed_at_scan: int = 0
    evicted: int = 0
    listeners: weakref.WeakSet = field(default_factory=weakref.WeakSet)

    def namespace_dir(self, namespace: str) -> str:
        return os.path.join(self.directory, namespace)

    def add(self, head: Head, path: str, stamp: int) -> Entry:
        e = Entry(head, path, stamp)
        self.entries[head.key] = e
        self.children.setdefault(head.parent, set()).add(head.key)
        self.total_bytes += head.size
        return e

    def remove(self, key: bytes, reason: str) -> int:
        """Remove a block and its subtree (files and index); returns the files removed."""
        removed = 0
        stack = [key]
        while stack:
            k = stack.pop()
            e = self.entries.pop(k, None)
            if e is None:
                continue
            stack.extend(self.children.pop(k, ()))
            siblings = self.children.get(e.head.parent)
            if siblings is not None:
                siblings.discard(k)
                if not siblings:
                    del self.children[e.head.parent]
            self.total_bytes -= e.head.size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(e.path)
            removed += 1
            log.debug("kv cache: removed %s (%s)", e.path, reason)
            for store in list(self.listeners):
                store._removed(e.head.namespace, k)
        return removed

    def touch(self, chain: list[Entry]) -> None:
        """Mark a chain (root first) as just used: block at depth d gets now - d ns."""
        now = time.time_ns()
        for depth, e in enumerate(chain):
            if self.entries.get(e.head.key) is not e:
                continue
            e.stamp = now - depth
            with contextlib.suppress(OSError):
                os.utime(e.path, ns=(e.stamp, e.stamp))

    def make_room(self, nbytes: int, protect: set[bytes]) -> bool:
        """Evict least recently used blocks (not in `protect`) until `nbytes` more fit
        under the cap; False when they cannot."""
        if self.cap_bytes is None:
            return True
        while self.total_bytes + nbytes > self.cap_bytes:
            victims = [e for k, e in self.entries.items() if k not in protect]
            if not victims:
                return False
            victim = min(victims, key=lambda e: e.stamp)
            self.evicted += self.remove(victim.head.key, "least recently used, over the cap")
        return True

    def set_cap(self, cap_bytes: int | None) -> None:
        self.cap_bytes = cap_bytes
        self.make_room(0, set())

    def drop_namespace(self, namespace: str) -> int:
        keys = [k for k, e in self.entries.items() if e.head.namespace == namespace]
        removed = sum(self.remove(k, "namespace dropped") for k in keys)
        shutil.rmtree(self.namespace_dir(namespace), ignore_errors=True)
        return removed

    def scan(self) -> None:
        """Build the index from the files on disk (see the module docstring)."""
        os.makedirs(self.directory, exist_ok=True)
        for ns in sorted(os.listdir(self.directory)):
            folder = self.namespace_dir(ns)
            if not NAMESPACE_RE.fullmatch(ns) or not os.path.isdir(folder):
                continue
            nsd = namespace_digest(ns)
            for name in os.listdir(folder):
                path = os.path.join(folder, name)
                if is_stale_tmp(name):
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    continue
                if not name.endswith(SUFFIX):
                    continue  # not ours: left alone
                self.scanned_files += 1
                try:
                    head = read_head(path)
                    if head.namespace != ns or file_name(head.key) != name:
                        raise BlockError("its name or folder does not match its header")
                    if block_key(head.parent, nsd, head.ids) != head.key:
                        raise BlockError("its key is not the hash of its parent and ids")
                    stamp = os.stat(path).st_mtime_ns
                except (BlockError, OSError) as exc:
                    log.warning("kv cache: removing unusable block file %s: %s", path, exc)
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    self.removed_at_scan += 1
                    continue
                self.add(head, path, stamp)
        roots = {root_key(namespace_digest(e.head.namespace)) for e in self.entries.values()}
        for key in list(self.entries):
            e = self.entries.get(key)
            if e is not None and e.head.parent not in self.entries and e.head.parent not in roots:
                log.warning("kv cache: removing %s: its parent block is gone", e.path)
                self.removed_at_scan += self.remove(key, "orphan")


_LEDGERS: dict[str, Ledger] = {}
_REGISTRY = threading.Lock()


def open_ledger(directory: str, o_direct: bool | str, io_threads: int) -> Ledger:
    """The process's ledger for `directory` (scanned when first opened)."""
    path = os.path.realpath(directory)
    with _REGISTRY:
        ledger = _LEDGERS.get(path)
        if ledger is None:
            os.makedirs(path, exist_ok=True)
            direct = probe_o_direct(path) if o_direct == "auto" else bool(o_direct)
            ledger = Ledger(path, direct, IOExecutor(io_threads), io_threads)
            try:
                ledger.scan()
            except BaseException:
                ledger.io.close()
                raise
            _LEDGERS[path] = ledger
        ledger.users += 1
        return ledger


def release_ledger(ledger: Ledger) -> None:
    """One user fewer; the last one closes the I/O threads and forgets the index (a store
    opened later scans the directory again, as after a restart)."""
    with _REGISTRY:
        ledger.users -= 1
        if ledger.users > 0:
            return
        if _LEDGERS.get(ledger.directory) is ledger:
            del _LEDGERS[ledger.directory]
    with ledger.lock:
        ledger.io.close()


def _after_fork_in_child() -> None:
    """A forked child (a Celery prefork worker) has copies of the ledgers but not their
    I/O threads, and a lock held by another thread at the fork stays held: give each ledger
    a fresh lock and fresh threads, so stores made before the fork keep working."""
    global _REGISTRY
    _REGISTRY = threading.Lock()
    for ledger in _LEDGERS.values():
        ledger.lock = threading.RLock()
        ledger.io = IOExecutor(ledger.io_threads)


os.register_at_fork(after_in_child=_after_fork_in_child)
