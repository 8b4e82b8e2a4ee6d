"""The engine's two configs: where and how much (OffloadConfig), and the optimizer (AdamWConfig).

Both are dataclasses that round-trip through plain dicts (JSON-safe), so a job row or a
recipe config can carry them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


def _from_dict(cls, data: dict[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys: {sorted(unknown)}")
    return cls(**data)


@dataclass
class OffloadConfig:
    """How much memory the engine may use and where it pages to.

    budget_bytes: memory the engine may hold on its device (host RAM on a CPU-only
        machine): its buffer pool, the resident parameters with their gradients and
        optimizer state, one block's gradients, and the activations of a step.
    swap_dir: directory for the swap files (one per tensor kind, preallocated).
    prefetch: how many blocks ahead reads are started.
    io_threads: threads issuing reads and writes.
    o_direct: "auto" probes the swap directory once; True insists; False never uses it.
    activation_bytes: share of the budget kept for activations; None = a quarter of it.
        A step whose estimated activations do not fit is refused before it starts.
    chunk_bytes: size of one read or write call.
    keep_swap: leave the swap files in place on close (they are scratch, not a checkpoint).
    keep_graphs: when every block's autograd graph fits the activation share on top of the
        step's other activations (an estimate that errs high), keep the graphs from the
        forward to the backward instead of recomputing each block: one forward of the
        blocks less per step, same bits. False: always recompute (least memory).
    malloc_mmap_threshold: on Linux with glibc, when the budget cannot hold every region (the
        engine streams), it sets malloc's mmap threshold to this many bytes (mallopt;
        process-wide), so freed tensors return to the system instead of fragmenting the heap
        (see _malloc.py). Not when everything fits: it costs speed. None: leave it alone.
    device: where blocks compute: "cpu" or "cuda[:n]"; None = the device of the model's
        resident parameters (those outside the blocks). With CUDA, budget_bytes is GPU
        memory (resident group, block weight copies, one block's gradients, activations)
        and the page pool lives in pinned host memory sized by host_budget_bytes.
    host_budget_bytes: with CUDA, host memory for the pinned page pool, one block's
        gradients and the host AdamW's scratch; None = budget_bytes. Unused on the CPU.
    data_parallel: this rank trains its share of each batch and the gradients are summed
        over torch.distributed's default process group (initialized by the caller, e.g.
        under torchrun) before clipping and AdamW; see _parallel.py. Every rank passes its
        own swap_dir.
    pipeline_parallel: this rank is one stage of a pipeline over the default process
        group: the model it is given holds the stage's blocks, and a schedule drives the
        step's forward and backward passes (OffloadEngine.step_pipelined, _pipeline.py).
    """

    budget_bytes: int
    swap_dir: str
    prefetch: int = 2
    io_threads: int = 4
    o_direct: bool | Literal["auto"] = "auto"
    activation_bytes: int | None = None
    chunk_bytes: int = 1 << 20
    keep_swap: bool = False
    keep_graphs: bool = True
    malloc_mmap_threshold: int | None = 64 << 10
    device: str | None = None
    host_budget_bytes: int | None = None
    data_parallel: bool = False
    pipeline_parallel: bool = False

    def __post_init__(self):
        if self.data_parallel and self.pipeline_parallel:
            raise ValueError("data_parallel and pipeline_parallel do not combine (yet)")
        if self.budget_bytes <= 0:
            raise ValueError("budget_bytes must be positive")
        if self.host_budget_bytes is not None and self.host_budget_bytes <= 0:
            raise ValueError("host_budget_bytes must be positive")
        if self.malloc_mmap_threshold is not None and self.malloc_mmap_threshold < 0:
            raise ValueError("malloc_mmap_threshold must be >= 0 (or None)")
        if self.device is not None:
            self.device = str(self.device)
        if self.prefetch < 0 or self.io_threads < 1:
            raise ValueError("prefetch must be >= 0 and io_threads >= 1")
        if self.o_direct not in ("auto", True, False):
            raise ValueError("o_direct must be 'auto', True or False")
        self.swap_dir = str(self.swap_dir)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OffloadConfig:
        return _from_dict(cls, data)


@dataclass
class AdamWConfig:
    """torch.optim.AdamW's hyperparameters, plus gradient clipping and no-decay names.

    max_grad_norm: clip by global L2 norm (torch.nn.utils.clip_grad_norm_) when set.
    no_decay: parameters whose name contains one of these substrings get weight_decay 0
        (e.g. ("norm", "bias")), as a second param group would in plain torch.
    no_decay_1d: parameters with fewer than 2 dimensions (norm gains, biases) get
        weight_decay 0 (the rule of worker/training/engines.py's InMemoryEngine).
    foreach/fused: passed to torch.optim.AdamW unchanged (None = torch's default).
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = None
    no_decay: tuple[str, ...] = field(default_factory=tuple)
    no_decay_1d: bool = False
    foreach: bool | None = None
    fused: bool | None = None

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        self.no_decay = tuple(self.no_decay)

    def torch_kwargs(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "betas": self.betas,
            "eps": self.eps,
            "foreach": self.foreach,
            "fused": self.fused,
        }

    def decays(self, name: str, ndim: int) -> bool:
        if self.no_decay_1d and ndim < 2:
            return False
        return not any(s in name for s in self.no_decay)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["no_decay"] = list(self.no_decay)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdamWConfig:
        return _from_dict(cls, data)

    @classmethod
    def coerce(cls, value: AdamWConfig | dict[str, Any] | None) -> AdamWConfig:
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        return cls.from_dict(dict(value))
