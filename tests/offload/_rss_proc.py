"""Measure the engine's real memory in a fresh process (prints one JSON line).

python -m tests.offload._rss_proc SWAP_DIR BUDGET_BYTES STEPS [ACTIVATION_BYTES]

Baseline: resident set size after imports and a warm-up step of a throwaway model (torch's
kernels and allocator pools exist by then), before the model is built. Peak: VmHWM after
training, with the high-water mark reset (/proc/self/clear_refs) once the engine has
moved the blocks out. Run with MALLOC_MMAP_THRESHOLD_ set low, so that freed tensors go
back to the system and the resident set tracks live memory."""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import torch

from offload import AdamWConfig, OffloadConfig, OffloadEngine
from tests.offload._factories import make_batch, state_bytes, tiny_llama

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


def main(swap: str, budget: int, steps: int, act: int = 12 << 20) -> dict:
    torch.set_num_threads(1)
    warm = tiny_llama(**SHAPE)  # warm-up: same kernels, same shapes, then thrown away
    warm(**make_batch(0, BATCH, SEQ, vocab=512)).loss.backward()
    del warm
    _trim()
    baseline = _status("VmRSS")

    model = tiny_llama(**SHAPE)
    state = state_bytes(model)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-3, max_grad_norm=1.0),
        OffloadConfig(budget, swap, prefetch=1, activation_bytes=act),
    )
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
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], *map(int, sys.argv[2:]))))
