"""Chat KV caches on the SSD: saved after each turn, restored by exact token-id prefix.

    from offload.kvcache import KVStore, fingerprint
    store = KVStore("/data/kvcache", fingerprint(weights=sha, dtype="float32"))
    n, layers = store.load(token_ids, max_tokens=len(token_ids) - 1)  # (0, []) on a miss
    s = store.stream(token_ids, max_tokens=len(token_ids) - 1)  # or layer by layer:
    s.wait(i)  # before using s.layers[i]; StreamFailed: throw the work away
    s.close()  # a bad block is removed then; load() gives the shorter prefix
    store.save(token_ids, layers)  # per layer (k, v), tokens on dim -2

Modules: store (KVStore: lookups, reads, saves, deletion), _keys (namespace fingerprint,
chained block keys), _blockfile (one block as a safetensors file: encode, check, atomic
write, whole-file O_DIRECT read), _stream (a restore read layer by layer under the
model's forward), _ledger (the directory's index rebuilt from headers, cap,
LRU), _ram (the optional RAM tier). torch, xxhash and the standard library only.
"""

from ._keys import FORMAT_VERSION, fingerprint
from ._stream import Streamed, StreamFailed
from .store import DEFAULT_DISK_SHARE, KVStore, default_cap_bytes

__all__ = ["DEFAULT_DISK_SHARE", "FORMAT_VERSION", "KVStore", "StreamFailed", "Streamed",
           "default_cap_bytes", "fingerprint"]
