"""One block on disk: a .safetensors file with the block's token ids and, per layer, its
keys and values. Written whole under a temp name, fsynced, renamed; read whole, or layer by
layer while the model runs (_stream.py), and checked.

Layout (a valid safetensors file, no pickle): the 8-byte header length, the JSON header
padded with spaces so the data starts on a 4 KiB boundary, then `ids` (I64 [n]), `k.{i}`
and `v.{i}` per layer in the caller's shape (tokens on dim -2), each tensor followed by a
`_pad.<name>` (U8) up to the next 4 KiB boundary when it does not end on one: every tensor
starts 4 KiB-aligned, so one layer's keys and values are one O_DIRECT read straight into
the cache's buffers, and the whole file is one O_DIRECT read with no bounce copy. The
metadata (strings) names the block: format, namespace, key, parent, start, tokens,
block_tokens, layers, and per layer an xxh3-64 of its keys' and values' bytes (`xxh3`),
checked on every read from the disk by the I/O thread that read them, while they are still
in the CPU's cache.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import threading
from dataclasses import dataclass

import torch
import xxhash

from .._io import (
    ALIGN,
    IOExecutor,
    align_up,
    aligned_empty,
    byte_view,
    is_disk_full,
    translate_os_error,
)
from .._safetensors import DTYPE_NAMES, decode_header, dtype_of, header_length
from ._keys import FORMAT_VERSION, ID_BYTES

SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
_HEAD_READ = 64 << 10  # bytes read to index a file: its header and its ids, usually
_tmp_names = itertools.count()


class BlockError(ValueError):
    """A block file that cannot be used; the message says why."""


@dataclass
class Head:
    """What the index keeps of a block file: read from its header and its ids."""

    namespace: str
    key: bytes
    parent: bytes
    start: int
    tokens: int
    layers: int
    size: int  # the file's length in bytes
    ids: bytes  # int64 little-endian


@dataclass
class Block:
    """A block read back: its token ids, and its tensors as views into the read buffer:
    `stacked` [layers, 2 (k, v), *shape] when every layer's k and v share one shape and
    dtype and lie one after the other (what encode() writes for such a cache: one copy per
    block on restore), else None and `layers` per-layer (k, v)."""

    meta: dict[str, str]
    ids: memoryview
    stacked: torch.Tensor | None
    _buf: torch.Tensor
    _tensors: dict[str, tuple]
    n_layers: int

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.stacked is not None:
            return [(self.stacked[i, 0], self.stacked[i, 1]) for i in range(self.n_layers)]
        out = []
        for i in range(self.n_layers):
            pair = []
            for kv in "kv":
                dtype, shape, offset, nbytes = self._tensors[f"{kv}.{i}"]
                pair.append(self._buf[offset : offset + nbytes].view(dtype).view(shape))
            out.append((pair[0], pair[1]))
        return out


def file_name(key: bytes) -> str:
    return key.hex() + SUFFIX


def _metadata(namespace: str, key: bytes, parent: bytes, start: int, block_tokens: int,
              tokens: int, layers: int, hashes: list[int]) -> dict[str, str]:
    return {
        "format": FORMAT_VERSION,
        "namespace": namespace,
        "key": key.hex(),
        "parent": parent.hex(),
        "start": str(start),
        "tokens": str(tokens),
        "block_tokens": str(block_tokens),
        "layers": str(layers),
        # fixed width: the header's length does not depend on the values
        "xxh3": ",".join(f"{h:016x}" for h in hashes),
    }


def layer_hash(k: memoryview, v: memoryview) -> int:
    """The checksum of one layer: xxh3-64 of its keys' bytes, then its values'. (xxhash
    releases the GIL; at 12 GB/s a core on the 2-core dev VM, zlib's crc32 2.3 GB/s, it
    takes a sixth of the time a 2 GB/s disk needs to read the bytes.)"""
    h = xxhash.xxh3_64(k)
    h.update(v)
    return h.intdigest()


def stored_hashes(meta: dict[str, str], layers: int) -> list[int]:
    """The per-layer checksums a block's metadata gives; BlockError when malformed."""
    parts = meta.get("xxh3", "").split(",")
    try:
        if len(parts) != layers or any(len(p) != 16 for p in parts):
            raise ValueError(f"{len(parts)} for {layers} layers")
        return [int(p, 16) for p in parts]
    except ValueError as exc:
        raise BlockError(f"metadata: checksums: {exc}") from exc


