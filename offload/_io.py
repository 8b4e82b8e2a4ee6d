"""The engine's only contact with the disk: aligned buffers, swap files, an I/O thread pool.

One module past 500 lines on purpose: every piece below shares the alignment rule, the
error translation and the O_DIRECT fallback, so the disk's whole contract is read here.

Why each piece looks the way it does:

- O_DIRECT needs the buffer address, the file offset and the length aligned to the
  device's logical block; 4 KiB covers every disk we expect. Buffers come from one
  allocation made once (`aligned_empty`), regions in the swap files are padded to 4 KiB.
- Transfers are split into 1 MiB pieces and run by several threads (os.preadv/pwritev
  release the GIL), so one large region keeps several requests in flight at the disk.
- Reads are queued ahead of writes: a read is what the computation waits for, a write
  (write-behind of a stepped block) only has to finish before its buffer is reused.
- Some filesystems refuse O_DIRECT (older tmpfs, overlayfs, some NFS): `probe_o_direct`
  tries an aligned write and read once, and the store falls back to buffered I/O.
- Disk full (ENOSPC/EDQUOT) becomes `OffloadDiskFullError` with a plain message; the
  swap files are preallocated (posix_fallocate) so a running job cannot hit it mid-step.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

ALIGN = 4096  # bytes: buffer address, file offsets and lengths for O_DIRECT
CHUNK = 1 << 20  # bytes per preadv/pwritev call
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class OffloadError(RuntimeError):
    """Base class of the engine's own errors."""


class OffloadDiskFullError(OffloadError):
    """A write did not fit on the disk. Data written before it is left intact."""

    def __init__(self, path: str, nbytes: int | None = None, detail: str = ""):
        self.path = path
        self.nbytes = nbytes
        size = f" ({nbytes / 2**20:.1f} MiB)" if nbytes else ""
        msg = (
            f"The disk holding {path} is full: could not write{size}. "
            "Free some space or choose another directory."
        )
        super().__init__(msg + (f" {detail}" if detail else ""))


class OffloadIOError(OffloadError):
    """Any other failed read or write of a swap or checkpoint file."""


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in _DISK_FULL


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, align: int = ALIGN, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor whose first byte is `align`-aligned.

    Over-allocates by `align` and slices at the right offset; the slice keeps the
    whole allocation alive. `pin_memory` gives page-locked memory for CUDA copies."""
    raw = torch.empty(nbytes + align, dtype=torch.uint8, pin_memory=pin_memory)
    start = (-raw.data_ptr()) % align
    out = raw[start : start + nbytes]
    assert out.data_ptr() % align == 0
    return out


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (for preadv/pwritev).

    The view keeps `t` alive (a view of a temporary, say `byte_view(x.cpu())` of a GPU
    tensor, would otherwise point at freed memory: garbage written, or EFAULT)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    n = t.numel() * t.element_size()
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._tensor = t  # the memoryview holds arr, arr holds t
    return memoryview(arr).cast("B")


class BufferPool:
    """`n_pages` buffers of `page_bytes` each, carved out of one aligned allocation made once."""

    def __init__(self, n_pages: int, page_bytes: int, pin_memory: bool = False):
        if page_bytes % ALIGN:
            raise ValueError("page_bytes must be a multiple of 4096")
        self.n_pages = n_pages
        self.page_bytes = page_bytes
        self.storage = aligned_empty(max(n_pages * page_bytes, ALIGN), pin_memory=pin_memory)
        self.tensors = [self.storage[i * page_bytes : (i + 1) * page_bytes] for i in range(n_pages)]
        self.views = [byte_view(t) for t in self.tensors]

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.page_bytes


def probe_o_direct(directory: str | os.PathLike) -> bool:
    """True when files in `directory` accept O_DIRECT aligned writes and reads."""
    if not hasattr(os, "O_DIRECT"):
        return False
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".o_direct_probe.{os.getpid()}")
    buf = aligned_empty(ALIGN)
    buf.fill_(0x5A)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        view = byte_view(buf)
        if os.pwritev(fd, [view], 0) != ALIGN:
            return False
        back = aligned_empty(ALIGN)
        if os.preadv(fd, [byte_view(back)], 0) != ALIGN:
            return False
        return bool(torch.equal(back, buf))
    except OSError:
        return False
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class IOStats:
    """Counters shared by the I/O threads. Busy times are wall-clock time during which at
    least one read (or write) was in flight, so bytes / busy time is the achieved rate."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.read_busy_s = 0.0
        self.write_busy_s = 0.0
        self._active = {"r": 0, "w": 0}
        self._since = {"r": 0.0, "w": 0.0}

    def begin(self, op: str) -> None:
        with self._lock:
            if self._active[op] == 0:
                self._since[op] = time.perf_counter()
            self._active[op] += 1

    def end(self, op: str, nbytes: int) -> None:
        with self._lock:
            self._active[op] -= 1
            if op == "r":
                self.bytes_read += nbytes
            else:
                self.bytes_written += nbytes
            if self._active[op] == 0:
                dt = time.perf_counter() - self._since[op]
                if op == "r":
                    self.read_busy_s += dt
                else:
                    self.write_busy_s += dt

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written,
                "read_busy_s": self.read_busy_s,
                "write_busy_s": self.write_busy_s,
                "read_gbps": self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s else 0.0,
                "write_gbps": (
                    self.bytes_written / self.write_busy_s / 1e9 if self.write_busy_s else 0.0
                ),
            }


