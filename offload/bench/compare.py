"""In memory against the engine: LoRA and full fine-tuning of SmolLM2-135M (or a random
model of its shape), steps alternated on the same batches and losses compared bit for
bit; checkpoint save, load and copy of the full fine-tune's state.

transformers and peft are imported inside the functions that build models."""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .. import _checkpoint
from .._config import OffloadConfig
from .._partition import find_blocks
from .._plan import activation_bytes, graph_bytes
from ..engine import OffloadEngine
from .common import ADAMW, GB, batches, io_delta, rate

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# SmolLM2-135M's shape: the stand-in when no --model-dir is given (random weights).


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
            io[name].append(io_delta(before, eng.telemetry()))
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
            "read_gbps": rate(tot["read_bytes"], tot["read_busy_s"]),
            "write_gbps": rate(tot["written_bytes"], tot["write_busy_s"]),
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
    st = eng._state  # the engine's state (offload/_state.py): its swap files
    kinds = [k for k in ("weight", "exp_avg", "exp_avg_sq") if k in st.store.files]
    swap_bytes = sum(st.store.files[k].nbytes for k in kinds)
    t0 = time.perf_counter()
    eng.save_checkpoint(directory)
    save_s = time.perf_counter() - t0
    names = os.listdir(directory)
    nbytes = sum(os.path.getsize(os.path.join(directory, n)) for n in names)
    resident = sum(os.path.getsize(os.path.join(directory, n)) for n in names if "resident" in n)
    renamed = _checkpoint._same_filesystem(st.store.directory, directory)
    _drop_cache(directory)
    t0 = time.perf_counter()
    eng.load_checkpoint(directory)
    load_s = time.perf_counter() - t0
    _drop_cache(directory)
    os.makedirs(copy_dir, exist_ok=True)
    t0 = time.perf_counter()
    for kind in kinds:  # reads the checkpoint's files, where the regions now are
        _checkpoint._copy_out(st, kind, os.path.join(copy_dir, f"{kind}.bin"))
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
