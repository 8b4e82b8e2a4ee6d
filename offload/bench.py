"""python -m offload.bench: what the disk does, and what the engine makes of it.

1. Disk: a file of --disk-mib MiB written then read with the engine's own I/O path (a
   thread pool issuing 1 MiB pwritev/preadv, O_DIRECT when the directory allows it; with
   buffered I/O the read figure is the page cache's, and is flagged as such).
2. Training: the same small Llama-shaped model (offload._toy, plain torch) trained for
   --steps steps three ways: in memory with torch.optim.AdamW; through the engine with a
   budget that holds everything; through the engine with a budget of a third of the
   training state (every block streams). The first step of each is a warm-up and is left
   out of the timings. Losses are compared for bitwise equality.

Prints a table, then one JSON line with every figure (last line)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import tempfile
import time

import torch

from ._config import AdamWConfig, OffloadConfig
from ._io import CHUNK, BufferPool, IOExecutor, SwapStore, probe_o_direct
from ._plan import activation_bytes
from ._toy import ToyLM
from .engine import OffloadEngine


def disk_bench(directory: str, mib: int, threads: int) -> dict:
    o_direct = probe_o_direct(directory)
    size = mib << 20
    piece = min(size, 64 << 20)
    store = SwapStore(directory, {"bench": [size]}, o_direct)
    io = IOExecutor(threads, CHUNK)
    pool = BufferPool(1, piece)
    pool.tensors[0].random_(0, 256)
    fd, base, _, path = store.locate(0, "bench")
    try:
        t0 = time.perf_counter()
        reqs = [
            io.write(fd, base + off, pool.views[0][: min(piece, size - off)], path)
            for off in range(0, size, piece)
        ]
        for r in reqs:
            r.wait()
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
        "write_gbps": size / (t1 - t0) / 1e9,
        "read_gbps": size / (t2 - t1) / 1e9,
        "read_from_page_cache": not o_direct,
    }


def _batches(steps: int, batch: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def _timed(step_fn, batches) -> tuple[list[float], float]:
    losses, times = [], []
    for b in batches:
        t0 = time.perf_counter()
        losses.append(step_fn(b))
        times.append(time.perf_counter() - t0)
    warm = times[1:] or times
    return losses, sum(warm) / len(warm)


def train_bench(swap_dir: str, steps: int, batch: int, seq: int, shape: dict) -> dict:
    torch.manual_seed(0)
    base = ToyLM(**shape)
    state = 4 * sum(p.numel() * p.element_size() for p in base.parameters())
    batches = _batches(steps, batch, seq, shape["vocab_size"])
    optim = AdamWConfig(lr=1e-4, weight_decay=0.01, max_grad_norm=1.0)

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def mem_step(b):
        loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    mem_losses, mem_s = _timed(mem_step, batches)
    result = {
        "state_bytes": state,
        "tokens_per_step": batch * seq,
        "in_memory_s_per_step": mem_s,
        "threads": torch.get_num_threads(),
    }

    act = int(activation_bytes(base.config, batch, seq) * 1.1)
    for name, budget in (("fits", 4 * state), ("streams", state // 3)):
        d = os.path.join(swap_dir, name)
        eng = OffloadEngine(
            copy.deepcopy(base), optim, OffloadConfig(budget, d, prefetch=2, activation_bytes=act)
        )
        losses, s = _timed(eng.step, batches)
        t = eng.telemetry()
        eng.close()
        result[name] = {
            "budget_bytes": budget,
            "s_per_step": s,
            "ratio_to_in_memory": s / mem_s,
            "bitwise_equal_losses": losses == mem_losses,
            "streaming": t["streaming"],
            "o_direct": t["o_direct"],
            "read_gb": t["bytes_read"] / 1e9,
            "written_gb": t["bytes_written"] / 1e9,
            "read_gbps": t["read_gbps"],
            "write_gbps": t["write_gbps"],
            "stall_s": t["stall_s"],
            "prefetch_hit_rate": t["prefetch_hit_rate"],
            "peak_bytes_accounted": t["peak_bytes"],
        }
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: temp)")
    ap.add_argument("--disk-mib", type=int, default=512)
    ap.add_argument("--io-threads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = tempfile.mkdtemp(prefix="offload-bench-", dir=args.dir)
    shape = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    }
    try:
        disk = disk_bench(os.path.join(root, "disk"), args.disk_mib, args.io_threads)
        train = train_bench(os.path.join(root, "swap"), args.steps, args.batch, args.seq, shape)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    print(
        f"disk ({'O_DIRECT' if disk['o_direct'] else 'buffered'}, {args.disk_mib} MiB, "
        f"{args.io_threads} threads): write {disk['write_gbps']:.2f} GB/s, "
        f"read {disk['read_gbps']:.2f} GB/s"
    )
    print(
        f"model {shape}, training state {train['state_bytes'] / 2**20:.0f} MiB, "
        f"{train['tokens_per_step']} tokens/step, {train['threads']} torch threads"
    )
    print(
        f"{'run':<10}{'budget MiB':>11}{'s/step':>9}{'x mem':>7}{'bitwise':>9}"
        f"{'read GB':>9}{'write GB':>9}{'rd GB/s':>9}{'wr GB/s':>9}{'stall s':>9}{'hit':>6}"
    )
    print(f"{'in memory':<10}{'-':>11}{train['in_memory_s_per_step']:>9.3f}{1:>7.2f}{'-':>9}")
    for name in ("fits", "streams"):
        r = train[name]
        print(
            f"{'engine ' + name:<10}{r['budget_bytes'] / 2**20:>11.0f}{r['s_per_step']:>9.3f}"
            f"{r['ratio_to_in_memory']:>7.2f}{r['bitwise_equal_losses']!s:>9}"
            f"{r['read_gb']:>9.2f}{r['written_gb']:>9.2f}{r['read_gbps']:>9.2f}"
            f"{r['write_gbps']:>9.2f}{r['stall_s']:>9.2f}{r['prefetch_hit_rate']:>6.2f}"
        )
    result = {"disk": disk, "train": train, "shape": shape}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
