"""A restore read layer by layer while the model runs (KVStore.stream).

load() reads every block whole before the model starts, so a turn waits for the disk and
then for the forward. stream() reads and checks the blocks' headers (a few KiB each) and
returns at once, each layer's keys and values being views of the buffers they are read
into: the I/O threads read layer 0 of every block, then layer 1, and so on (one read per
block and layer, O_DIRECT straight into the buffers when the block is used whole, else
through a bounce buffer), check the layer's checksum while its bytes are still in the CPU's
cache, and the model waits for a layer only when it reaches it (`wait`). The disk's time
then hides under the forward's.

A layer that is bad or cannot be read fails that wait and every one after it
(StreamFailed): the caller throws the turn's computation away and calls close(), which
removes the block (and the blocks after it) from the store; a plain load() then restores
the shorter prefix. Nothing read is trusted before its layer's checksum matched.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import xxhash

from .._io import ALIGN, IOExecutor, align_up, aligned_empty, byte_view
from ._blockfile import BlockError
from ._ledger import Entry

_MAX_IOVECS = 512  # rows per read (IOV_MAX is 1024 on Linux)


class StreamFailed(BlockError):
    """A streamed layer that is bad or could not be read; its block is removed on close()."""


@dataclass
class Part:
    """One block's share of a streamed restore: its open file and its tensors' places."""

    entry: Entry
    pos: int  # the block's first token in the restore
    take: int  # tokens used from it
    fd: int
    tensors: dict[str, tuple]  # name -> (dtype, shape, file offset, nbytes)
    hashes: list[int] | None  # per layer, None: not checked


def capacity(tokens: int, row_bytes_per_token: int) -> int:
    """`tokens` rounded up so a buffer row of that many tokens is a multiple of ALIGN bytes
    (each block's rows then start aligned, as O_DIRECT reads need)."""
    step = ALIGN // math.gcd(ALIGN, row_bytes_per_token)
    return -(-tokens // step) * step


def _preadv_full(fd: int, views: list[memoryview], offset: int) -> None:
    left = sum(len(v) for v in views)
    while left:
        got = os.preadv(fd, views, offset)
        if got == 0:
            raise BlockError(f"the file ends before offset {offset + left}")
        offset, left = offset + got, left - got
        while views and got >= len(views[0]):
            got -= len(views[0])
            views = views[1:]
        if got:
            views = [views[0][got:], *views[1:]]


class Streamed:
    """A restore in flight: `tokens` tokens, `layers` (per layer (k, v) views of `tokens`
    tokens of buffers with room after them), ready layer by layer (`wait`)."""

    def __init__(self, io: IOExecutor, parts: list[Part], stacked: torch.Tensor,
                 tokens: int, on_close: Callable[[Streamed], None]):
        self.parts = parts
        self.tokens = tokens
        if not stacked.is_contiguous():
            raise ValueError("the stream's buffer must be contiguous")
        self._stacked = stacked  # [layers, 2, *lead, capacity, d]: what the reads fill
        self._base = stacked.data_ptr()
        n_layers = stacked.shape[0]
        self.layers = [(stacked[i, 0][..., :tokens, :], stacked[i, 1][..., :tokens, :])
                       for i in range(n_layers)]
        self._on_close = on_close
        self._lock = threading.Lock()
        self._ready = [threading.Event() for _ in range(n_layers)]
        self.error: tuple[Part, BaseException] | None = None  # the earliest layer's
        self._error_layer = n_layers
        self.bytes_read = 0
        self.started = time.perf_counter()
        self.read_s: float | None = None  # until the last layer was in place
        self._closed = False
        # One job per layer (its blocks one after the other): the I/O threads work on the
        # next layers meanwhile, which keeps a few reads in flight (480 jobs of one block
        # each took longer to queue and to finish, 0.14 s against 0.11 s at 4k).
        self._requests = [io.call(partial(self._job, i), parts[0].entry.path)
                          for i in range(n_layers)]

    def wait(self, layer: int) -> None:
        """Block until `layer` of every block is in place and checked; StreamFailed when a
        read of it or of a layer before it failed, or its checksum did not match."""
        self._ready[layer].wait()
        if self.error is not None and self._error_layer <= layer:
            part, exc = self.error
            raise StreamFailed(f"{part.entry.path}: {exc}")

    def close(self) -> bool:
        """Wait for every read (they write into the buffers), close the files, and report
        to the store (the blocks used, or the bad one removed). True when every layer came
        in intact. Idempotent."""
        if self._closed:
            return self.error is None
        self._closed = True
        for req in self._requests:
            req.wait()  # a job never raises: its errors are in self.error
        for part in self.parts:
            try:
                os.close(part.fd)
            except OSError:
                pass
        self._on_close(self)
        return self.error is None

    # -- the I/O threads' side -------------------------------------------------------------

    def _job(self, layer: int) -> int:
        """Every block's `layer` read and checked, then the layer's waiters woken."""
        nbytes = 0
        for part in self.parts:
            if layer >= self._error_layer:  # past a bad layer nothing is read
                break
            try:
                nbytes += self._read(part, layer)
            except BaseException as exc:  # noqa: BLE001 (the waiter raises it)
                with self._lock:
                    if layer < self._error_layer:
                        self.error, self._error_layer = (part, exc), layer
                break
        with self._lock:
            self.bytes_read += nbytes
            if layer == len(self._ready) - 1:
                self.read_s = time.perf_counter() - self.started
        self._ready[layer].set()
        return nbytes

    def _read(self, part: Part, layer: int) -> int:
        """Read and check one block's `layer`, putting its `take` tokens in place. (Plain
        address arithmetic: this runs 2 x layers x blocks times, beside the forward, and
        every Python step here holds the GIL the forward needs.)"""
        _kd, kshape, koff, kn = part.tensors[f"k.{layer}"]
        _vd, _vshape, voff, vn = part.tensors[f"v.{layer}"]
        m, d = kshape[-2], kshape[-1]
        rows = math.prod(kshape[:-2])
        es = self._stacked.element_size()
        cap = self._stacked.shape[-2]
        row_bytes, src_row = part.take * d * es, m * d * es
        first = self._base + (layer * 2 * rows * cap + part.pos) * d * es
        addrs = [first + j * cap * d * es for j in range(2 * rows)]  # k rows, then v rows
        if (part.take == m and voff == koff + kn and row_bytes % ALIGN == 0
                and first % ALIGN == 0 and (cap * d * es) % ALIGN == 0
                and 2 * rows <= _MAX_IOVECS):
            # the file's rows straight into the buffer's rows
            row = ctypes.c_ubyte * row_bytes
            views = [memoryview(row.from_address(a)).cast("B") for a in addrs]
            _preadv_full(part.fd, views, koff)
            if part.hashes is not None:
                h = xxhash.xxh3_64()
                for v in views:
                    h.update(v)
                if h.intdigest() != part.hashes[layer]:
                    raise BlockError(f"layer {layer}: checksum mismatch")
            return kn + vn
        span = align_up(voff + vn - koff)  # through a bounce buffer
        bounce = aligned_empty(span)
        raw = byte_view(bounce)
        _preadv_full(part.fd, [raw], koff)
        k_raw, v_raw = raw[:kn], raw[voff - koff : voff - koff + vn]
        if part.hashes is not None:
            h = xxhash.xxh3_64(k_raw)
            h.update(v_raw)
            if h.intdigest() != part.hashes[layer]:
                raise BlockError(f"layer {layer}: checksum mismatch")
        for j, a in enumerate(addrs):
            src = k_raw if j < rows else v_raw
            r = j % rows
            ctypes.memmove(a, _address(src, r * src_row), row_bytes)
        return span


def _address(view: memoryview, offset: int) -> int:
    return ctypes.addressof(ctypes.c_ubyte.from_buffer(view, offset))
