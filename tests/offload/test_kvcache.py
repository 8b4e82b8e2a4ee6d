"""The SSD KV store (offload/kvcache): exact prefixes, files that are plain safetensors, the
index rebuilt from headers, bad files refused, namespaces, the cap and LRU, deletion, the
RAM tier, a full disk and two threads. Real files in tmp_path (and a real tmpfs), no model:
the store is model-agnostic, so random tensors in the KV layout stand in for a cache."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from offload._safetensors import decode_header
from offload.kvcache import FORMAT_VERSION, KVStore, _keys, default_cap_bytes, fingerprint
from offload.kvcache._blockfile import encode
from tests.offload._tmpfs import small_tmpfs

B = 16  # tokens per block in these tests
NS = fingerprint(model="test")


def make_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (n,), generator=g).tolist()


def make_layers(n: int, seed: int = 0, dtype=torch.float32, layers: int = 3):
    g = torch.Generator().manual_seed(1000 + seed)
    return [
        (torch.randn(2, n, 8, generator=g).to(dtype), torch.randn(2, n, 4, generator=g).to(dtype))
        for _ in range(layers)
    ]


def same_prefix(got, ref, n: int) -> bool:
    return len(got) == len(ref) and all(
        torch.equal(gk, rk[..., :n, :]) and torch.equal(gv, rv[..., :n, :])
        for (gk, gv), (rk, rv) in zip(got, ref, strict=True)
    )


def block_files(directory, ns: str = NS) -> list[str]:
    folder = os.path.join(directory, ns)
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def chain_paths(store: KVStore, ids: list[int]) -> list[str]:
    """The files of the blocks of `ids`, root first (from the store's index)."""
    steps = store._walk(_keys.ids_bytes(ids), len(ids), covered_only=True)
    return [st.entry.path for st in steps]


def disk_bytes(directory) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(directory)
        for f in files
    )


@pytest.fixture
def store(tmp_path):
    s = KVStore(tmp_path / "kv", NS, block_tokens=B, cap_bytes=1 << 30)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_exact_prefixes_round_trip_bit_for_bit(store, dtype):
    ids, layers = make_ids(50), make_layers(50, dtype=dtype)
    assert store.save(ids, layers) == 50
    assert len(block_files(store.directory)) == 4  # 3 full blocks and the last 2 tokens
    for request, expect in [
        (ids, 50),
        (ids + [7, 8], 50),  # a follow-up: everything stored
        (ids[:40], 40),  # ends inside a stored block: that block's first 8 tokens
        (ids[:16], 16),
        ([ids[0] + 1, *ids[1:]], 0),  # the first id differs
    ]:
        assert store.match(request) == expect
        n, got = store.load(request)
        assert n == expect
        assert same_prefix(got, layers, n) if n else got == []
    n, got = store.load(ids, max_tokens=49)  # prefill keeps one token to run
    assert n == 49 and same_prefix(got, layers, 49)
    assert got[0][0].dtype == dtype


