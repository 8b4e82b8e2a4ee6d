"""The headline: a ~2B-parameter Llama-shaped model, more than RAM, built on the meta
device, created block by block in the swap and fully fine-tuned under a 4 GiB budget, in
a process of its own so that its peak RSS is its own.

transformers is imported inside the function that builds the model."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import zlib

import torch

from .._config import OffloadConfig
from .._partition import find_blocks
from .._plan import activation_bytes
from ..engine import OffloadEngine
from .common import ADAMW, GB, batches, io_delta, meminfo, rate, status

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
    mem_total = meminfo("MemTotal")
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
    out["baseline_rss_bytes"] = status("VmRSS")
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
            d = io_delta(before, eng.telemetry())
            d.update(s=s, loss=loss)
            steps.append(d)
            print(
                f"    step {i}: {s:.0f} s, loss {loss:.4f}, read {d['read_bytes'] / GB:.1f} GB at "
                f"{rate(d['read_bytes'], d['read_busy_s']):.2f} GB/s, wrote "
                f"{d['written_bytes'] / GB:.1f} GB at "
                f"{rate(d['written_bytes'], d['write_busy_s']):.2f} GB/s",
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
        read_gbps=rate(rd, sum(d["read_busy_s"] for d in timed)),
        write_gbps=rate(wr, sum(d["write_busy_s"] for d in timed)),
        stall_s_per_step=statistics.mean(d["stall_s"] for d in timed),
        tokens_per_s=args.headline_batch
        * args.headline_seq
        / statistics.mean(d["s"] for d in timed),
        peak_rss_bytes=status("VmHWM"),
        malloc_mmap_threshold=t.get("malloc_mmap_threshold"),
        training_rss_bytes=status("VmHWM") - out["baseline_rss_bytes"],
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
