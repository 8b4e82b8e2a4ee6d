"""Which buffer holds which region: prefetch, demand reads, write-behind, a small cache.

A page is one buffer of the pool. While it holds region (block, kind) it is registered
under that key, so a region is never in two pages at once and a block that is needed
again soon (the last block between forward and backward) is found without a read.

Deadlock rule: the engine pins at most `reserve` pages at a time (the pool has at least
that many), demands regions in the order of its schedule, and prefetches strictly in that
order, stopping at the first region it cannot start. So the prefetched pages are always
the regions demanded next, in order: when a demanded region is not among them, no page is
held by a prefetch at all, and a page is free or will be once the writes in flight end.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import torch

from ._io import BufferPool, IOExecutor, IORequest, OffloadError, SwapStore, translate_os_error

Key = tuple[int, str]  # (block index, kind)


class _Page:
    __slots__ = (
        "dirty",
        "index",
        "key",
        "pinned",
        "prefetched",
        "reading",
        "tensor",
        "valid",
        "view",
        "writing",
    )

    def __init__(self, index: int, tensor: torch.Tensor, view: memoryview):
        self.index = index
        self.tensor = tensor
        self.view = view
        self.key: Key | None = None
        self.valid = False  # bytes equal the region on disk (or will, once `reading` ends)
        self.dirty = False  # bytes newer than the disk and not yet being written
        self.pinned = False
        self.prefetched = False
        self.reading: IORequest | None = None
        self.writing: IORequest | None = None


class Pager:
    def __init__(
        self,
        store: SwapStore,
        pool: BufferPool,
        io: IOExecutor,
        reserve: int,
        write_behind: bool = True,
    ):
        if pool.n_pages < reserve:
            raise ValueError(f"pool has {pool.n_pages} pages, the engine needs {reserve}")
        self.store = store
        self.io = io
        self.reserve = reserve
        # True: a released dirty page is written at once (streaming). False: it stays
        # cached and dirty until flush() (everything fits; no writes until a checkpoint).
        self.write_behind = write_behind
        self.pages = [_Page(i, t, v) for i, (t, v) in enumerate(zip(pool.tensors, pool.views))]
        self._by_key: dict[Key, _Page] = {}
        self._free: OrderedDict[int, _Page] = OrderedDict((p.index, p) for p in self.pages)
        self._n_prefetched = 0
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._error_req: IORequest | None = None
        self._free_was_immediate = True
        self.hits = 0
        self.misses = 0
        self.stall_s = 0.0

    # -- public ---------------------------------------------------------------------------

    def prefetch(self, key: Key, read: bool = True) -> bool:
        """Hold a page for `key` and start reading it (`read` False: the caller will fill
        it whole) if a page is free; never blocks. True if `key` is now held or in use."""
        with self._cond:
            page = self._by_key.get(key)
            if page is not None:
                if page.index in self._free:
                    del self._free[page.index]  # a cached region: keep it from eviction
                    page.prefetched = True
                    self._n_prefetched += 1
                return page.prefetched or page.pinned
            page = self._take_free(block=False)
            if page is None:
                return False
            page.prefetched = True
            self._n_prefetched += 1
            if read:
                self._start_read(page, key)
            else:
                self._assign(page, key)
                page.valid = True
            return True

    def cancel_prefetches(self) -> None:
        """Give back the pages held for regions that will not be demanded after all."""
        with self._cond:
            for page in self.pages:
                if page.prefetched:
                    page.prefetched = False
                    self._n_prefetched -= 1
                    if page.reading is None:
                        self._free[page.index] = page
            self._cond.notify_all()

    def get(self, key: Key, read: bool = True) -> _Page:
        """Pin the page holding `key`, reading it first unless `read` is False (the caller
        overwrites it whole). Time spent waiting here is stall time."""
        t0 = time.perf_counter()
        waited = False
        with self._cond:
            while True:
                self._raise_error()
                page = self._by_key.get(key)
                if page is None:
                    page = self._take_free(block=True)
                    if not self._free_was_immediate:
                        waited = True
                    if read:
                        self._start_read(page, key)
                        self.misses += 1
                    else:
                        self._assign(page, key)
                        page.valid = True  # the caller fills it
                    break
                if page.pinned:
                    raise OffloadError(f"region {key} is already in use")
                if page.writing is not None:  # its bytes are current; wait for the write
                    waited = True
                    self._cond.wait()
                    continue
                if read:
                    if page.reading is None:
                        self.hits += 1
                    else:
                        self.misses += 1
                if page.index in self._free:
                    del self._free[page.index]
                break
            if page.prefetched:
                page.prefetched = False
                self._n_prefetched -= 1
            page.pinned = True
            req = page.reading
        if req is not None:
            if not req.done():
                waited = True
            req.wait()
        if waited:
            self.stall_s += time.perf_counter() - t0
        return page

    def release(self, page: _Page, dirty: bool = False) -> None:
        """Unpin; a dirty page is written back (now, or at flush() when not streaming)."""
        with self._cond:
            page.pinned = False
            if dirty:
                page.dirty = True
            if page.dirty and self.write_behind:
                self._start_write(page)
            else:
                self._free[page.index] = page
            self._cond.notify_all()

    def discard(self, page: _Page) -> None:
        """Unpin and forget: the bytes no longer match the region (e.g. gradients after
        clipping scaled them in place)."""
        with self._cond:
            page.pinned = False
            page.dirty = False
            self._unassign(page)
            self._free[page.index] = page
            self._free.move_to_end(page.index, last=False)
            self._cond.notify_all()

    def flush(self) -> None:
        """Write every dirty page and wait for all writes: the swap files are then current."""
        t0 = time.perf_counter()
        with self._cond:
            for page in self.pages:
                if page.dirty and not page.pinned and page.writing is None:
                    del self._free[page.index]
                    self._start_write(page)
            while any(p.writing is not None for p in self.pages):
                self._cond.wait()
            self.stall_s += time.perf_counter() - t0
            self._raise_error()

    def reset(self) -> None:
        """Wait for the I/O in flight, then forget every region, pin and error: used when
        the swap files are replaced underneath (loading a checkpoint, after a failure)."""
        with self._cond:
            while any(p.reading is not None or p.writing is not None for p in self.pages):
                self._cond.wait()
            self._by_key.clear()
            self._free.clear()
            for page in self.pages:
                page.key, page.valid, page.dirty = None, False, False
                page.pinned = page.prefetched = False
                self._free[page.index] = page
            self._n_prefetched = 0
            self._error = self._error_req = None

    # -- internals (called with the lock held) --------------------------------------------

    def _take_free(self, block: bool) -> _Page | None:
        self._free_was_immediate = True
        while True:
            for idx, page in self._free.items():
                if not page.dirty:
                    del self._free[idx]
                    self._unassign(page)
                    return page
            if not block:
                return None
            if not any(p.writing is not None or p.reading is not None for p in self.pages):
                raise OffloadError(
                    "offload buffer pool exhausted (engine bug: more pages pinned than reserved)"
                )
            self._free_was_immediate = False
            self._cond.wait()
            self._raise_error()

    def _assign(self, page: _Page, key: Key) -> None:
        self._unassign(page)
        page.key = key
        self._by_key[key] = page

    def _unassign(self, page: _Page) -> None:
        if page.key is not None and self._by_key.get(page.key) is page:
            del self._by_key[page.key]
        page.key = None
        page.valid = False

    def _start_read(self, page: _Page, key: Key) -> None:
        self._assign(page, key)
        extents, path = self.store.extents(*key)
        req = self.io.submit(
            "r", [(fd, off, page.view[at : at + n]) for fd, off, at, n in extents], path
        )
        page.reading = req
        page.valid = True

        def done(r: IORequest, page: _Page = page) -> None:
            with self._cond:
                if page.reading is r:
                    page.reading = None
                if r.error is not None:
                    page.valid = False
                    self._unassign(page)
                if not page.pinned and not page.prefetched and page.index not in self._free:
                    self._free[page.index] = page  # a cancelled prefetch
                self._cond.notify_all()

        req.add_done_callback(done)

    def _start_write(self, page: _Page) -> None:
        assert page.key is not None
        self.store.before_write(*page.key)  # read-only regions refuse
        fd, offset, nbytes, path = self.store.locate(*page.key)
        page.dirty = False
        req = self.io.write(fd, offset, page.view[:nbytes], path)
        page.writing = req

        def done(r: IORequest, page: _Page = page) -> None:
            with self._cond:
                page.writing = None
                if r.error is not None:
                    page.dirty = True  # memory still holds the only good copy
                    if self._error is None:
                        self._error = r.error
                        self._error_req = r
                self._free[page.index] = page
                self._cond.notify_all()

        req.add_done_callback(done)

    def _raise_error(self) -> None:
        if self._error is not None:
            r = self._error_req
            raise translate_os_error(self._error, r.path, r.nbytes)

    def snapshot(self) -> dict:
        total = self.hits + self.misses
        return {
            "prefetch_hits": self.hits,
            "prefetch_misses": self.misses,
            "prefetch_hit_rate": self.hits / total if total else 0.0,
            "stall_s": self.stall_s,
        }