def test_block_files_are_plain_safetensors_with_their_ids(store):
    ids, layers = make_ids(40), make_layers(40)
    store.save(ids, layers)
    first = chain_paths(store, ids)[0]
    tensors = load_file(first)  # the safetensors library itself reads it
    assert tensors["ids"].tolist() == ids[:B]
    assert torch.equal(tensors["k.0"], layers[0][0][:, :B]) and tensors["v.2"].shape == (2, B, 4)
    with safe_open(first, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT_VERSION and meta["namespace"] == NS
    assert (meta["start"], meta["tokens"], meta["layers"]) == ("0", str(B), "3")
    assert all(os.path.getsize(p) % 4096 == 0 for p in chain_paths(store, ids))  # O_DIRECT


def test_keys_chain_fixed_width_and_fingerprint(monkeypatch):
    nsd = _keys.namespace_digest(NS)
    root = _keys.root_key(nsd)
    a = _keys.block_key(root, nsd, _keys.ids_bytes([1, 2]))
    assert a == _keys.block_key(root, nsd, _keys.ids_bytes([1, 2]))  # deterministic
    assert a != _keys.block_key(a, nsd, _keys.ids_bytes([1, 2]))  # same ids, other parent
    assert a != _keys.block_key(root, _keys.namespace_digest("other"), _keys.ids_bytes([1, 2]))
    assert _keys.ids_bytes([1, 23]) != _keys.ids_bytes([12, 3])
    assert len(_keys.ids_bytes([1, 2**40])) == 16
    assert _keys.common_tokens(_keys.ids_bytes([1, 2, 3, 4]), _keys.ids_bytes([1, 2, 9])) == 2
    fp = fingerprint(weights="abc", dtype="float32")
    assert fp == fingerprint(dtype="float32", weights="abc") and len(fp) == 64
    assert fp != fingerprint(weights="abd", dtype="float32")
    assert fp != fingerprint(weights="abc", dtype="bfloat16")
    assert fingerprint(adapter=None) != fingerprint(adapter="")
    monkeypatch.setattr(_keys, "FORMAT_VERSION", "doctune-kv/0")
    assert fp != fingerprint(weights="abc", dtype="float32")
    with pytest.raises(TypeError):
        fingerprint(x=1.5)


def test_a_longer_save_writes_only_new_blocks_and_replaces_the_old_tail(store):
    ids, layers = make_ids(70), make_layers(70)
    store.save(ids[:50], [(k[:, :50], v[:, :50]) for k, v in layers])
    old_tail = chain_paths(store, ids[:50])[-1]
    written = store.stats()["blocks_written"]
    assert store.save(ids, layers) == 70
    assert store.stats()["blocks_written"] - written == 2  # [48, 64) and [64, 70)
    assert not os.path.exists(old_tail)  # [48, 50) is a prefix of [48, 64): superseded
    assert len(block_files(store.directory)) == 5
    n, got = store.load(ids[:50])  # still served, by the longer block
    assert n == 50 and same_prefix(got, layers, 50)


def test_a_request_that_parts_inside_a_block_reuses_up_to_there(store):
    ids, layers = make_ids(50), make_layers(50)
    store.save(ids, layers)
    other = make_ids(20, seed=9)
    n, got = store.load(ids[:37] + other)
    assert n == 37 and same_prefix(got, layers, 37)
    # Two shared tokens of a block are not worth reading its file: up to the block before.
    assert store.match(ids[:34] + other) == 32


def test_a_new_store_rebuilds_the_index_from_the_headers(tmp_path):
    ids, layers = make_ids(50), make_layers(50)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as first:
        first.save(ids, layers)
    again = KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30)  # as after a restart
    try:
        assert again.stats()["scanned_files"] == 4
        n, got = again.load(ids + [1])
        assert n == 50 and same_prefix(got, layers, 50)
    finally:
        again.close()


def _truncate(path, store, ids):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _other_ids(path, store, ids):
    """A well-formed block under the right name whose header names the right key and
    parent, but whose ids (and tensors) are another conversation's."""
    steps = store._walk(_keys.ids_bytes(ids), len(ids), covered_only=True)
    head = steps[1].entry.head
    buf = encode(NS, head.key, head.parent, head.start, B, _keys.ids_bytes(make_ids(B, 5)),
                 make_layers(B, seed=5), 0, B)
    with open(path, "wb") as f:
        f.write(buf.numpy().tobytes())


def _garbage_same_size(path, store, ids):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(os.urandom(size))


def tensor_offset(path, name: str) -> int:
    """Where tensor `name` starts in a block file (from its safetensors header)."""
    with open(path, "rb") as f:
        header, data_start = decode_header(f.read(1 << 16))
    return data_start + header[name]["data_offsets"][0]


def _flip_a_tensor_byte(path, store, ids, name: str = "k.0"):
    at = tensor_offset(path, name) + 10
    with open(path, "r+b") as f:  # the layer's checksum catches it
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _other_format_version(path, store, ids):
    with open(path, "rb") as f:
        data = f.read()
    old = f'"format":"{FORMAT_VERSION}"'.encode()
    assert old in data
    with open(path, "wb") as f:
        f.write(data.replace(old, b'"format":"' + b"x" * len(FORMAT_VERSION) + b'"'))


BAD = {
    "truncated": _truncate,
    "other ids under the right name": _other_ids,
    "garbage of the same size": _garbage_same_size,
    "one byte of tensor data flipped": _flip_a_tensor_byte,
    "another format version": _other_format_version,
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_block_is_a_miss_from_there_on_and_is_removed(tmp_path, kind, caplog):
    ids, layers = make_ids(50), make_layers(50)
    store = KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30)
    try:
        store.save(ids, layers)
        paths = chain_paths(store, ids)
        BAD[kind](paths[1], store, ids)
        with caplog.at_level(logging.WARNING, "offload.kvcache"):
            n, got = store.load(ids)
        assert n == B and same_prefix(got, layers, B)  # block 0 only
        assert "unusable" in caplog.text
        assert not any(os.path.exists(p) for p in paths[1:])  # it, and what hangs from it
        assert os.path.exists(paths[0]) and store.stats()["bad_blocks"] == 1
        assert store.load(ids)[0] == B  # no error the second time
        assert store.save(ids, layers) == 50 and store.load(ids)[0] == 50  # written again
    finally:
        store.close()


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_block_found_at_start_is_removed_with_its_descendants(tmp_path, kind):
    ids, layers = make_ids(50), make_layers(50)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as store:
        store.save(ids, layers)
        paths = chain_paths(store, ids)
        BAD[kind](paths[1], store, ids)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as store:
        n, got = store.load(ids)
        assert n == B and same_prefix(got, layers, B)
        assert block_files(tmp_path) == [os.path.basename(paths[0])]
        # The checksums are only read with the data: a flipped byte is caught on load.
        if kind != "one byte of tensor data flipped":
            assert store.stats()["removed_at_scan"] == 3


