"""Names of things in the store: the namespace fingerprint and the chained block keys.

A block's key is a SHA-256 over its parent's key, the namespace and its token ids, so a
key stands for the whole prefix up to the block's end, in this namespace (as vLLM's
`hash_block_tokens(parent hash, token ids, extra keys)` and LMCache's chunk prefix hashes).
Unlike vLLM's in-memory cache, keys here outlive the process: the chain starts from a root
derived from the namespace and FORMAT_VERSION, never from a random seed or Python's hash().
Token ids enter as fixed-width little-endian int64 bytes, so (1, 23) and (12, 3) differ.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Iterable

FORMAT_VERSION = "doctune-kv/2"  # the block file layout and key scheme; a change misses
ID_BYTES = 8  # each token id is stored and hashed as int64, little-endian


def fingerprint(**parts: str | int | bytes | None) -> str:
    """A namespace (64 hex digits) from named parts, e.g. the hashes of a model's weights,
    its dtype and library versions, plus this store's FORMAT_VERSION: any part changing
    gives another namespace, so caches made under other conditions are never found."""
    h = hashlib.sha256(b"doctune-kv-namespace\0")
    for name in sorted(parts):
        value = parts[name]
        if isinstance(value, bool) or not isinstance(value, (str, int, bytes, type(None))):
            raise TypeError(f"fingerprint part {name!r} must be str, int, bytes or None")
        if isinstance(value, bytes):
            kind, raw = b"b", value
        elif isinstance(value, str):
            kind, raw = b"s", value.encode()
        elif value is None:
            kind, raw = b"n", b""
        else:
            kind, raw = b"i", str(value).encode()
        key = name.encode()
        h.update(len(key).to_bytes(4, "little") + key + kind + len(raw).to_bytes(8, "little"))
        h.update(raw)
    h.update(b"\0format\0" + FORMAT_VERSION.encode())
    return h.hexdigest()


def ids_bytes(token_ids: Iterable[int]) -> bytes:
    """Token ids as fixed-width int64 little-endian bytes (what is hashed and stored)."""
    a = array.array("q", token_ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def ids_list(raw: bytes | memoryview) -> list[int]:
    a = array.array("q")
    a.frombytes(bytes(raw))
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def namespace_digest(namespace: str) -> bytes:
    return hashlib.sha256(namespace.encode()).digest()


def root_key(ns_digest: bytes) -> bytes:
    """The parent of a chain's first block (a key no file has)."""
    return hashlib.sha256(b"doctune-kv-root\0" + FORMAT_VERSION.encode() + ns_digest).digest()


def block_key(parent: bytes, ns_digest: bytes, ids: bytes | memoryview) -> bytes:
    """SHA-256(parent key || SHA-256(namespace) || the block's ids as int64 LE)."""
    h = hashlib.sha256(parent)
    h.update(ns_digest)
    h.update(ids)
    return h.digest()


def common_tokens(a: bytes | memoryview, b: bytes | memoryview) -> int:
    """How many leading token ids two int64 byte strings share (binary search over slice
    comparisons, which run in C)."""
    lo, hi = 0, min(len(a), len(b)) // ID_BYTES
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: mid * ID_BYTES] == b[: mid * ID_BYTES]:
            lo = mid
        else:
            hi = mid - 1
    return lo
