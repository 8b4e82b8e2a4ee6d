"""The disk's own limits: sequential writes and reads through the engine's I/O path."""

from __future__ import annotations

import os
import shutil
import time

from .._io import CHUNK, BufferPool, IOExecutor, SwapStore, probe_o_direct
from .common import GB


def disk_bench(directory: str, mib: int, threads: int, chunk_bytes: int = CHUNK) -> dict:
    """Write then read a `mib` MiB file in `directory` with the engine's I/O path.

    write_gbps: until the last write returned (what swap writes see: the engine never
    fsyncs its swap); write_durable_gbps: until the fsync after them returned (what a
    checkpoint needs). With buffered I/O the read figure is the page cache's, flagged."""
    o_direct = probe_o_direct(directory)
    size = mib << 20
    piece = min(size, 64 << 20)
    store = SwapStore(directory, {"bench": [size]}, o_direct)
    io = IOExecutor(threads, chunk_bytes)
    pool = BufferPool(1, piece)
    pool.tensors[0].random_(0, 256)  # incompressible
    fd, base, _, path = store.locate(0, "bench")
    try:
        t0 = time.perf_counter()
        reqs = [
            io.write(fd, base + off, pool.views[0][: min(piece, size - off)], path)
            for off in range(0, size, piece)
        ]
        for r in reqs:
            r.wait()
        t_written = time.perf_counter()
        os.fsync(fd)
        t1 = time.perf_counter()
        reqs = [
            io.read(fd, base + off, pool.views[0][: min(piece, size - off)], path)
            for off in range(0, size, piece)
        ]
        for r in reqs:
            r.wait()
        t2 = time.perf_counter()
    finally:
        io.close()
        store.close(remove=True)
    return {
        "o_direct": o_direct,
        "bytes": size,
        "threads": threads,
        "chunk_bytes": chunk_bytes,
        "write_gbps": size / (t_written - t0) / GB,
        "write_durable_gbps": size / (t1 - t0) / GB,
        "read_gbps": size / (t2 - t1) / GB,
        "read_from_page_cache": not o_direct,
    }


DISK_THREADS = (8, 16)


def disk_runs(directory: str, gib: float, repeats: int, when: str) -> list[dict]:
    runs = []
    for threads in DISK_THREADS:
        for i in range(repeats):
            d = os.path.join(directory, f"disk-{threads}-{i}")
            try:
                r = disk_bench(d, int(gib * 1024), threads)
            finally:
                shutil.rmtree(d, ignore_errors=True)
            r["when"] = when
            runs.append(r)
    return runs


def disk_limits(runs: list[dict]) -> dict:
    """The best write and the best read seen, with every run kept."""
    best = {k: runs[0][k] for k in ("o_direct", "bytes", "chunk_bytes", "read_from_page_cache")}
    for k in ("write_gbps", "write_durable_gbps", "read_gbps"):
        best[k] = max(r[k] for r in runs)
    keys = ("when", "threads", "write_gbps", "write_durable_gbps", "read_gbps")
    best["runs"] = [{k: r[k] for k in keys} for r in runs]
    return best
