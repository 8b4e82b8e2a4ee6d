"""KVStore: a conversation's KV cache on the SSD, by exact token-id prefix.

Model-agnostic: a cache is, per layer, a key and a value tensor with the tokens on dim -2
(transformers' [heads, tokens, head_dim] without the batch), any dtype, plus the token ids
it covers. It is stored as fixed blocks of `block_tokens` tokens, one file each
(_blockfile.py), keyed by a chained SHA-256 under the namespace (_keys.py); the last,
partial block is stored too, so exactly the saved tokens are kept.

Lookup walks the chain from its root: a block whose key (hence its whole prefix) matches is
used whole; where none does, the child of the last block that shares the longest run of
ids with the request is used up to there (a shorter saved tail, a regenerated answer, an
edited message: reuse stops exactly where the ids part). Every block read is checked: its
header names this namespace, key, parent and position, its ids equal the request's, its
tensors have the chain's shapes, and each layer's checksum matches; anything else is a miss from that
block on, logged, and the file (with the blocks after it) removed. Errors never reach the
caller as exceptions from load() or save(): a miss, or a save skipped, with a log line.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import torch

from .._io import OffloadDiskFullError, OffloadError, aligned_empty
from ._blockfile import (
    Block,
    BlockError,
    Head,
    PendingRead,
    encode,
    file_name,
    fsync_dir,
    parse,
    read_layout,
    stored_hashes,
    write_file,
)
from ._keys import ID_BYTES, block_key, common_tokens, ids_bytes, namespace_digest, root_key
from ._ledger import NAMESPACE_RE, Entry, open_ledger, release_ledger
from ._ram import RamTier
from ._stream import Part, Streamed, capacity

log = logging.getLogger("offload.kvcache")

DEFAULT_DISK_SHARE = 0.10  # the default cap: this share of the disk's free space
# A block only partly shared is read when it gives all the request's remaining ids, or at
# least this many (B/4 for small blocks): a whole file for one token is not worth it.
MIN_SHARED_TOKENS = 16
READ_AHEAD_BYTES = 64 << 20  # reads in flight ahead of the block being copied

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _layout(p: Part) -> set:
    """The (dtype, shape but for the tokens) of a block's keys and values: one element when
    one stacked buffer can take them all."""
    return {(t[0], t[1][:-2], t[1][-1]) for name, t in p.tensors.items()
            if name[:2] in ("k.", "v.")}


def _request(token_ids: Sequence[int], max_tokens: int | None) -> tuple[bytes, int]:
    """A lookup's ids as int64 bytes, and how many of them it may restore."""
    raw = ids_bytes(token_ids)
    limit = len(raw) // ID_BYTES
    if max_tokens is not None:
        limit = max(0, min(limit, int(max_tokens)))
    return raw, limit


def default_cap_bytes(directory: str | os.PathLike, share: float = DEFAULT_DISK_SHARE) -> int:
    """`share` of the free space on the disk holding `directory`."""
    os.makedirs(directory, exist_ok=True)
    return int(shutil.disk_usage(directory).free * share)


@dataclass
class _Step:
    entry: Entry
    pos: int  # the block's first token
    take: int  # tokens used from it