def _is_pad(name: str) -> bool:
    return name.startswith("_pad.")


def encode(namespace: str, key: bytes, parent: bytes, start: int, block_tokens: int,
           ids: bytes, layers: list[tuple[torch.Tensor, torch.Tensor]], begin: int,
           end: int) -> torch.Tensor:
    """The file for tokens [begin, end) of `layers` (per layer (k, v), tokens on dim -2), as
    an aligned uint8 tensor whose length is a multiple of 4 KiB."""
    n = end - begin
    if len(ids) != n * ID_BYTES:
        raise ValueError("ids do not match the block's length")
    parts: list[tuple[str, torch.Tensor | None, str, list[int], int]] = []

    def add(name: str, t: torch.Tensor | None, dname: str, shape: list[int], nbytes: int):
        parts.append((name, t, dname, shape, nbytes))
        pad = (-nbytes) % ALIGN
        if pad:
            parts.append((f"_pad.{name}", None, "U8", [pad], pad))

    add("ids", None, "I64", [n], len(ids))
    for i, (k, v) in enumerate(layers):
        for name, t in ((f"k.{i}", k), (f"v.{i}", v)):
            dname = DTYPE_NAMES.get(t.dtype)
            if dname is None:
                raise ValueError(f"a {t.dtype} tensor cannot be stored")
            shape = [*t.shape[:-2], n, t.shape[-1]]
            add(name, t, dname, shape, math.prod(shape) * t.element_size())
    header: dict[str, object] = {}
    offset = 0
    for name, _, dname, shape, nbytes in parts:
        header[name] = {"dtype": dname, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes

    def header_bytes(hashes: list[int]) -> bytes:
        meta = _metadata(namespace, key, parent, start, block_tokens, n, len(layers), hashes)
        return json.dumps({"__metadata__": meta, **header}, separators=(",", ":")).encode()

    raw = header_bytes([0] * len(layers))
    data_start = align_up(8 + len(raw))
    buf = aligned_empty(data_start + offset)
    offset = data_start
    spans: dict[str, tuple[int, int]] = {}
    for name, t, _, shape, nbytes in parts:
        piece = buf[offset : offset + nbytes]
        if name == "ids":
            piece.copy_(torch.frombuffer(bytearray(ids), dtype=torch.uint8))
        elif t is None:
            piece.zero_()
        else:
            piece.view(t.dtype).view(shape).copy_(t[..., begin:end, :])
        spans[name] = (offset, nbytes)
        offset += nbytes
    view = byte_view(buf)
    hashes = [layer_hash(*(view[o : o + m] for o, m in (spans[f"k.{i}"], spans[f"v.{i}"])))
              for i in range(len(layers))]
    raw = header_bytes(hashes)
    raw += b" " * (data_start - 8 - len(raw))  # the header's length includes its padding
    view[:data_start] = (data_start - 8).to_bytes(8, "little") + raw
    return buf


def _tensors(header: dict, data_start: int, size: int) -> dict[str, tuple]:
    """name -> (dtype, shape, file offset, nbytes), checked: known dtypes, sizes that match
    the shapes, no holes or overlaps, the data ending exactly where the file does."""
    out = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = dtype_of(info["dtype"])
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise BlockError(f"tensor {name!r}: {exc}") from exc
        if dtype is None or any(s < 0 for s in shape):
            raise BlockError(f"tensor {name!r}: {info.get('dtype')} {list(shape)}")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or begin < 0:
            raise BlockError(f"tensor {name!r}: {end - begin} bytes for shape {list(shape)}")
        out[name] = (dtype, shape, data_start + begin, nbytes)
        spans.append((begin, end))
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise BlockError("tensor data has holes or overlaps")
        at = end
    if data_start + at != size or size % ALIGN:
        raise BlockError(f"the file has {size} bytes, its header describes {data_start + at}")
    return out


def _check_names(names: set[str], layers: int) -> None:
    want = {"ids"} | {f"{kv}.{i}" for i in range(layers) for kv in "kv"}
    pads = {x for x in names if _is_pad(x)}
    if names - pads != want or any(x.removeprefix("_pad.") not in want for x in pads):
        raise BlockError("unexpected tensor names")


def _meta(header: dict) -> dict[str, str]:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BlockError("no metadata")
    if meta.get("format") != FORMAT_VERSION:
        raise BlockError(f"format {meta.get('format')!r}, this store reads {FORMAT_VERSION!r}")
    return meta


def _layout(prefix, size: int) -> tuple[dict[str, str], dict, int, int]:
    """(metadata, tensors, layers, tokens) of a file of `size` bytes whose first bytes
    (`prefix`) hold the whole header; BlockError when they do not make a block."""
    try:
        header, data_start = decode_header(prefix)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BlockError(f"not a safetensors file: {exc}") from exc
    meta = _meta(header)
    tensors = _tensors(header, data_start, size)
    try:
        layers, tokens = int(meta["layers"]), int(meta["tokens"])
    except (KeyError, ValueError) as exc:
        raise BlockError(f"metadata: {exc}") from exc
    if layers < 1:
        raise BlockError("no layers")
    _check_names(set(tensors), layers)
    dtype, shape, _offset, _nbytes = tensors["ids"]
    if dtype != torch.int64 or shape != (tokens,):
        raise BlockError("ids are not int64 of the block's length")
    return meta, tensors, layers, tokens


def read_layout(fd: int, size: int) -> tuple[dict[str, str], dict, int, int, bytes]:
    """(metadata, tensors, layers, tokens, ids) of an open block file of `size` bytes,
    read through aligned buffers (the fd may be O_DIRECT); BlockError when it is not one."""
    def pread(nbytes: int) -> memoryview:
        buf = aligned_empty(align_up(min(nbytes, size)))
        view = byte_view(buf)
        got = 0
        while got < len(view):  # a short read reads on; the end of the file stops it
            more = os.preadv(fd, [view[got:]], got)
            if not more:
                break
            got += more
        return memoryview(bytes(view[:got]))

    first = pread(_HEAD_READ)
    try:
        n = header_length(first)
    except ValueError as exc:
        raise BlockError(f"not a safetensors file: {exc}") from exc
    if 8 + n > len(first):
        first = pread(8 + n)
    meta, tensors, layers, tokens = _layout(first, size)
    _dtype, _shape, offset, nbytes = tensors["ids"]
    if offset + nbytes > len(first):
        first = pread(offset + nbytes)
    if offset + nbytes > len(first):
        raise BlockError("truncated")
    return meta, tensors, layers, tokens, bytes(first[offset : offset + nbytes])


def read_head(path: str) -> Head:
    """Index one file from its header and ids (a few KiB), checking the layout."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise BlockError(f"cannot open: {exc}") from exc
    try:
        size = os.fstat(fd).st_size
        first = os.pread(fd, min(size, _HEAD_READ), 0)
        try:
            n = header_length(first)
        except ValueError as exc:
            raise BlockError(f"not a safetensors file: {exc}") from exc
        if 8 + n > len(first):
            first = os.pread(fd, 8 + n, 0)
        meta, tensors, layers, tokens = _layout(first, size)
        try:
            head = Head(meta["namespace"], bytes.fromhex(meta["key"]),
                        bytes.fromhex(meta["parent"]), int(meta["start"]), tokens, layers,
                        size, b"")
        except (KeyError, ValueError) as exc:
            raise BlockError(f"metadata: {exc}") from exc
        _dtype, _shape, offset, nbytes = tensors["ids"]
        ids = first[offset : offset + nbytes]
        if len(ids) != nbytes:
            ids = os.pread(fd, nbytes, offset)
        head.ids = bytes(ids)
        return head
    except OSError as exc:
        raise BlockError(f"cannot read: {exc}") from exc
    finally:
        os.close(fd)


def parse(buf: torch.Tensor, hashes: list[int] | None) -> Block:
    """A whole file read into `buf`, checked (layout, and the per-layer checksums `hashes`
    of its data against the header's unless None): its metadata, ids, and per-layer (k, v)
    views into `buf`."""
    view = byte_view(buf)
    size = len(view)
    try:
        n = header_length(view[:8])
    except ValueError as exc:
        raise BlockError(f"not a safetensors file: {exc}") from exc
    if 8 + n > size:
        raise BlockError("truncated header")
    meta, tensors, layers, tokens = _layout(view[: 8 + n], size)
    if hashes is not None and hashes != stored_hashes(meta, layers):
        raise BlockError("checksum mismatch")
    _dtype, _shape, offset, nbytes = tensors["ids"]
    ids = view[offset : offset + nbytes]
    first = tensors["k.0"]
    at, uniform = first[2], True
    for i in range(layers):
        for kv in "kv":
            dtype, shape, offset, nbytes = tensors[f"{kv}.{i}"]
            if len(shape) < 2 or shape[-2] != tokens:
                raise BlockError(f"{kv}.{i} has shape {list(shape)} for {tokens} tokens")
            uniform = uniform and (dtype, shape, offset) == (first[0], first[1], at)
            at = offset + nbytes
    stacked = None
    if uniform:
        dtype, shape, offset, nbytes = first
        stacked = buf[offset : offset + 2 * layers * nbytes].view(dtype).view(layers, 2, *shape)
    return Block(meta, ids, stacked, buf, tensors, layers)


def data_hashes(buf: torch.Tensor) -> list[int] | None:
    """The per-layer checksums of a whole file's data, None when its header is unreadable."""
    view = byte_view(buf)
    try:
        _meta, tensors, layers, _tokens = _layout(view[: 8 + header_length(view[:8])], len(view))
    except (ValueError, BlockError):
        return None
    return [layer_hash(*(view[o : o + m] for _d, _s, o, m in (tensors[f"k.{i}"],
                                                               tensors[f"v.{i}"])))
            for i in range(layers)]


class PendingRead:
    """One whole file being read into an aligned buffer by the I/O threads; the thread that
    finishes it computes the layers' checksums (xxhash releases the GIL) and closes it."""

    def __init__(self, io: IOExecutor, path: str, size: int, o_direct: bool, check: bool):
        self.path = path
        self._check_wanted = check
        self.hashes: list[int] | None = None
        self._finished = threading.Event()
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0)
        self._fd = os.open(path, flags)  # OSError: the caller's miss
        try:
            actual = os.fstat(self._fd).st_size
            if actual != size:
                raise BlockError(f"the file has {actual} bytes, the index says {size}")
            self.buf = aligned_empty(size)
            self._req = io.read(self._fd, 0, byte_view(self.buf), path)
        except BaseException:
            os.close(self._fd)
            raise
        self._req.add_done_callback(self._done)

    def _done(self, req) -> None:
        try:
            if req.error is None and self._check_wanted:
                self.hashes = data_hashes(self.buf)
        except Exception:  # noqa: BLE001 (the hashes stay None: wait() refuses the block)
            self.hashes = None
        finally:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._finished.set()

    def wait(self) -> torch.Tensor:
        """The buffer once read; OffloadIOError (or its disk-full subclass) when it failed."""
        self._finished.wait()
        self._req.wait()
        if self._check_wanted and self.hashes is None:
            raise BlockError("unreadable header")
        return self.buf


def write_file(io: IOExecutor, path: str, buf: torch.Tensor, o_direct: bool) -> None:
    """Write `buf` to `path` durably and atomically: temp name, preallocated (a full disk
    shows up before any byte is written), written, fsynced, renamed. The caller fsyncs the
    directory. Raises OffloadDiskFullError / OffloadIOError; leaves no temp file behind."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{next(_tmp_names)}{TMP_SUFFIX}")
    nbytes = buf.numel()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if o_direct else 0)
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise translate_os_error(exc, tmp, nbytes) from exc
    try:
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if is_disk_full(exc):
                    raise
                # no fallocate on this filesystem: a full disk shows up in the write instead
            io.write(fd, 0, byte_view(buf), tmp).wait()
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise translate_os_error(exc, tmp, nbytes) from exc
        raise


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_stale_tmp(name: str) -> bool:
    """A temp file left by a process that is gone (or by an earlier store in this one)."""
    if not (name.startswith(".") and name.endswith(TMP_SUFFIX)):
        return False
    parts = name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False

