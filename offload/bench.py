"""python -m offload.bench: the disk's own limits, and what the engine makes of them.

Sections, in one run (--only picks some; --skip-headline drops the long one):
  disk        sequential write, then read, of a --disk-gib GiB file through the engine's
              own I/O path (O_DIRECT when the directory allows it; 1 MiB pwritev/preadv
              from 8 and from 16 threads), --disk-repeats times each, at the start and
              again at the end of the run: the limits are the best of all of them.
  lora        LoRA (rank 16 on every projection, the recipe's default) of SmolLM2-135M
              (--model-dir; a random model of its shape without one): plain peft in memory
              against the engine with the frozen base streamed from model.safetensors.
  full        full fine-tune of the same model: in memory against the engine with every
              block streamed (weights, Adam m and v, spilled gradients in the swap).
  checkpoint  save_checkpoint and load_checkpoint of that full fine-tune's state (on the
              swap's filesystem: the swap files are renamed into the checkpoint), and the
              copy a save makes to another filesystem.
  headline    a ~2B-parameter Llama-shaped model built from a config on the meta device
              and created block by block in the swap (random weights, never whole in
              memory), fully fine-tuned (AdamW, fp32) under a 4 GiB budget for a few
              steps, in a fresh process so its peak RSS is its own. Its swap files are
              removed afterwards, on failure and Ctrl-C too; it writes no checkpoint.

Both sides of a comparison use the recipe's arithmetic (AdamW, clipping at 1.0, 1-D
parameters not decayed) on the same batches, and their losses are compared bit for bit.
Timing: in-memory and engine steps alternate (A B A B ...), so both see the same load on
a shared machine; the first pair is a warm-up; ratios are medians over the other pairs.
I/O rates are bytes over the time transfers were in flight ("while streaming").

Prints a table, then one JSON line with every figure (the last line).

transformers and peft are imported inside the functions that build models: they are
this command's dependencies, not the library's (offload/ imports torch and the standard
library only, see tests/offload/test_boundaries.py)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from . import _checkpoint
from ._config import AdamWConfig, OffloadConfig
from ._io import CHUNK, BufferPool, IOExecutor, SwapStore, probe_o_direct
from ._plan import activation_bytes, graph_bytes
from .engine import OffloadEngine, find_blocks

GB = 1e9
SECTIONS = ("disk", "lora", "full", "checkpoint", "headline")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# SmolLM2-135M's shape: the stand-in when no --model-dir is given (random weights).
SMOL_SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
# The headline: Llama-shaped (TinyLlama's block, tied embeddings as Llama 3.2), 44 blocks
# of 45M parameters: 2.05B parameters, 32.8 GB of weights, gradients, Adam m and v.
HEADLINE_SHAPE = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 44,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
ADAMW = AdamWConfig(lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, no_decay_1d=True)


# -- the disk ------------------------------------------------------------------------------


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


# -- models --------------------------------------------------------------------------------


def _quiet_transformers() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def prepare_model_dir(model_dir: str | None, scratch: str) -> tuple[str, str]:
    """(folder with config.json and model.safetensors, description). Without a model
    folder: a random model of SmolLM2-135M's shape, saved in `scratch`."""
    if model_dir:
        folder = Path(model_dir).expanduser()
        if not (folder / "model.safetensors").is_file():
            raise SystemExit(f"{folder} has no model.safetensors (a Hugging Face model folder)")
        return str(folder), f"{folder.name} ({folder})"
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOL_SHAPE)).save_pretrained(scratch)
    return scratch, "random weights, SmolLM2-135M's shape (no --model-dir)"


def load_model(folder: str):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)


def lora_wrap(model, rank: int = 16):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # the adapters' initial values
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return get_peft_model(model, cfg)


