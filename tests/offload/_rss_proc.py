"""Measure the engine's real memory in a fresh process (prints one JSON line).

python -m tests.offload._rss_proc SWAP_DIR BUDGET_BYTES STEPS [ACTIVATION_BYTES] [--meta]

Baseline: resident set size after imports and a warm-up step of a throwaway model (torch's
kernels and allocator pools exist by then), before the model is built. Peak: VmHWM after
training, with the high-water mark reset (/proc/self/clear_refs) once the engine has
moved the blocks out.

--meta builds the models as the 2B benchmark does: on the meta device, blocks created in
the swap by init_weights, so no block weight is ever allocated outside the engine. Then
the engine's own malloc settings (OffloadConfig.malloc_mmap_threshold) are all it takes
for the resident set to track live memory. A model built in memory first leaves its
weights' memory in glibc's heap when the engine pages them out (see offload/_malloc.py);
the test of that case runs with MALLOC_MMAP_THRESHOLD_ set before the process starts."""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import torch
from transformers import LlamaForCausalLM

from offload import AdamWConfig, OffloadConfig, OffloadEngine
from tests.offload._factories import make_batch, state_bytes, tiny_config, tiny_llama

SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
BATCH, SEQ = 2, 64


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _init(name: str, t: torch.Tensor) -> None:
    t.normal_(0.0, 0.02) if t.ndim >= 2 else t.fill_(1.0)


def _meta_model() -> LlamaForCausalLM:
    """Blocks on the meta device; embeddings, final norm, lm_head and buffers real."""
    cfg = tiny_config(**SHAPE)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    for name, p in list(model.named_parameters()):
        if not name.startswith("model.layers."):
            mod_name, _, attr = name.rpartition(".")
            real = torch.empty(p.shape, dtype=p.dtype)
            _init(name, real)
            model.get_submodule(mod_name)._parameters[attr] = torch.nn.Parameter(real)
    return model


def _engine(swap: str, budget: int, act: int, meta: bool) -> tuple[OffloadEngine, int]:
    model = _meta_model() if meta else tiny_llama(**SHAPE)
    state = state_bytes(model)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-3, max_grad_norm=1.0),
        OffloadConfig(budget, swap, prefetch=1, activation_bytes=act),
        init_weights=_init if meta else None,
    )
    return eng, state


def main(swap: str, budget: int, steps: int, act: int = 12 << 20, meta: bool = False) -> dict:
    torch.set_num_threads(1)
    warm, _ = _engine(swap + "-warm", budget, act, meta)  # same kernels, same shapes
    warm.step(make_batch(0, BATCH, SEQ, vocab=512))
    warm.close()
    del warm
    _trim()
    baseline = _status("VmRSS")

    eng, state = _engine(swap, budget, act, meta)
    _trim()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    for s in range(steps):
        eng.step(make_batch(s, BATCH, SEQ, vocab=512))
    peak = _status("VmHWM")
    t = eng.telemetry()
    eng.close()
    return {
        "baseline": baseline,
        "peak": peak,
        "used": peak - baseline,
        "budget": budget,
        "state": state,
        "accounted_peak": t["peak_bytes"],
        "streaming": t["streaming"],
        "bytes_read": t["bytes_read"],
        "kept_graphs": t["kept_graphs"],
        "malloc_mmap_threshold": t["malloc_mmap_threshold"],
    }


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--meta"]
    print(json.dumps(main(args[0], *map(int, args[1:]), meta="--meta" in sys.argv)))