class _Dest:
    """Where a restore's blocks go: one tensor [layers, 2, ..., tokens, d] when the chain's
    first block has a uniform layout (one copy per block; each layer's k and v are
    contiguous views of it), else a (k, v) pair per layer. Later blocks must match it."""

    def __init__(self, first: Block, tokens: int, room: int = 0):
        s = first.stacked
        self.stacked = None
        tokens += room  # capacity: the caller grows the cache into it in place
        if s is not None:
            self.stacked = torch.empty((*s.shape[:-2], tokens, s.shape[-1]), dtype=s.dtype)
            self.pairs = [(self.stacked[i, 0], self.stacked[i, 1]) for i in range(len(s))]
        else:
            self.pairs = [
                tuple(torch.empty((*t.shape[:-2], tokens, t.shape[-1]), dtype=t.dtype)
                      for t in pair)
                for pair in first.layers
            ]

    def check(self, block: Block) -> None:
        if block.n_layers != len(self.pairs):
            raise BlockError("another number of layers than the chain's first block")
        if self.stacked is not None and block.stacked is not None:
            pairs = [(self.stacked[0], block.stacked[0])]
        else:
            pairs = [(d, t) for dp, tp in zip(self.pairs, block.layers, strict=True)
                     for d, t in zip(dp, tp, strict=True)]
        for d, t in pairs:
            if d.dtype != t.dtype or d.shape[:-2] != t.shape[:-2] or d.shape[-1] != t.shape[-1]:
                raise BlockError("other tensor shapes than the chain's first block")

    def copy(self, block: Block, pos: int, take: int) -> None:
        if self.stacked is not None and block.stacked is not None:
            self.stacked[..., pos : pos + take, :].copy_(block.stacked[..., :take, :])
            return
        for dp, tp in zip(self.pairs, block.layers, strict=True):
            for d, t in zip(dp, tp, strict=True):
                d[..., pos : pos + take, :].copy_(t[..., :take, :])

    def result(self, done: int) -> Layers:
        if done == self.pairs[0][0].shape[-2]:
            return list(self.pairs)
        return [(k[..., :done, :], v[..., :done, :]) for k, v in self.pairs]  # views: room