def batches(n: int, batch: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def in_memory_step(model) -> Callable[[dict], float]:
    """The reference: worker/training/engines.py's InMemoryEngine arithmetic with the HF loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": ADAMW.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=ADAMW.lr)

    def step(b: dict) -> float:
        loss = model(**b, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, ADAMW.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def fixed_bytes(model) -> tuple[int, int]:
    """(memory the engine keeps outside its page pool, one page), as the engine counts
    them: resident parameters with gradients and Adam state, one block's gradients,
    AdamW's scratch; a page holds one block's streamed weights."""
    blocks = find_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    frozen_base = any(not p.requires_grad for b in blocks for p in b.parameters())

    def nbytes(ps) -> int:
        return sum(p.numel() * p.element_size() for p in ps)

    def streamed(block) -> list:
        return [p for p in block.parameters() if not (frozen_base and p.requires_grad)]

    resident = [p for p in model.parameters() if id(p) not in in_blocks]
    resident += [p for b in blocks for p in b.parameters() if frozen_base and p.requires_grad]
    trainable = [p for p in resident if p.requires_grad]
    block_grads = 0 if frozen_base else max(nbytes(streamed(b)) for b in blocks)
    scratch = 2 * max((nbytes([p]) for p in model.parameters() if p.requires_grad), default=0)
    page = max(nbytes(streamed(b)) + 64 * len(streamed(b)) for b in blocks)
    page = -(-page // 4096) * 4096
    return nbytes(resident) + 3 * nbytes(trainable) + block_grads + scratch, page


def streaming_budget(model, act: int, pages: int) -> int:
    """A budget whose page pool holds `pages` block regions: every block streams."""
    fixed, page = fixed_bytes(model)
    return fixed + act + pages * page


def _io_delta(before: dict, after: dict) -> dict:
    rd = after["bytes_read"] - before["bytes_read"]
    wr = after["bytes_written"] - before["bytes_written"]
    return {
        "read_bytes": rd,
        "written_bytes": wr,
        "read_busy_s": after["read_busy_s"] - before["read_busy_s"],
        "write_busy_s": after["write_busy_s"] - before["write_busy_s"],
        "stall_s": after["stall_s"] - before["stall_s"],
    }


def _rate(nbytes: int, busy: float) -> float:
    return nbytes / busy / GB if busy > 0 else 0.0


def compare(mem_step, engines: dict[str, OffloadEngine], data: list[dict]) -> dict:
    """Alternate the in-memory step and each engine's step on the same batches (A B C A B
    C ...); the first round warms up. Returns one result per engine."""
    rounds: list[dict[str, float]] = []
    io: dict[str, list[dict]] = {name: [] for name in engines}
    losses: dict[str, list[float]] = {name: [] for name in [*engines, "memory"]}
    for i, b in enumerate(data):
        times = {}
        t0 = time.perf_counter()
        losses["memory"].append(mem_step(b))
        times["memory"] = time.perf_counter() - t0
        for name, eng in engines.items():
            before = eng.telemetry()
            t0 = time.perf_counter()
            losses[name].append(eng.step(b))
            times[name] = time.perf_counter() - t0
            io[name].append(_io_delta(before, eng.telemetry()))
        rounds.append(times)
        line = ", ".join(f"{k} {v:6.2f} s" for k, v in times.items())
        print(f"    step {i}: {line}", file=sys.stderr, flush=True)
    timed = rounds[1:] or rounds
    out = {}
    for name, eng in engines.items():
        steps = io[name][1:] or io[name]
        tot = {k: sum(d[k] for d in steps) for k in steps[0]}
        t = eng.telemetry()
        out[name] = {
            "steps_timed": len(timed),
            "in_memory_s_per_step": statistics.mean(r["memory"] for r in timed),
            "engine_s_per_step": statistics.mean(r[name] for r in timed),
            "ratio": statistics.median(r[name] / r["memory"] for r in timed),
            "step_s": [r[name] for r in rounds],
            "in_memory_step_s": [r["memory"] for r in rounds],
            "bitwise_equal_losses": losses[name] == losses["memory"],
            "losses": losses[name],
            "read_gb_per_step": tot["read_bytes"] / len(timed) / GB,
            "written_gb_per_step": tot["written_bytes"] / len(timed) / GB,
            "read_gbps": _rate(tot["read_bytes"], tot["read_busy_s"]),
            "write_gbps": _rate(tot["written_bytes"], tot["write_busy_s"]),
            "stall_s_per_step": tot["stall_s"] / len(timed),
            "kept_graphs": t["kept_graphs"],
            "streaming": t["streaming"],
            "o_direct": t["o_direct"],
            "pages": t["pages"],
            "blocks": len(find_blocks(eng.model)),
            "page_bytes": t["page_bytes"],
            "budget_bytes": t["budget_bytes"],
            "peak_bytes_accounted": t["peak_bytes"],
            "prefetch_hit_rate": t["prefetch_hit_rate"],
            "blocks_read_from_weights_files": t["blocks_read_from_weights_files"],
        }
    return out


def _state_bytes(model, trainable_only: bool = False) -> int:
    ps = [p for p in model.parameters() if p.requires_grad or not trainable_only]
    return sum(p.numel() * p.element_size() for p in ps)


def _engine(model, budget: int, act: int, swap: str, args, **kw) -> OffloadEngine:
    cfg = OffloadConfig(
        budget, swap, prefetch=args.prefetch, io_threads=args.io_threads, activation_bytes=act
    )
    return OffloadEngine(model, ADAMW, cfg, **kw)


def lora_bench(folder: str, root: str, args) -> dict:
    """Plain peft in memory against two engines whose page pool holds 4 of the blocks:
    one whose budget also holds every block's graph (no recompute), one whose budget holds
    only the checkpointed activations (each block recomputed in the backward)."""
    mem = lora_wrap(load_model(folder))
    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    cfg = mem.config
    act = activation_bytes(cfg, args.batch, args.seq)
    graphs = graph_bytes(cfg, args.batch, args.seq)
    pages = 2 + args.prefetch  # the engine's streaming pool for read-only blocks
    engines = {}
    try:
        for name, need in (("kept", act + graphs), ("recompute", act)):
            model = lora_wrap(load_model(folder))
            a = int(need * 1.1)
            swap = os.path.join(root, f"swap-lora-{name}")
            engines[name] = _engine(
                model, streaming_budget(model, a, pages), a, swap, args, weights_files=files
            )
        data = batches(args.steps, args.batch, args.seq, cfg.vocab_size)
        out = compare(in_memory_step(mem), engines, data)
    finally:
        for eng in engines.values():
            eng.close()
    for r in out.values():
        r["adapter_params"] = sum(p.numel() for p in mem.parameters() if p.requires_grad)
        r["base_weight_bytes"] = _state_bytes(mem) - _state_bytes(mem, trainable_only=True)
    return out


def full_bench(folder: str, root: str, args, checkpoint: bool) -> tuple[dict | None, dict | None]:
    """In memory against the engine whose page pool holds 16 block regions (weights,
    gradients, m and v of 2 + prefetch blocks): every block streams, each step."""
    base = load_model(folder)
    model = copy.deepcopy(base)
    cfg = model.config
    act = int(activation_bytes(cfg, args.batch, args.seq) * 1.1)
    pages = 4 * (2 + args.prefetch)
    eng = _engine(
        model, streaming_budget(model, act, pages), act, os.path.join(root, "swap-full"), args
    )
    try:
        full = None
        if "full" in args.sections:
            data = batches(args.steps, args.batch, args.seq, cfg.vocab_size)
            full = compare(in_memory_step(base), {"streamed": eng}, data)["streamed"]
            full["state_bytes"] = 4 * _state_bytes(model)
        del base
        ckpt = None
        if checkpoint:
            ckpt = checkpoint_bench(eng, os.path.join(root, "ckpt"), os.path.join(root, "copy"))
    finally:
        eng.close()
    return full, ckpt


def _drop_cache(directory: str) -> None:
    """Evict a directory's (fsynced, clean) files from the page cache, so that reading
    them measures the disk."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint_bench(eng: OffloadEngine, directory: str, copy_dir: str) -> dict:
    """save_checkpoint and load_checkpoint into `directory` (on the swap's filesystem: the
    swap files are renamed into it, not copied), then the copies a save makes when the
    checkpoint is on another filesystem (the same code, _checkpoint._copy_out, timed)."""
    kinds = [k for k in ("weight", "exp_avg", "exp_avg_sq") if k in eng._store.files]
    swap_bytes = sum(eng._store.files[k].nbytes for k in kinds)
    t0 = time.perf_counter()
    eng.save_checkpoint(directory)
    save_s = time.perf_counter() - t0
    names = os.listdir(directory)
    nbytes = sum(os.path.getsize(os.path.join(directory, n)) for n in names)
    resident = sum(os.path.getsize(os.path.join(directory, n)) for n in names if "resident" in n)
    renamed = _checkpoint._same_filesystem(eng._store.directory, directory)
    _drop_cache(directory)
    t0 = time.perf_counter()
    eng.load_checkpoint(directory)
    load_s = time.perf_counter() - t0
    _drop_cache(directory)
    os.makedirs(copy_dir, exist_ok=True)
    t0 = time.perf_counter()
    for kind in kinds:  # reads the checkpoint's files, where the regions now are
        _checkpoint._copy_out(eng, kind, os.path.join(copy_dir, f"{kind}.bin"))
    copy_s = time.perf_counter() - t0
    shutil.rmtree(copy_dir, ignore_errors=True)
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "bytes": nbytes,
        "swap_file_bytes": swap_bytes,
        "resident_bytes": resident,
        "swap_files_renamed": renamed,
        "save_s": save_s,
        "load_s": load_s,
        "save_gbps": nbytes / save_s / GB,
        "load_gbps": nbytes / load_s / GB,
        "copy_s": copy_s,
        "copy_gbps": swap_bytes / copy_s / GB,
    }


