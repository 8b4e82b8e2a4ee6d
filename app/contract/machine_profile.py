"""The machine profile: how fast this machine trains, measured once by the training worker
(worker/training/machine_profile.py writes it as JSON to `settings.machine_profile_path`) and
read by the web app for the estimate next to the Train button (app/services/planner.py).

A profile of another format number is stale: the app ignores it and the worker measures
again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Raise it when the shape below changes in a way an older reader cannot follow.
FORMAT = 4  # 2: the timed run of the real model (steps); 3: repeated, with a checkpoint;
# 4: the output layer's share (head_flops), fused AdamW on the CPU


def step_flops(flops_per_token: tuple[float, float], rows: int, width: int,
               predicting: float | None = None, head_flops: float = 0.0) -> float:
    """A training step's matmul FLOPs: `rows` examples padded to `width` tokens at (linear,
    attention) FLOPs per token, linear + attention * width each. The output layer
    (`head_flops` of linear) runs only at the `predicting` positions, those whose next token
    is a label (worker/training/engines.lm_loss_sum); None: at every position."""
    linear, attention = flops_per_token
    work = rows * width * (linear + attention * width)
    if predicting is not None:
        work -= max(0.0, rows * width - predicting) * head_flops
    return work


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Disk(_Part):
    """The swap folder's speed, measured with the offload engine's own I/O path."""

    read_gbps: float
    write_gbps: float
    o_direct: bool = False
    bytes: int = 0


class Cpu(_Part):
    matmul_flops: float  # sustained fp32 matmul FLOP/s
    compute_efficiency: float  # the share of it real training reaches


class Reference(_Part):
    """The batch the methods' per-step figures are planned at."""

    batch_size: int
    seq_len: int


class MethodPlan(BaseModel):
    """offload.plan's figures for one method (Plan.to_dict(), infinities as null). The web
    app reads the ones named here; the others ride along."""

    model_config = ConfigDict(extra="allow", frozen=True)

    fits_in_memory: bool
    fits: bool
    compute_s_per_step: float | None = None
    io_s_per_step: float | None = None
    min_budget_bytes: int | None = None


class StreamedBase(_Part):
    """Whether a job streams the base model from the disk, and how long scoring it takes."""

    fp32_bytes: int | None = None
    streams: bool = False
    scoring_s: float = 0.0


class StepFit(_Part):
    """A timed run of the real base model through the offload engine, one method
    (worker/training/step_timing.py): a step of `rows` examples padded to `width` tokens
    takes fixed_s + s_per_flop * step_flops(...) seconds, with (linear, attention) =
    flops_per_token of which head_flops are the output layer's; writing one of the run's
    checkpoints takes checkpoint_s."""

    measured: list[tuple[int, int, float]]  # (rows, width, seconds) of the steps timed
    fixed_s: float
    s_per_flop: float
    flops_per_token: tuple[float, float]
    head_flops: float = 0.0
    checkpoint_s: float

    def seconds(self, rows: int, width: int, predicting: float | None = None) -> float:
        """One step's seconds; `predicting`: its positions that predict a label (None: all)."""
        return self.fixed_s + self.s_per_flop * step_flops(
            self.flops_per_token, rows, width, predicting, self.head_flops
        )


class Scoring(_Part):
    """The real base model timed at scoring's shapes (worker/training/step_timing.py)."""

    decode_s: float  # per generated token of a batch of 8 prompts (prefill included)
    forward_s: float  # per forward of 8 x 256 tokens (perplexity)
    general_forwards: int  # forwards of the forgetting check


class MachineProfile(_Part):
    format: int
    measured_at: str
    base_model: str
    device: str = "cpu"  # where the steps and scoring were timed: "cpu" or "cuda"
    budget_bytes: int
    disk: Disk
    cpu: Cpu
    reference: Reference
    methods: dict[str, MethodPlan]  # "lora", "full" (app.contract.training.METHODS)
    base: StreamedBase = Field(default_factory=StreamedBase)
    # Method -> its timed run; none for a base model streamed from the disk (too slow to
    # time at start: its estimate is offload.plan's, above).
    steps: dict[str, StepFit] = Field(default_factory=dict)
    scoring: Scoring | None = None


def checked_profile(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` unchanged once it has this format's shape; else ValueError."""
    profile = MachineProfile.model_validate(dict(data))
    if profile.format != FORMAT:
        raise ValueError(f"machine profile format {profile.format}, expected {FORMAT}")
    return dict(data)


def is_current(data: Any, base_model: str) -> bool:
    """`data` (parsed JSON) is a profile of this format for `base_model`."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return False
    if data.get("base_model") != base_model:
        return False
    try:
        checked_profile(data)
    except ValueError:
        return False
    return True