class KVStore:
    """The KV caches of one namespace (a model fingerprint) in `directory`.

    directory: shared by every namespace; the cap and the LRU span all of them.
    block_tokens: tokens per block file (a partial last block is stored as well).
    cap_bytes: bytes all block files in `directory` may take; None = DEFAULT_DISK_SHARE of
        the free space now (plus what the store already holds). The cap is the directory's:
        the store opened last in this process sets it for all.
    ram_bytes: a RAM tier of recently used block files in front of the SSD (0 = none:
        between calls the store holds no tensors, only its index: ~8 bytes per token).
    o_direct: "auto" (probe the directory), True or False; checksum: xxh3 per layer and block.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        namespace: str,
        block_tokens: int = 256,
        cap_bytes: int | None = None,
        ram_bytes: int = 0,
        *,
        o_direct: bool | str = "auto",
        checksum: bool = True,
        io_threads: int = 4,
    ):
        if sys.byteorder != "little":
            raise OffloadError("the KV store reads its files as little-endian")
        if not NAMESPACE_RE.fullmatch(namespace):
            raise ValueError(f"namespace {namespace!r}: letters, digits, '.', '_', '-' only")
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.directory = os.fspath(directory)
        self.namespace = namespace
        self.block_tokens = int(block_tokens)
        self.checksum = checksum
        self._nsd = namespace_digest(namespace)
        self._root = root_key(self._nsd)
        self._ram = RamTier(ram_bytes)
        self._ledger = open_ledger(self.directory, o_direct, io_threads)
        self._closed = False
        self._stats = {
            "loads": 0, "streamed": 0, "hits": 0, "tokens_restored": 0, "blocks_from_disk": 0,
            "blocks_from_ram": 0, "bytes_read": 0, "load_s": 0.0, "bad_blocks": 0,
            "saves": 0, "blocks_written": 0, "bytes_written": 0, "save_s": 0.0,
            "saves_cut_short": 0,
        }
        with self._ledger.lock:
            self._ledger.listeners.add(self)
            if cap_bytes is None:
                free = shutil.disk_usage(self._ledger.directory).free
                cap_bytes = int((free + self._ledger.total_bytes) * DEFAULT_DISK_SHARE)
            self._ledger.set_cap(int(cap_bytes))

    # -- lookups ---------------------------------------------------------------------------

    def _walk(self, raw: bytes, limit: int, covered_only: bool) -> list[_Step]:
        """The blocks a request's ids (`raw`, int64 bytes) can use, up to `limit` tokens.
        covered_only: only blocks whose every id is in the request (for forget)."""
        entries, children = self._ledger.entries, self._ledger.children
        n_ids, b = len(raw) // ID_BYTES, self.block_tokens
        parent, pos, out = self._root, 0, []
        while pos < limit:
            n = min(b, n_ids - pos)
            chunk = raw[pos * ID_BYTES : (pos + n) * ID_BYTES]
            key = block_key(parent, self._nsd, chunk)
            e = entries.get(key)
            if e is not None and e.head.tokens == n and e.head.start == pos:
                out.append(_Step(e, pos, min(n, limit - pos)))
                if n < b:
                    break
                parent, pos = key, pos + n
                continue
            best, shared = None, 0
            for child_key in children.get(parent, ()):
                c = entries[child_key]
                if c.head.start != pos:
                    continue
                m = common_tokens(c.head.ids, chunk)
                if covered_only and m < c.head.tokens:
                    continue
                if m > shared or (m == shared and best is not None
                                  and c.head.size < best.head.size):
                    best, shared = c, m
            if best is not None and shared and (
                shared in (best.head.tokens, n) or shared >= min(MIN_SHARED_TOKENS, b // 4)
            ):
                out.append(_Step(best, pos, min(shared, limit - pos)))
            break
        return out

    def match(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the store has (from its index; a block
        found bad when read makes load() return fewer)."""
        raw = ids_bytes(token_ids)
        with self._ledger.lock:
            steps = self._walk(raw, len(raw) // ID_BYTES, covered_only=False)
        return steps[-1].pos + steps[-1].take if steps else 0

    def load(self, token_ids: Sequence[int], max_tokens: int | None = None,
             room: int = 0) -> tuple[int, Layers]:
        """The cache of the longest stored prefix of `token_ids` (at most `max_tokens`):
        (n, per-layer (k, v) with n tokens on dim -2, on the CPU). (0, []) on a miss.

        `room`: each k and v is then a view of the first n tokens of a buffer with `room`
        more (its stride on dim -3 tells the capacity), so the caller can append the
        next tokens in place instead of copying the whole cache to grow it."""
        raw, limit = _request(token_ids, max_tokens)
        t0 = time.perf_counter()
        with self._ledger.lock:
            self._check_open()
            self._stats["loads"] += 1
            steps = self._walk(raw, limit, covered_only=False) if limit else []
            n, layers = self._read(steps, raw, room) if steps else (0, [])
            if n:
                self._stats["hits"] += 1
                self._stats["tokens_restored"] += n
            self._stats["load_s"] += time.perf_counter() - t0
        return n, layers

    def _read(self, steps: list[_Step], raw: bytes, room: int = 0) -> tuple[int, Layers]:
        """Read the blocks of `steps` (several in flight), check each, copy into one tensor
        per layer; stop at the first bad block."""
        total = steps[-1].pos + steps[-1].take
        pending: dict[int, PendingRead | BaseException] = {}
        buffers: dict[int, torch.Tensor] = {}
        issued, in_flight = 0, 0

        def issue_more(upto: int) -> None:
            nonlocal issued, in_flight
            while issued < len(steps) and (issued <= upto or in_flight < READ_AHEAD_BYTES):
                e = steps[issued].entry
                buf = self._ram.get(e.head.key)
                if buf is not None:
                    buffers[issued] = buf
                else:
                    try:
                        pending[issued] = PendingRead(self._ledger.io, e.path, e.head.size,
                                                      self._ledger.o_direct, self.checksum)
                        in_flight += e.head.size
                    except (OSError, BlockError) as exc:
                        pending[issued] = exc
                issued += 1

        dest: _Dest | None = None
        done = 0  # tokens copied
        used: list[Entry] = []
        try:
            for i, st in enumerate(steps):
                issue_more(i)
                from_ram = i in buffers
                try:
                    if from_ram:
                        block = parse(buffers.pop(i), None)
                    else:
                        p = pending.pop(i)
                        if isinstance(p, BaseException):
                            raise p
                        in_flight -= st.entry.head.size
                        buf = p.wait()
                        block = parse(buf, p.hashes if self.checksum else None)
                    self._check(block, st, raw)
                    if dest is None:
                        dest = _Dest(block, total, room)
                    else:
                        dest.check(block)
                except (BlockError, OffloadError, OSError) as exc:
                    self._bad(st.entry, exc)
                    break
                dest.copy(block, st.pos, st.take)
                done = st.pos + st.take
                used.append(st.entry)
                if from_ram:
                    self._stats["blocks_from_ram"] += 1
                else:
                    self._stats["blocks_from_disk"] += 1
                    self._stats["bytes_read"] += st.entry.head.size
                    if self._ram.capacity:
                        self._ram.put(st.entry.head.key, buf)
        finally:
            for p in pending.values():  # reads still in flight write into their buffers
                if isinstance(p, PendingRead):
                    try:
                        p.wait()
                    except (BlockError, OffloadError, OSError):
                        pass
        if not done:
            return 0, []
        self._ledger.touch(used)
        return done, dest.result(done)

    def stream(self, token_ids: Sequence[int], max_tokens: int | None = None,
               room: int = 0) -> Streamed | None:
        """Like load(), but returns once the blocks' headers are read and checked: the
        layers arrive while the caller computes (_stream.py; wait(i) before using layer i,
        close() when done). None when there is nothing to stream (a miss, a block in the
        RAM tier, layers of different shapes or dtypes): load() then does it all."""
        raw, limit = _request(token_ids, max_tokens)
        with self._ledger.lock:
            self._check_open()
            steps = self._walk(raw, limit, covered_only=False) if limit else []
            if not steps or any(st.entry.head.key in self._ram for st in steps):
                return None
            parts: list[Part] = []
            mixed = False  # layers of other shapes or dtypes than the first block's
            first: set = set()
            for st in steps:
                try:
                    part = self._open_part(st, raw)
                except (BlockError, OffloadError, OSError) as exc:
                    self._bad(st.entry, exc)
                    break
                parts.append(part)
                layout = _layout(part)
                first = first or layout
                mixed = (len(first) != 1 or layout != first
                         or part.entry.head.layers != parts[0].entry.head.layers)
                if mixed:
                    break
            if not parts or mixed:
                for p in parts:
                    os.close(p.fd)
                return None
            self._stats["loads"] += 1
            self._stats["streamed"] += 1
            n = parts[-1].pos + parts[-1].take
            dtype, shape, _, _ = parts[0].tensors["k.0"]
            cap = capacity(n + room, shape[-1] * dtype.itemsize)
            layers = parts[0].entry.head.layers
            whole = (layers, 2, *shape[:-2], cap, shape[-1])
            buf = aligned_empty(math.prod(whole) * dtype.itemsize)
            stacked = buf.view(dtype).view(whole)
            return Streamed(self._ledger.io, parts, stacked, n, self._streamed)

    def _open_part(self, st: _Step, raw: bytes) -> Part:
        """A block's file opened for a stream, its header read and checked like load's."""
        e = st.entry
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self._ledger.o_direct else 0)
        fd = os.open(e.path, flags)
        try:
            size = os.fstat(fd).st_size
            if size != e.head.size:
                raise BlockError(f"the file has {size} bytes, the index says {e.head.size}")
            meta, tensors, layers, _tokens, ids = read_layout(fd, size)
            self._check_head(meta, ids, st, raw)
            hashes = stored_hashes(meta, layers) if self.checksum else None
            return Part(e, st.pos, st.take, fd, tensors, hashes)
        except BaseException:
            os.close(fd)
            raise

    def _streamed(self, s: Streamed) -> None:
        """A stream closed: the blocks it used are recent, or the bad one goes."""
        with self._ledger.lock:
            self._stats["load_s"] += s.read_s or 0.0
            if s.error is not None:
                part, exc = s.error
                if self._ledger.entries.get(part.entry.head.key) is part.entry:
                    self._bad(part.entry, exc)
                return
            self._stats["hits"] += 1
            self._stats["tokens_restored"] += s.tokens
            self._stats["blocks_from_disk"] += len(s.parts)
            self._stats["bytes_read"] += s.bytes_read
            self._ledger.touch([p.entry for p in s.parts])

    def _check(self, block: Block, st: _Step, raw: bytes) -> None:
        """The block is the one the index and the request expect."""
        self._check_head(block.meta, block.ids, st, raw)

    def _check_head(self, meta: dict[str, str], ids, st: _Step, raw: bytes) -> None:
        head = st.entry.head
        if (meta.get("namespace") != self.namespace or meta.get("key") != head.key.hex()
                or meta.get("parent") != head.parent.hex() or meta.get("start") != str(st.pos)
                or meta.get("tokens") != str(head.tokens)):
            raise BlockError("its header names another block")
        if ids != head.ids:
            raise BlockError("its token ids differ from the ones it was indexed with")
        lo, hi = st.pos * ID_BYTES, (st.pos + st.take) * ID_BYTES
        if ids[: hi - lo] != raw[lo:hi]:
            raise BlockError("its token ids differ from the request's")

    def _bad(self, entry: Entry, exc: BaseException) -> None:
        log.warning("kv cache: block %s is unusable (%s): removed, the rest is prefilled",
                    entry.path, exc)
        self._stats["bad_blocks"] += 1
        self._ledger.remove(entry.head.key, f"unusable: {exc}")

    # -- saving ----------------------------------------------------------------------------

    def save(self, token_ids: Sequence[int], layers: Layers) -> int:
        """Store the cache of exactly `token_ids` (`layers`: per layer (k, v), tokens on
        dim -2, len(token_ids) of them), writing only the blocks not stored yet. Returns how
        many leading tokens are stored now: fewer when the cap or a full disk stopped it
        (logged, never raised)."""
        raw = ids_bytes(token_ids)
        n = len(raw) // ID_BYTES
        if not layers:
            raise ValueError("no layers to save")
        for k, v in layers:
            if k.dim() < 2 or v.dim() < 2 or k.shape[-2] != n or v.shape[-2] != n:
                raise ValueError(f"each tensor needs {n} tokens on dim -2")
        if n == 0:
            return 0
        t0 = time.perf_counter()
        b = self.block_tokens
        with self._ledger.lock:
            self._check_open()
            self._stats["saves"] += 1
            ledger = self._ledger
            chain: list[Entry] = []
            parent, pos = self._root, 0
            while pos < n:  # the blocks already stored
                m = min(b, n - pos)
                key = block_key(parent, self._nsd, raw[pos * ID_BYTES : (pos + m) * ID_BYTES])
                e = ledger.entries.get(key)
                if e is None or e.head.tokens != m:
                    break
                chain.append(e)
                parent, pos = key, pos + m
            stored = pos
            folder = ledger.namespace_dir(self.namespace)
            written = 0
            while pos < n:
                m = min(b, n - pos)
                chunk = raw[pos * ID_BYTES : (pos + m) * ID_BYTES]
                key = block_key(parent, self._nsd, chunk)
                if not written:
                    try:
                        os.makedirs(folder, exist_ok=True)
                    except OSError as exc:
                        log.warning("kv cache: cannot create %s (%s): not saved", folder, exc)
                        break
                buf = encode(self.namespace, key, parent, pos, b, chunk, layers, pos, pos + m)
                if not ledger.make_room(buf.numel(), {e.head.key for e in chain}):
                    log.info("kv cache: the cap (%d bytes) holds %d of these %d tokens",
                             ledger.cap_bytes, stored, n)
                    self._stats["saves_cut_short"] += 1
                    break
                path = os.path.join(folder, file_name(key))
                try:
                    write_file(ledger.io, path, buf, ledger.o_direct)
                except OffloadDiskFullError as exc:
                    log.warning("kv cache: disk full, %d of %d tokens saved: %s", stored, n, exc)
                    self._stats["saves_cut_short"] += 1
                    break
                except (OffloadError, OSError) as exc:
                    log.warning("kv cache: could not write %s (%s): %d of %d tokens saved",
                                path, exc, stored, n)
                    self._stats["saves_cut_short"] += 1
                    break
                head = Head(self.namespace, key, parent, pos, m, len(layers), buf.numel(),
                            bytes(chunk))
                chain.append(ledger.add(head, path, time.time_ns()))
                written += 1
                self._stats["blocks_written"] += 1
                self._stats["bytes_written"] += buf.numel()
                if self._ram.capacity:
                    self._ram.put(key, buf)
                self._drop_superseded(parent, key, chunk)
                parent, pos = key, pos + m
                stored = pos
            if written:
                try:
                    fsync_dir(folder)
                except OSError as exc:
                    log.warning("kv cache: fsync of %s failed: %s", folder, exc)
            ledger.touch(chain)
            self._stats["save_s"] += time.perf_counter() - t0
        return stored

    def _drop_superseded(self, parent: bytes, key: bytes, ids: bytes) -> None:
        """Siblings whose ids are a strict prefix of the new block's serve no request the
        new one does not (lookups take the longest shared run): remove them."""
        ledger = self._ledger
        for sib in list(ledger.children.get(parent, ())):
            e = ledger.entries[sib]
            if sib != key and e.head.tokens < len(ids) // ID_BYTES and ids.startswith(e.head.ids):
                ledger.remove(sib, "superseded by a longer block")

    # -- deleting --------------------------------------------------------------------------

    def forget(self, token_ids: Sequence[int]) -> int:
        """A conversation is deleted: remove the blocks of its chain (pass all its ids)
        from the end back, stopping at a block another stored chain goes on from. A chain
        that is a prefix of this one shares its blocks and goes with it (a later miss, never
        a wrong answer). Returns the files removed."""
        raw = ids_bytes(token_ids)
        with self._ledger.lock:
            self._check_open()
            steps = self._walk(raw, len(raw) // ID_BYTES, covered_only=True)
            removed = 0
            for st in reversed(steps):
                key = st.entry.head.key
                if self._ledger.children.get(key):
                    break
                removed += self._ledger.remove(key, "conversation forgotten")
            return removed

    def drop_namespace(self) -> int:
        """A model version is deleted: remove every block of this namespace. The store stays
        usable (empty). Returns the files removed."""
        with self._ledger.lock:
            self._check_open()
            self._ram.clear()
            return self._ledger.drop_namespace(self.namespace)

    def _removed(self, namespace: str, key: bytes) -> None:
        if namespace == self.namespace:
            self._ram.drop(key)

    # -- state -----------------------------------------------------------------------------

    @property
    def ram_nbytes(self) -> int:
        """Bytes of tensors the RAM tier holds now (0 without one)."""
        return self._ram.nbytes

    def stats(self) -> dict:
        """Counters of this store, and the directory's files, bytes and cap."""
        ledger = self._ledger
        with ledger.lock:
            mine = [e for e in ledger.entries.values() if e.head.namespace == self.namespace]
            return {
                **self._stats,
                "namespace_files": len(mine),
                "namespace_bytes": sum(e.head.size for e in mine),
                "directory_files": len(ledger.entries),
                "directory_bytes": ledger.total_bytes,
                "cap_bytes": ledger.cap_bytes,
                "ram_bytes": self._ram.nbytes,
                "ram_blocks": len(self._ram),
                "o_direct": ledger.o_direct,
                "scanned_files": ledger.scanned_files,
                "removed_at_scan": ledger.removed_at_scan,
                "evicted": ledger.evicted,
                "io": ledger.io.stats.snapshot(),
            }

    def _check_open(self) -> None:
        if self._closed:
            raise OffloadError("this KVStore is closed")

    def close(self) -> None:
        """Release the directory (the last store on it stops its I/O threads); idempotent."""
        with self._ledger.lock:
            if self._closed:
                return
            self._closed = True
            self._ram.clear()
            self._ledger.listeners.discard(self)
        release_ledger(self._ledger)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