def test_another_namespace_misses(tmp_path):
    ids, layers = make_ids(50), make_layers(50)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as a:
        a.save(ids, layers)
        with KVStore(tmp_path, fingerprint(model="test", adapter="changed"), block_tokens=B,
                     cap_bytes=1 << 30) as b:
            assert b.match(ids) == 0 and b.load(ids) == (0, [])
            assert b.stats()["directory_files"] == 4  # the cap counts every namespace
        assert a.load(ids)[0] == 50


def _chain_bytes(tmp_path, n_tokens: int) -> int:
    with KVStore(tmp_path / "probe", NS, block_tokens=B, cap_bytes=1 << 30) as s:
        s.save(make_ids(n_tokens, 99), make_layers(n_tokens, 99))
        return s.stats()["directory_bytes"]


def test_lru_evicts_the_least_recently_used_chain_and_the_cap_always_holds(tmp_path):
    per_chain = _chain_bytes(tmp_path, 2 * B)  # two full blocks
    cap = 3 * per_chain
    chats = {c: (make_ids(2 * B, i), make_layers(2 * B, i)) for i, c in enumerate("ABCD")}
    directory = tmp_path / "kv"
    store = KVStore(directory, NS, block_tokens=B, cap_bytes=cap)
    for c in "ABC":
        store.save(*chats[c])
        assert disk_bytes(directory) <= cap
    assert store.load(chats["A"][0])[0] == 2 * B  # A used again: B is now the oldest
    store.close()
    store = KVStore(directory, NS, block_tokens=B, cap_bytes=cap)  # order survives a restart
    try:
        store.save(*chats["D"])
        assert disk_bytes(directory) <= cap
        assert store.stats()["directory_bytes"] == disk_bytes(directory)
        assert {c: store.match(chats[c][0]) for c in "ABCD"} == {
            "A": 2 * B, "B": 0, "C": 2 * B, "D": 2 * B}
    finally:
        store.close()


def test_a_partly_evicted_chain_restores_a_shorter_correct_prefix(tmp_path):
    per_block = _chain_bytes(tmp_path, B)
    directory = tmp_path / "kv"
    a, b, c = ((make_ids(2 * B, i), make_layers(2 * B, i)) for i in range(3))
    with KVStore(directory, NS, block_tokens=B, cap_bytes=5 * per_block) as store:
        store.save(*a)
        store.save(*b)
        store.load(a[0])
        store.save(*c)  # one block must go: B's tail, the oldest stamp
        assert disk_bytes(directory) <= 5 * per_block
        n, got = store.load(b[0])
        assert n == B and same_prefix(got, b[1], B)
        assert store.load(a[0])[0] == 2 * B and store.load(c[0])[0] == 2 * B


def test_a_chain_larger_than_the_cap_keeps_the_prefix_that_fits(tmp_path, caplog):
    per_block = _chain_bytes(tmp_path, B)
    ids, layers = make_ids(10 * B), make_layers(10 * B)
    directory = tmp_path / "kv"
    with KVStore(directory, NS, block_tokens=B, cap_bytes=3 * per_block) as store:
        with caplog.at_level(logging.INFO, "offload.kvcache"):
            assert store.save(ids, layers) == 3 * B
        assert "cap" in caplog.text and disk_bytes(directory) <= 3 * per_block
        n, got = store.load(ids)
        assert n == 3 * B and same_prefix(got, layers, n)


