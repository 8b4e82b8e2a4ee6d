"""What the benchmark's sections share: the recipe's AdamW, batches, I/O deltas, /proc.

transformers is imported inside functions only (see the package docstring)."""

from __future__ import annotations

import torch

from .._config import AdamWConfig

GB = 1e9
ADAMW = AdamWConfig(lr=1e-5, weight_decay=0.0, max_grad_norm=1.0, no_decay_1d=True)


def quiet_transformers() -> None:
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def batches(n: int, batch: int, seq: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def io_delta(before: dict, after: dict) -> dict:
    rd = after["bytes_read"] - before["bytes_read"]
    wr = after["bytes_written"] - before["bytes_written"]
    return {
        "read_bytes": rd,
        "written_bytes": wr,
        "read_busy_s": after["read_busy_s"] - before["read_busy_s"],
        "write_busy_s": after["write_busy_s"] - before["write_busy_s"],
        "stall_s": after["stall_s"] - before["stall_s"],
    }


def rate(nbytes: int, busy: float) -> float:
    return nbytes / busy / GB if busy > 0 else 0.0


def meminfo(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def status(field: str) -> int:
    """VmRSS (resident now) or VmHWM (peak) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0
