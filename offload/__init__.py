"""DocTune's SSD offload engine: train models whose training state exceeds memory.

A library of its own: it imports torch, xxhash and the standard library only. The front door:

    from offload import OffloadEngine, OffloadConfig, AdamWConfig
    engine = OffloadEngine(model, AdamWConfig(lr=1e-4, max_grad_norm=1.0),
                           OffloadConfig(budget_bytes=2 << 30, swap_dir="/ssd/swap"))
    loss = engine.step({"input_ids": ..., "attention_mask": ..., "labels": ...})
    engine.save_checkpoint("/ssd/ckpt")

Internals live in `_private` modules; see engine.py for the design and where each part is.
Chat KV caches on the SSD: `offload.kvcache` (KVStore, fingerprint).
"""

from ._config import AdamWConfig, OffloadConfig
from ._io import (
    OffloadDiskFullError,
    OffloadError,
    OffloadIOError,
    probe_o_direct,
)
from ._memory import OffloadBudgetError
from ._parallel import DataParallelError, batch_share
from ._partition import find_blocks, is_unloaded, release_parameters
from ._pipeline import PipelineError
from ._plan import Plan, activation_bytes, plan
from .engine import OffloadEngine
from .kvcache import KVStore

__all__ = [
    "AdamWConfig",
    "DataParallelError",
    "KVStore",
    "OffloadBudgetError",
    "OffloadConfig",
    "OffloadDiskFullError",
    "OffloadEngine",
    "OffloadError",
    "OffloadIOError",
    "PipelineError",
    "Plan",
    "activation_bytes",
    "batch_share",
    "find_blocks",
    "is_unloaded",
    "plan",
    "probe_o_direct",
    "release_parameters",
]
