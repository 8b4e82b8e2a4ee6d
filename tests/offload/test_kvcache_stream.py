"""A restore read layer by layer (KVStore.stream, offload/kvcache/_stream.py): the same
tensors as load(), every layer checked before it is handed over, a bad layer failing its
wait and every later one, the bad block removed on close so load() gives the shorter
prefix, and the cases it leaves to load(). Real files, O_DIRECT where tmp_path allows."""

from __future__ import annotations

import os

import pytest
import torch

from offload.kvcache import KVStore, StreamFailed
from tests.offload.test_kvcache import (
    BAD,
    NS,
    _flip_a_tensor_byte,
    chain_paths,
    make_ids,
    same_prefix,
)

B = 16
LAYERS = 4


def make_layers(n: int, seed: int = 0, dtype=torch.float32, heads: int = 2, dim: int = 64):
    """Keys and values of one shape per layer (what one stacked buffer takes); rows of 16
    float32 tokens x 64 = 4 KiB, so whole blocks go straight into the buffer."""
    g = torch.Generator().manual_seed(2000 + seed)
    return [tuple(torch.randn(heads, n, dim, generator=g).to(dtype) for _ in "kv")
            for _ in range(LAYERS)]


def take_all(s) -> tuple[int, list]:
    """Every layer waited for, as a forward would, then closed."""
    try:
        for i in range(len(s.layers)):
            s.wait(i)
    except StreamFailed:
        s.close()
        raise
    assert s.close() is True
    return s.tokens, s.layers


@pytest.fixture
def store(tmp_path):
    s = KVStore(tmp_path / "kv", NS, block_tokens=B, cap_bytes=1 << 30)
    yield s
    s.close()


@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 64),
                                       (torch.float32, 24)],
                         ids=["f32-aligned-rows", "bf16", "f32-unaligned-rows"])
def test_a_stream_gives_what_load_gives(store, dtype, dim):
    ids, layers = make_ids(70), make_layers(70, dtype=dtype, dim=dim)
    assert store.save(ids, layers) == 70
    for request, expect in [
        (ids + [5], 70),  # four whole blocks and a partial one
        (ids[:40], 40),  # ends inside a block: part of it, through the bounce buffer
        (ids[:32] + [1, 2, 3], 32),
    ]:
        s = store.stream(request, room=100)
        assert s is not None
        n, got = take_all(s)
        assert n == expect and same_prefix(got, layers, expect)
        assert n == store.load(request)[0]
        k = got[0][0]
        capacity = k.stride(-3) // k.stride(-2)
        assert capacity >= expect + 100  # room to grow in place
    st = store.stats()
    assert st["streamed"] == 3 and st["bad_blocks"] == 0 and st["tokens_restored"] == 2 * 142


def test_a_miss_a_ram_tier_and_mixed_shapes_are_left_to_load(tmp_path):
    ids = make_ids(40)
    with KVStore(tmp_path / "a", NS, block_tokens=B, cap_bytes=1 << 30) as store:
        assert store.stream(ids) is None  # nothing stored
        store.save(ids, make_layers(40))
        assert store.stream([ids[0] + 1, *ids[1:]]) is None
    with KVStore(tmp_path / "b", NS, block_tokens=B, cap_bytes=1 << 30,
                 ram_bytes=1 << 30) as store:
        store.save(ids, make_layers(40))  # the RAM tier keeps what it wrote
        assert store.stream(ids) is None and store.load(ids)[0] == 40
    mixed = [(torch.randn(2, 40, 8), torch.randn(2, 40, 4)) for _ in range(3)]
    with KVStore(tmp_path / "c", NS, block_tokens=B, cap_bytes=1 << 30) as store:
        store.save(ids, mixed)
        assert store.stream(ids) is None and store.load(ids)[0] == 40


def test_a_bad_layer_fails_its_wait_and_the_block_goes_on_close(tmp_path):
    ids, layers = make_ids(64), make_layers(64)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as store:
        store.save(ids, layers)
        paths = chain_paths(store, ids)
        _flip_a_tensor_byte(paths[2], store, ids, name="v.2")  # block 2, layer 2
        s = store.stream(ids)
        s.wait(0)
        s.wait(1)  # the layers before it are good and handed over
        with pytest.raises(StreamFailed, match="layer 2: checksum mismatch"):
            s.wait(2)
        with pytest.raises(StreamFailed):
            s.wait(3)  # and nothing after it
        assert s.close() is False
        assert not any(os.path.exists(p) for p in paths[2:])  # it, and what hangs from it
        assert os.path.exists(paths[1]) and store.stats()["bad_blocks"] == 1
        n, got = store.load(ids)
        assert n == 2 * B and same_prefix(got, layers, 2 * B)


@pytest.mark.parametrize("kind", list(BAD))
def test_every_kind_of_bad_block_is_caught_by_a_stream_too(tmp_path, kind):
    ids, layers = make_ids(50), make_layers(50)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as store:
        store.save(ids, layers)
        paths = chain_paths(store, ids)
        BAD[kind](paths[1], store, ids)
        s = store.stream(ids)
        try:
            n, got = take_all(s)  # the header was bad: the stream stops before it
        except StreamFailed:  # the data was: the wait says so, load gives the rest
            assert s.close() is False
            n, got = store.load(ids)
        assert n == B and same_prefix(got, layers, B)
        assert not any(os.path.exists(p) for p in paths[1:])
        assert store.stats()["bad_blocks"] == 1


def test_a_file_removed_while_streaming_is_still_read(tmp_path):
    """Eviction may unlink a block a stream has open: its reads go on (Linux keeps the
    inode), and the stream's result is whole."""
    ids, layers = make_ids(48), make_layers(48)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30) as store:
        store.save(ids, layers)
        s = store.stream(ids)
        store.forget(ids)
        assert not any(os.scandir(tmp_path / NS))
        n, got = take_all(s)
        assert n == 48 and same_prefix(got, layers, 48)


def test_short_reads_are_read_on(tmp_path, monkeypatch):
    """preadv may return fewer bytes than asked (a signal, a network filesystem): the rest is
    read from where it stopped, into the right rows."""
    ids, layers = make_ids(32), make_layers(32)
    with KVStore(tmp_path, NS, block_tokens=B, cap_bytes=1 << 30, o_direct=False) as store:
        store.save(ids, layers)  # (buffered: O_DIRECT never stops inside 512 bytes)
        real = os.preadv

        def short(fd, views, offset):  # at most 5000 bytes a call (1 1/4 rows of 4 KiB)
            first = memoryview(views[0])
            return real(fd, [first[:5000]], offset)

        monkeypatch.setattr(os, "preadv", short)
        n, got = take_all(store.stream(ids))
        assert n == 32 and same_prefix(got, layers, 32)
