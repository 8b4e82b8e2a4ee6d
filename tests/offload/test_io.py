"""Aligned buffers, swap files, the I/O threads, and disk-full handling."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from offload import OffloadDiskFullError, OffloadError, probe_o_direct
from offload._io import (
    ALIGN,
    BufferPool,
    IOExecutor,
    SwapStore,
    aligned_empty,
    byte_view,
)
from tests.offload._tmpfs import small_tmpfs


def test_aligned_buffers_and_pool():
    for n in (1, 4096, 12345):
        assert aligned_empty(n).data_ptr() % ALIGN == 0
    pool = BufferPool(3, 8192)
    assert pool.nbytes == 3 * 8192
    assert all(t.data_ptr() % ALIGN == 0 and t.numel() == 8192 for t in pool.tensors)
    pool.tensors[1].fill_(7)
    assert bytes(pool.views[1][:3]) == b"\x07\x07\x07"  # views alias the tensors
    with pytest.raises(ValueError):
        BufferPool(1, 1000)


def test_probe_o_direct_on_this_disk(tmp_path):
    # ext4 and (on recent kernels) tmpfs accept O_DIRECT; the probe leaves nothing behind.
    assert probe_o_direct(tmp_path) is True
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("o_direct", [True, False])
def test_regions_round_trip_in_pieces_from_several_threads(tmp_path, o_direct):
    sizes = [3 * 2**20 + 8192, 4096, 2 * 2**20]  # regions larger and smaller than a piece
    store = SwapStore(tmp_path, {"weight": sizes, "exp_avg": sizes}, o_direct=o_direct)
    assert os.path.getsize(tmp_path / "weight.swap") == sum(sizes)  # preallocated
    io = IOExecutor(threads=3, chunk_bytes=2**20)
    pool = BufferPool(2, max(sizes))
    g = torch.Generator().manual_seed(0)
    written = {}
    for b, size in enumerate(sizes):
        src = pool.tensors[0][:size]
        src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
        written[b] = src.clone()
        fd, off, n, path = store.locate(b, "weight")
        io.write(fd, off, pool.views[0][:n], path).wait()
    for b, size in enumerate(sizes):
        fd, off, n, path = store.locate(b, "weight")
        io.read(fd, off, pool.views[1][:n], path).wait()
        assert torch.equal(pool.tensors[1][:size], written[b])
        fd, off, n, path = store.locate(b, "exp_avg")  # never written: reads zeros
        io.read(fd, off, pool.views[1][:n], path).wait()
        assert int(pool.tensors[1][:size].count_nonzero()) == 0
    stats = io.stats.snapshot()
    assert stats["bytes_written"] == sum(sizes)
    assert stats["bytes_read"] == 2 * sum(sizes)
    assert stats["read_gbps"] > 0 and stats["write_gbps"] > 0
    io.close()
    store.close(remove=True)
    assert not list(tmp_path.glob("*.swap"))


def test_reads_overtake_queued_writes(tmp_path):
    store = SwapStore(tmp_path, {"weight": [16 * 2**20, 2**20]}, o_direct=False)
    io = IOExecutor(threads=1, chunk_bytes=2**20)
    buf = BufferPool(2, 16 * 2**20)
    order, lock = [], threading.Lock()

    def note(name):
        def cb(_req):
            with lock:
                order.append(name)

        return cb

    fd, off, n, path = store.locate(0, "weight")
    for k in range(4):  # 4 writes of 16 pieces each, queued before the read
        io.write(fd, off, buf.views[0][:n], path).add_done_callback(note(f"w{k}"))
    fd1, off1, n1, _ = store.locate(1, "weight")
    read = io.read(fd1, off1, buf.views[1][:n1], path)
    read.add_done_callback(note("r"))
    read.wait()
    io.close()  # drains the queue
    assert order.index("r") < order.index("w3")
    assert len(order) == 5
    store.close(remove=True)


def test_write_on_a_full_disk_raises_and_keeps_earlier_data(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as small:
        ok = small / "ok.bin"
        ok.write_bytes(b"x" * 4096)
        fd = os.open(small / "big.bin", os.O_RDWR | os.O_CREAT, 0o600)
        io = IOExecutor(threads=2, chunk_bytes=2**20)
        data = BufferPool(1, 2 * 2**20)
        req = io.write(fd, 0, byte_view(data.tensors[0]), str(small / "big.bin"))
        with pytest.raises(OffloadDiskFullError, match="big.bin is full"):
            req.wait()
        io.close()
        os.close(fd)
        assert ok.read_bytes() == b"x" * 4096


def test_swap_store_refuses_what_does_not_fit_and_leaves_nothing(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as small:
        with pytest.raises(OffloadDiskFullError):
            SwapStore(small, {"weight": [512 * 1024], "exp_avg": [1024 * 1024]}, o_direct=False)
        assert list(small.iterdir()) == []


def test_one_engine_per_swap_directory(tmp_path):
    first = SwapStore(tmp_path, {"weight": [4096]}, o_direct=False)
    with pytest.raises(OffloadError, match="in use"):
        SwapStore(tmp_path, {"weight": [4096]}, o_direct=False)
    first.close(remove=True)
    SwapStore(tmp_path, {"weight": [4096]}, o_direct=False).close(remove=True)
    assert list(tmp_path.iterdir()) == []


def test_a_call_runs_on_an_io_thread_counts_its_bytes_and_keeps_its_error():
    io = IOExecutor(threads=2)
    try:
        seen: list[str] = []

        def read() -> int:
            seen.append(threading.current_thread().name)
            return 4096

        ok = io.call(read, "a")
        ok.wait()
        assert seen and seen[0].startswith("offload-io-")
        assert io.stats.snapshot()["bytes_read"] == 4096

        def broken() -> int:
            raise OSError(5, "Input/output error")

        bad = io.call(broken, "b")
        with pytest.raises(OffloadError, match="I/O on b failed"):
            bad.wait()
        assert io.stats.snapshot()["bytes_read"] == 4096  # nothing counted for it
    finally:
        io.close()


def test_a_byte_view_keeps_its_tensor_alive():
    """A view of a temporary (the checkpoint writes `byte_view(gpu_tensor.cpu())`) must not
    point at freed memory: on the GPU that wrote garbage adapters into checkpoints, or
    failed with EFAULT."""
    import gc
    import weakref

    t = torch.arange(4096, dtype=torch.float32)
    alive = weakref.ref(t)
    view = byte_view(t)
    del t
    gc.collect()
    assert alive() is not None
    assert torch.equal(torch.frombuffer(view, dtype=torch.float32), torch.arange(4096.0))
    del view
    gc.collect()
    assert alive() is None