# -- the headline: ~2B parameters, more than RAM ------------------------------------------------


def _meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _status(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def random_init(name: str, t: torch.Tensor) -> None:
    """Deterministic random weights, per parameter name (seeded by its CRC32)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if t.ndim >= 2:
        t.normal_(0.0, 0.02, generator=g)
    else:
        t.fill_(1.0)


def headline(args) -> dict:
    """Runs in its own process (see main): build on the meta device, stream, train."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(HEADLINE_SHAPE, num_hidden_layers=args.headline_layers)
    cfg = LlamaConfig(**shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    state = 16 * n_params  # fp32 weights, gradients, Adam m and v
    blocks = find_blocks(model)
    block_bytes = sum(p.numel() * 4 for p in blocks[0].parameters())
    swap = 4 * block_bytes * len(blocks)  # weights, m, v, spilled gradients
    mem_total = _meminfo("MemTotal")
    act = int(activation_bytes(cfg, args.headline_batch, args.headline_seq) * 1.25)
    out = {
        "shape": shape,
        "params": n_params,
        "training_state_bytes": state,
        "in_memory_needs_bytes": state + act,
        "mem_total_bytes": mem_total,
        "in_memory_fits": state + act <= mem_total,
        "swap_bytes": swap,
        "budget_bytes": args.headline_budget,
        "batch": args.headline_batch,
        "seq": args.headline_seq,
    }
    free = shutil.disk_usage(args.headline_dir).free
    if free < swap + (4 << 30):
        out["skipped"] = (
            f"needs {swap / GB:.1f} GB of swap plus 4 GiB spare in {args.headline_dir}; "
            f"{free / GB:.1f} GB free"
        )
        return out

    # The interpreter with torch and transformers loaded, before any weight exists.
    out["baseline_rss_bytes"] = _status("VmRSS")
    # Everything outside the blocks is real (embeddings, final norm, rotary tables).
    g = torch.Generator().manual_seed(0)
    emb = torch.empty(cfg.vocab_size, cfg.hidden_size).normal_(0.0, 0.02, generator=g)
    model.model.embed_tokens.weight = torch.nn.Parameter(emb)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    model.model.norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size))
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)

    t0 = time.perf_counter()
    eng = OffloadEngine(
        model,
        ADAMW,
        OffloadConfig(
            args.headline_budget,
            os.path.join(args.headline_dir, "swap"),
            prefetch=args.prefetch,
            io_threads=args.io_threads,
            activation_bytes=act,
        ),
        init_weights=random_init,
    )
    try:
        out["create_s"] = time.perf_counter() - t0
        out["create_written_bytes"] = eng.telemetry()["bytes_written"]
        print(
            f"    created {n_params / 1e9:.2f}B parameters in the swap in {out['create_s']:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        data = batches(args.headline_steps, args.headline_batch, args.headline_seq, cfg.vocab_size)
        steps = []
        for i, b in enumerate(data):
            before = eng.telemetry()
            t0 = time.perf_counter()
            loss = eng.step(b)
            s = time.perf_counter() - t0
            d = _io_delta(before, eng.telemetry())
            d.update(s=s, loss=loss)
            steps.append(d)
            print(
                f"    step {i}: {s:.0f} s, loss {loss:.4f}, read {d['read_bytes'] / GB:.1f} GB at "
                f"{_rate(d['read_bytes'], d['read_busy_s']):.2f} GB/s, wrote "
                f"{d['written_bytes'] / GB:.1f} GB at "
                f"{_rate(d['written_bytes'], d['write_busy_s']):.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )
        t = eng.telemetry()
    finally:
        eng.close()
    timed = steps[1:] or steps
    rd = sum(d["read_bytes"] for d in timed)
    wr = sum(d["written_bytes"] for d in timed)
    out.update(
        steps=steps,
        s_per_step=statistics.mean(d["s"] for d in timed),
        read_gb_per_step=rd / len(timed) / GB,
        written_gb_per_step=wr / len(timed) / GB,
        read_gbps=_rate(rd, sum(d["read_busy_s"] for d in timed)),
        write_gbps=_rate(wr, sum(d["write_busy_s"] for d in timed)),
        stall_s_per_step=statistics.mean(d["stall_s"] for d in timed),
        tokens_per_s=args.headline_batch
        * args.headline_seq
        / statistics.mean(d["s"] for d in timed),
        peak_rss_bytes=_status("VmHWM"),
        malloc_mmap_threshold=t.get("malloc_mmap_threshold"),
        training_rss_bytes=_status("VmHWM") - out["baseline_rss_bytes"],
        peak_bytes_accounted=t["peak_bytes"],
        pool_bytes=t["pool_bytes"],
        pages=t["pages"],
        page_bytes=t["page_bytes"],
        resident_bytes=t["resident_bytes"],
        o_direct=t["o_direct"],
        finite_losses=all(d["loss"] == d["loss"] for d in steps),
    )
    return out


def run_headline_child(args, root: str) -> dict:
    """The headline in a fresh interpreter: its peak RSS is not the earlier sections'."""
    cmd = [
        sys.executable, "-m", "offload.bench", "--headline-child",
        "--headline-dir", os.path.join(root, "headline"),
        "--headline-budget-gib", str(args.headline_budget / 2**30),
        "--headline-steps", str(args.headline_steps),
        "--headline-layers", str(args.headline_layers),
        "--headline-batch", str(args.headline_batch),
        "--headline-seq", str(args.headline_seq),
        "--prefetch", str(args.prefetch), "--io-threads", str(args.io_threads),
    ]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    os.makedirs(os.path.join(root, "headline"), exist_ok=True)
    # No MALLOC_MMAP_THRESHOLD_ from outside: the engine fixes glibc's mmap threshold itself
    # when it streams (offload/_malloc.py), and this run shows that is enough.
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        lines = proc.stdout.read().splitlines()
        rc = proc.wait()
    except BaseException:
        proc.terminate()  # its finally blocks remove the swap files
        proc.wait()
        raise
    if rc != 0 or not lines:
        return {"failed": f"the headline process exited with status {rc}"}
    out = json.loads(lines[-1])
    return out


# -- report ----------------------------------------------------------------------------------


def _machine() -> dict:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpus": cpus,
        "cpu": _cpu_model(),
        "mem_total_bytes": _meminfo("MemTotal"),
        "loadavg": list(os.getloadavg()),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _copy_bound(read: float, write: float) -> float:
    """GB/s of a copy that reads at `read` and then writes at `write` (no overlap)."""
    return 1 / (1 / read + 1 / write) if read and write else 0.0


def _pct(x: float, of: float) -> str:
    return f"{100 * x / of:.0f}%" if of else "-"


def report(r: dict) -> None:
    m = r["machine"]
    print(
        f"\noffload benchmark, {m['date']}: {m['cpus']} CPUs ({m['cpu']}), "
        f"{m['mem_total_bytes'] / 2**30:.1f} GiB RAM, torch {m['torch']} with "
        f"{m['torch_threads']} threads; load average at start "
        f"{' '.join(f'{x:.2f}' for x in m['loadavg'])}, at end "
        f"{' '.join(f'{x:.2f}' for x in r['loadavg_end'])}"
    )
    disk = r.get("disk")
    w = disk["write_gbps"] if disk else 0.0
    wd = disk["write_durable_gbps"] if disk else 0.0
    rd = disk["read_gbps"] if disk else 0.0
    if disk:
        print(
            f"disk limits: write {w:.2f} GB/s ({wd:.2f} GB/s counting the fsync), read "
            f"{rd:.2f} GB/s ({'O_DIRECT' if disk['o_direct'] else 'buffered: read is the page cache'}, "
            f"{disk['bytes'] / 2**30:.1f} GiB file, 1 MiB pieces, best of {len(disk['runs'])} "
            f"runs with {' and '.join(map(str, DISK_THREADS))} threads at start and end)"
        )
    runs = []
    if r.get("lora"):
        runs.append(("LoRA r16", r["lora"]["kept"], "graphs kept"))
        runs.append(("LoRA r16", r["lora"]["recompute"], "recompute"))
    if r.get("full"):
        runs.append(("full FT", r["full"], "recompute"))
    rows, last = [], None
    for label, x, how in runs:
        if label != last:
            rows.append((f"{label}, in memory", "-", f"{x['in_memory_s_per_step']:.2f}", "1.00"))
            last = label
        lora = label.startswith("LoRA")
        rows.append(
            (
                f"{label}, engine ({how})",
                f"{x['budget_bytes'] / 2**30:.2f} GiB, pool {x['pages']}/{x['blocks']} blocks",
                f"{x['engine_s_per_step']:.2f}",
                f"{x['ratio']:.2f}",
                str(x["bitwise_equal_losses"]),
                f"{x['read_gb_per_step']:.2f} @ {x['read_gbps']:.2f} "
                + ("(page cache)" if lora else f"({_pct(x['read_gbps'], rd)})"),
                f"{x['written_gb_per_step']:.2f} @ {x['write_gbps']:.2f} "
                f"({_pct(x['write_gbps'], w)})"
                if x["written_gb_per_step"]
                else "0",
                f"{x['stall_s_per_step']:.2f}",
            )
        )
    if rows:
        head = ("run", "budget", "s/step", "x mem", "bitwise", "read GB/step @ GB/s",
                "written GB/step @ GB/s", "stall s")  # fmt: skip
        widths = [
            max(len(row[i]) for row in [head, *rows] if i < len(row)) for i in range(len(head))
        ]
        print(f"{r['model']}; batch {r['batch']} x {r['seq']} tokens")
        for row in [head, *rows]:
            print("  ".join(str(c).ljust(wd) for c, wd in zip(row, widths)).rstrip())
    c = r.get("checkpoint")
    if c:
        how = "renamed into it, not copied" if c["swap_files_renamed"] else "copied"
        print(
            f"checkpoint of the full fine-tune, {c['bytes'] / GB:.2f} GB (swap files "
            f"{c['swap_file_bytes'] / GB:.2f} GB, {how}; resident state and Adam moments "
            f"{c['resident_bytes'] / GB:.2f} GB, written): save {c['save_s']:.2f} s "
            f"({c['save_gbps']:.2f} GB/s effective, {_pct(c['save_gbps'], wd)} of fsynced "
            f"write), load {c['load_s']:.2f} s ({c['load_gbps']:.2f} GB/s effective; the next "
            f"step reads the regions from the checkpoint instead of the swap); to another "
            f"filesystem the swap files are copied at {c['copy_gbps']:.2f} GB/s "
            f"({_pct(c['copy_gbps'], wd)} of fsynced write; a copy reads as much as it writes, "
            f"and reading then writing at the disk's limits gives {_copy_bound(rd, wd):.2f} GB/s)"
        )
    h = r.get("headline")
    if h:
        print(
            f"headline: {h['params'] / 1e9:.2f}B-parameter Llama ({h['shape']['num_hidden_layers']}"
            f" x {h['shape']['hidden_size']}), training state {h['training_state_bytes'] / GB:.1f}"
            f" GB vs {h['mem_total_bytes'] / GB:.1f} GB of RAM: in memory "
            + ("fits" if h["in_memory_fits"] else "cannot hold it")
        )
        if "skipped" in h or "failed" in h:
            print(f"  not run: {h.get('skipped') or h.get('failed')}")
        else:
            print(
                f"  engine, budget {h['budget_bytes'] / 2**30:.1f} GiB, batch {h['batch']} x "
                f"{h['seq']}: {h['s_per_step']:.0f} s/step ({h['tokens_per_s']:.1f} tokens/s), "
                f"peak RSS {h['peak_rss_bytes'] / 2**30:.2f} GiB (engine's malloc mmap threshold "
                f"{h.get('malloc_mmap_threshold') or 'not set'}) = "
                f"{h['baseline_rss_bytes'] / 2**30:.2f} GiB interpreter with torch and "
                f"transformers + {h['training_rss_bytes'] / 2**30:.2f} GiB training (engine-"
                f"accounted {h['peak_bytes_accounted'] / 2**30:.2f} GiB), swap "
                f"{h['swap_bytes'] / GB:.1f} GB"
                f" (created in {h['create_s']:.0f} s, removed); per step read "
                f"{h['read_gb_per_step']:.1f} GB @ {h['read_gbps']:.2f} GB/s "
                f"({_pct(h['read_gbps'], rd)}), wrote {h['written_gb_per_step']:.1f} GB @ "
                f"{h['write_gbps']:.2f} GB/s ({_pct(h['write_gbps'], w)}), stall "
                f"{h['stall_s_per_step']:.0f} s"
            )
    t = r.get("targets")
    if t:
        print("targets: " + "; ".join(f"{k} {v}" for k, v in t.items()))


def targets(r: dict) -> dict:
    out = {}
    disk = r.get("disk")
    if r.get("lora"):
        x = r["lora"]["kept"]["ratio"]
        out["LoRA step ratio <= 1.15"] = f"{x:.2f} {'met' if x <= 1.15 else 'MISSED'}"
    if not disk:
        return out
    w, wd, rd = disk["write_gbps"], disk["write_durable_gbps"], disk["read_gbps"]

    def check(name: str, got: float, limit: float) -> None:
        share = got / limit if limit else 0.0
        out[name] = f"{100 * share:.0f}% {'met' if share >= 0.7 else 'MISSED'}"

    if r.get("full"):
        check("full FT read >= 70% of disk", r["full"]["read_gbps"], rd)
        check("full FT write >= 70% of disk", r["full"]["write_gbps"], w)
    h = r.get("headline")
    if h and "s_per_step" in h:
        check("headline read >= 70% of disk", h["read_gbps"], rd)
        check("headline write >= 70% of disk", h["write_gbps"], w)
    if r.get("checkpoint"):
        c = r["checkpoint"]
        check("checkpoint save >= 70% of fsynced write", c["save_gbps"], wd)
        check("checkpoint load >= 70% of read", c["load_gbps"], rd)
        check("checkpoint copy to another filesystem >= 70% of fsynced write", c["copy_gbps"], wd)
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m offload.bench", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--dir", default=None, help="where swap and test files go (default: temp)")
    ap.add_argument("--model-dir", default=None, help="SmolLM2-135M as a Hugging Face folder")
    ap.add_argument("--only", default=None, help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--skip-headline", action="store_true", help="everything but the headline")
    ap.add_argument("--steps", type=int, default=5, help="steps per run; the first warms up")
    ap.add_argument("--batch", type=int, default=4, help="rows per step (the recipe's default)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (the recipe's default)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--disk-gib", type=float, default=4.0)
    ap.add_argument("--disk-repeats", type=int, default=1)
    ap.add_argument("--headline-budget-gib", type=float, default=4.0)
    ap.add_argument("--headline-steps", type=int, default=3)
    ap.add_argument("--headline-layers", type=int, default=HEADLINE_SHAPE["num_hidden_layers"])
    ap.add_argument("--headline-batch", type=int, default=1)
    ap.add_argument("--headline-seq", type=int, default=256)
    ap.add_argument("--headline-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--headline-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.headline_budget = int(args.headline_budget_gib * 2**30)
    if args.only:
        args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = set(args.sections) - set(SECTIONS)
        if unknown:
            ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    else:
        args.sections = [s for s in SECTIONS if not (s == "headline" and args.skip_headline)]
    return args


def _terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks remove the swap files."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    _terminate_on_sigterm()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.headline_child:
        _quiet_transformers()
        result = headline(args)
        print(json.dumps(result), flush=True)
        return result

    result: dict = {"machine": _machine(), "batch": args.batch, "seq": args.seq}
    root = tempfile.mkdtemp(prefix="offload-bench-", dir=args.dir)
    try:
        if "disk" in args.sections:
            print("disk ...", file=sys.stderr, flush=True)
            runs = disk_runs(root, args.disk_gib, args.disk_repeats, "start")
        need_model = {"lora", "full", "checkpoint"} & set(args.sections)
        if need_model:
            _quiet_transformers()
            folder, result["model"] = prepare_model_dir(args.model_dir, os.path.join(root, "model"))
            if "lora" in args.sections:
                print("lora ...", file=sys.stderr, flush=True)
                result["lora"] = lora_bench(folder, root, args)
            if {"full", "checkpoint"} & set(args.sections):
                print("full fine-tune ...", file=sys.stderr, flush=True)
                result["full"], result["checkpoint"] = full_bench(
                    folder, root, args, checkpoint="checkpoint" in args.sections
                )
        if "headline" in args.sections:
            print("headline (minutes per step) ...", file=sys.stderr, flush=True)
            result["headline"] = run_headline_child(args, root)
        if "disk" in args.sections:
            print("disk again ...", file=sys.stderr, flush=True)
            runs += disk_runs(root, args.disk_gib, args.disk_repeats, "end")
            result["disk"] = disk_limits(runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["loadavg_end"] = list(os.getloadavg())
    result["targets"] = targets(result)
    result = {k: v for k, v in result.items() if v is not None}
    report(result)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