class IORequest:
    """One read or write of a whole region, done as several 1 MiB pieces."""

    def __init__(self, op: str, path: str, nbytes: int, pieces: int):
        self.op = op
        self.path = path
        self.nbytes = nbytes
        self._left = pieces
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self._callbacks: list[Callable[[IORequest], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, fn: Callable[[IORequest], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self) -> None:
        """Block until every piece finished; raise the first piece's error, translated."""
        self._done.wait()
        if self.error is not None:
            raise translate_os_error(self.error, self.path, self.nbytes)

    def _piece_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._left -= 1
            if self._left:
                return
            callbacks, self._callbacks = self._callbacks, []
            self._done.set()
        for fn in callbacks:
            fn(self)


def translate_os_error(exc: BaseException, path: str, nbytes: int | None = None) -> Exception:
    if isinstance(exc, OffloadError):
        return exc
    if is_disk_full(exc):
        err = OffloadDiskFullError(path, nbytes)
    else:
        err = OffloadIOError(f"I/O on {path} failed: {exc}")
    err.__cause__ = exc
    return err


def _pread_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OffloadIOError(f"file ends before offset {offset + len(view)}")
        done += got


def _pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        put = os.pwritev(fd, [view[done:]], offset + done)
        if put == 0:
            raise OSError(errno.ENOSPC, "write made no progress")
        done += put


class IOExecutor:
    """A fixed set of threads running 1 MiB pieces of reads and writes, reads first."""

    _READ, _WRITE = 0, 1

    def __init__(self, threads: int = 4, chunk_bytes: int = CHUNK, stats: IOStats | None = None):
        if chunk_bytes % ALIGN:
            raise ValueError("chunk_bytes must be a multiple of 4096")
        self.chunk_bytes = chunk_bytes
        self.stats = stats or IOStats()
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._run, name=f"offload-io-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def read(self, fd: int, offset: int, view: memoryview, path: str = "?") -> IORequest:
        return self.submit("r", [(fd, offset, view)], path)

    def write(self, fd: int, offset: int, view: memoryview, path: str = "?") -> IORequest:
        return self.submit("w", [(fd, offset, view)], path)

    def call(self, fn: Callable[[], int], path: str = "?") -> IORequest:
        """Run `fn` (a read of its own that returns the bytes it read) on an I/O thread, in
        turn with the reads; the request's error is what it raised."""
        req = IORequest("r", path, 0, 1)
        self._queue.put((self._READ, next(self._seq), req, -1, 0, fn))
        return req

    def submit(
        self, op: str, extents: list[tuple[int, int, memoryview]], path: str = "?"
    ) -> IORequest:
        """One request made of several (fd, file offset, buffer) extents, in 1 MiB pieces."""
        pieces = []
        for fd, offset, view in extents:
            for s in range(0, len(view), self.chunk_bytes):
                pieces.append((fd, offset + s, view[s : s + self.chunk_bytes]))
        if not pieces:
            pieces.append((extents[0][0] if extents else -1, 0, memoryview(b"")))
        req = IORequest(op, path, sum(len(v) for _, _, v in extents), len(pieces))
        prio = self._READ if op == "r" else self._WRITE
        for fd, offset, piece in pieces:
            self._queue.put((prio, next(self._seq), req, fd, offset, piece))
        return req

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item[2] is None:  # shutdown marker
                return
            _, _, req, fd, offset, piece = item
            if req.error is not None:  # an earlier piece failed: skip the rest
                req._piece_done(None)
                continue
            self.stats.begin(req.op)
            error, nbytes = None, 0
            try:
                if callable(piece):  # a job of its own (call())
                    nbytes = piece()
                else:
                    (_pread_full if req.op == "r" else _pwrite_full)(fd, piece, offset)
                    nbytes = len(piece)
            except BaseException as exc:  # noqa: BLE001 (handed to the waiter, never lost)
                error = exc
            finally:
                self.stats.end(req.op, 0 if error else nbytes)
            req._piece_done(error)

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put((99, next(self._seq), None, 0, 0, None))
        for t in self._threads:
            t.join()


@dataclass
class _SwapFile:
    kind: str
    path: str
    fd: int
    offsets: list[int]
    sizes: list[int]
    nbytes: int


class SwapStore:
    """One preallocated file per tensor kind; block b's region of kind k at a fixed offset.

    `regions` maps kind -> per-block region sizes (bytes, multiples of 4096; 0 = none).
    Files are created fresh (truncated, then preallocated, so unwritten regions read as
    zeros: Adam's initial moments). On disk full nothing is left behind.

    Checkpoints without copies (_checkpoint.py): a swap file can be handed over to become a
    checkpoint file (a rename) while a fresh one takes its place, and a checkpoint can be
    loaded by pointing every region at it. Such a region is read from the checkpoint file
    until the engine writes it again, which goes to the swap file: the checkpoint file is
    only ever read. The store keeps those files open (the checkpoint may be replaced or
    removed meanwhile) and closes each once no region reads from it."""

    def __init__(self, directory: str | os.PathLike, regions: dict[str, list[int]], o_direct: bool):
        self.directory = os.fspath(directory)
        self.o_direct = o_direct
        os.makedirs(self.directory, exist_ok=True)
        self.files: dict[str, _SwapFile] = {}
        self._flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if o_direct else 0)
        self.external: dict[tuple[int, str], tuple[list[tuple[int, int, int, int]], str]] = {}
        # (block, kind) -> (fd, file offset, path): read there until written (checkpoints)
        self.until_written: dict[tuple[int, str], tuple[int, int, str]] = {}
        self._users: dict[int, int] = {}  # fd of a checkpoint file -> regions reading it
        # One engine per swap directory: a second one would overwrite the first's regions.
        self._lock_fd = os.open(
            os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o600
        )
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            raise OffloadError(f"{self.directory} is in use by another offload engine") from exc
        flags = self._flags
        try:
            for kind, sizes in regions.items():
                if any(s % ALIGN for s in sizes):
                    raise ValueError(f"region sizes of {kind!r} must be multiples of 4096")
                offsets = [0]
                for s in sizes[:-1]:
                    offsets.append(offsets[-1] + s)
                total = sum(sizes)
                path = os.path.join(self.directory, f"{kind}.swap")
                try:
                    fd = os.open(path, flags, 0o600)
                except OSError as exc:
                    if o_direct and exc.errno == errno.EINVAL:
                        raise OffloadIOError(
                            f"{self.directory} does not support O_DIRECT; "
                            "use o_direct='auto' or False"
                        ) from exc
                    raise translate_os_error(exc, path) from exc
                self.files[kind] = _SwapFile(kind, path, fd, offsets, list(sizes), total)
                if total:
                    try:
                        os.posix_fallocate(fd, 0, total)
                    except OSError as exc:
                        raise translate_os_error(exc, path, total) from exc
        except BaseException:
            self.close(remove=True)
            raise

    def locate(self, block: int, kind: str) -> tuple[int, int, int, str]:
        """(fd, offset, nbytes, path) of a region."""
        f = self.files[kind]
        return f.fd, f.offsets[block], f.sizes[block], f.path

    def map_external(
        self, block: int, kind: str, extents: list[tuple[int, int, int, int]], path: str
    ) -> None:
        """Read region (block, kind) from other files instead, read-only: a list of
        (fd, file offset, offset in the page, nbytes) (e.g. a model's safetensors)."""
        self.external[(block, kind)] = (extents, path)

    def extents(self, block: int, kind: str) -> tuple[list[tuple[int, int, int, int]], str]:
        """Where a region's bytes are: (fd, file offset, offset in the page, nbytes) list."""
        ext = self.external.get((block, kind))
        if ext is not None:
            return ext
        fd, offset, nbytes, path = self.locate(block, kind)
        src = self.until_written.get((block, kind))
        if src is not None:
            fd, offset, path = src
        return [(fd, offset, 0, nbytes)], path

    def before_write(self, block: int, kind: str) -> None:
        """Region (block, kind) is about to be written (to its swap region): it is no
        longer read from a checkpoint file. Read-only regions refuse."""
        if (block, kind) in self.external:
            raise OffloadError(f"region {(block, kind)} is read-only")
        src = self.until_written.pop((block, kind), None)
        if src is not None:
            self._release(src[0])

    def _release(self, fd: int) -> None:
        self._users[fd] -= 1
        if not self._users[fd]:
            del self._users[fd]
            os.close(fd)

    def read_from(self, kind: str, fd: int, path: str) -> None:
        """Every region of `kind` reads from `fd` (a file laid out like the swap file, e.g.
        a checkpoint's) until written; the store owns `fd` from now on."""
        f = self.files[kind]
        for b, size in enumerate(f.sizes):
            if not size:
                continue
            old = self.until_written.pop((b, kind), None)
            if old is not None:
                self._release(old[0])
            self.until_written[(b, kind)] = (fd, f.offsets[b], path)
            self._users[fd] = self._users.get(fd, 0) + 1
        if fd not in self._users:
            os.close(fd)

    def unwritten(self, kind: str) -> list[tuple[int, int, int, int]]:
        """(fd, file offset, swap file offset, nbytes) of the regions of `kind` still read
        from elsewhere."""
        f = self.files[kind]
        return [
            (fd, off, f.offsets[b], f.sizes[b])
            for (b, k), (fd, off, _) in sorted(self.until_written.items())
            if k == kind
        ]

    def forget_unwritten(self, kind: str) -> None:
        """The swap file of `kind` now holds every region itself (copied in by the caller)."""
        for key in [k for k in self.until_written if k[1] == kind]:
            self._release(self.until_written.pop(key)[0])

    def prepare_successor(self, kind: str) -> tuple[int, str]:
        """A fresh, preallocated file to take over from the swap file of `kind`."""
        f = self.files[kind]
        path = f.path + ".next"
        try:
            fd = os.open(path, self._flags, 0o600)
        except OSError as exc:
            raise translate_os_error(exc, path) from exc
        try:
            if f.nbytes:
                os.posix_fallocate(fd, 0, f.nbytes)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError):
                raise translate_os_error(exc, path, f.nbytes) from exc
            raise
        return fd, path

    def hand_over(self, kind: str, dest: str, successor: tuple[int, str]) -> None:
        """Rename the swap file of `kind` to `dest` (same filesystem; the caller made it
        complete and durable), put `successor` in its place, and read every region from
        `dest` until it is written again."""
        f = self.files[kind]
        fd, path = successor
        os.rename(f.path, dest)
        os.rename(path, f.path)
        old = f.fd
        f.fd = fd
        self.read_from(kind, old, dest)

    def is_external(self, block: int, kind: str) -> bool:
        return (block, kind) in self.external

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files.values())

    def kinds(self) -> Iterable[str]:
        return self.files.keys()

    def sync(self, kinds: Iterable[str] | None = None) -> None:
        for kind in self.files if kinds is None else kinds:
            os.fsync(self.files[kind].fd)

    def close(self, remove: bool = False) -> None:
        for fd in self._users:
            os.close(fd)
        self._users, self.until_written = {}, {}
        for f in self.files.values():
            try:
                os.close(f.fd)
            except OSError:
                pass
            if remove:
                try:
                    os.unlink(f.path)
                except FileNotFoundError:
                    pass
        self.files = {}
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None
            if remove:
                try:
                    os.unlink(os.path.join(self.directory, ".lock"))
                except FileNotFoundError:
                    pass