def test_forget_keeps_blocks_another_chain_uses_and_drop_removes_the_namespace(tmp_path):
    a_ids, a_layers = make_ids(50), make_layers(50)
    b_ids = a_ids[:2 * B] + make_ids(20, 7)  # shares A's first two blocks
    b_layers = [(torch.cat([k[:, :2 * B], k2], 1), torch.cat([v[:, :2 * B], v2], 1))
                for (k, v), (k2, v2) in zip(a_layers, make_layers(20, 7), strict=True)]
    other = fingerprint(model="other")
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as store, \
            KVStore(tmp_path, other, block_tokens=B, cap_bytes=1 << 30) as elsewhere:
        store.save(a_ids, a_layers)
        store.save(b_ids, b_layers)
        elsewhere.save(a_ids, a_layers)
        assert len(block_files(tmp_path)) == 4 + 2
        assert store.forget(a_ids + [5]) == 2  # A's own blocks [32, 48) and [48, 50)
        assert store.match(a_ids) == 2 * B
        n, got = store.load(b_ids)
        assert n == 52 and same_prefix(got, b_layers, 52)
        assert store.forget(b_ids) == 4
        assert block_files(tmp_path) == [] and store.match(b_ids) == 0
        store.save(a_ids, a_layers)
        assert store.drop_namespace() == 4
        assert not os.path.exists(tmp_path / NS)
        assert elsewhere.load(a_ids)[0] == 50  # another model version's caches stay
        assert store.save(a_ids, a_layers) == 50  # still usable afterwards


def test_no_ram_tier_holds_nothing_and_a_ram_tier_stays_under_its_size(tmp_path):
    ids, layers = make_ids(5 * B), make_layers(5 * B)
    with KVStore(tmp_path / "a", NS, block_tokens=B, cap_bytes=1 << 30) as store:
        store.save(ids, layers)
        store.load(ids)
        assert store.ram_nbytes == 0 and store.stats()["ram_blocks"] == 0
    per_block = _chain_bytes(tmp_path, B)
    ram = int(2.5 * per_block)
    with KVStore(tmp_path / "b", NS, block_tokens=B, cap_bytes=1 << 30, ram_bytes=ram) as store:
        store.save(ids, layers)
        assert 0 < store.ram_nbytes <= ram
        for _ in range(2):
            n, got = store.load(ids)
            assert n == 5 * B and same_prefix(got, layers, n) and store.ram_nbytes <= ram
        stats = store.stats()
        assert stats["blocks_from_ram"] >= 2 and stats["ram_blocks"] == 2
        store.forget(ids)
        assert store.ram_nbytes == 0


def test_a_full_disk_skips_the_save_without_raising(tmp_path, caplog):
    ids, layers = make_ids(200 * B), make_layers(200 * B)  # ~2.4 MB of block files
    with (small_tmpfs(tmp_path / "small", "1m") as small,
          KVStore(small, NS, block_tokens=B, cap_bytes=1 << 30) as store):
        with caplog.at_level(logging.WARNING, "offload.kvcache"):
            stored = store.save(ids, layers)
        assert 0 < stored < len(ids)
        assert "disk full" in caplog.text
        assert not [f for f in block_files(small) if f.endswith(".tmp")]
        n, got = store.load(ids)
        assert n == stored and same_prefix(got, layers, n)


def test_a_generating_thread_and_a_cleanup_thread(tmp_path):
    chats = [(make_ids(3 * B + 5, i), make_layers(3 * B + 5, i)) for i in range(4)]
    store = KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30)
    errors: list[BaseException] = []
    stop = threading.Event()

    def generating():
        try:
            for r in range(30):
                ids, layers = chats[r % 4]
                n, got = store.load(ids)
                assert n == 0 or same_prefix(got, layers, n)
                store.save(ids, layers)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            stop.set()

    def cleanup():
        try:
            i = 0
            while not stop.is_set():
                store.forget(chats[i % 4][0])
                if i % 7 == 0:
                    store.drop_namespace()
                i += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=generating), threading.Thread(target=cleanup)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    store.close()
    assert not errors, errors
    assert not [f for f in block_files(tmp_path) if f.endswith(".tmp")]


def test_the_default_cap_is_a_share_of_free_disk_and_a_closed_store_refuses(tmp_path):
    cap = default_cap_bytes(tmp_path, 0.1)
    with KVStore(tmp_path, NS) as store:
        assert abs(store.stats()["cap_bytes"] - cap) < 0.01 * cap + (64 << 20)
    with pytest.raises(RuntimeError):
        store.load([1, 2, 3])
    with pytest.raises(ValueError):
        KVStore(tmp_path, "../escape")


def test_a_forked_child_uses_a_store_made_before_the_fork(tmp_path):
    import multiprocessing

    ids, layers = make_ids(50), make_layers(50)
    store = KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30)
    store.save(ids, layers)

    def child(queue):
        n, got = store.load(ids)  # the parent's store: its I/O threads did not fork
        queue.put(n == 50 and same_prefix(got, layers, 50))

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(queue,))
    proc.start()
    proc.join(30)
    try:
        assert proc.exitcode == 0 and queue.get(timeout=1) is True
    finally:
        if proc.is_alive():
            proc.kill()
        store.close()
