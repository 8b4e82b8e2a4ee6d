"""The engine's state, as one explicit object its parts share.

OffloadEngine (engine.py) builds an EngineState at start and hands it, never itself, to
the modules that do the work: the block hooks (_hooks.py), the schedule and where block
weights are bound (_schedule.py), the backward and the optimizer steps (_step.py), and
checkpoints (_checkpoint.py). None of them imports the engine, so the engine's public
API stays in engine.py and the mechanics read and write only what is named here.

Invariants:
- The parts take an EngineState, never the engine, and none imports engine.py.
- `pinned` holds exactly the pages taken from the pager and not yet released or
  discarded; a failed step discards them all and unbinds every block (engine._fail).
- `optimizers.steps[id(p)]` is the AdamW step count of every streamed trainable parameter: a block
  optimizer holds state only while its block is stepped (m and v as views into pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ._config import AdamWConfig, OffloadConfig
from ._device import DeviceCopies
from ._io import BufferPool, IOExecutor, IOStats, SwapStore
from ._layout import BlockLayout
from ._optim import Optimizers
from ._pager import Key, Pager
from ._parallel import ReduceStats
from ._safetensors import SafetensorsSource


@dataclass(eq=False)
class EngineState:
    """Everything the engine's parts share; see the module docstring for the invariants."""

    # -- what is trained, and how (fixed at start) -------------------------------------------
    model: torch.nn.Module
    config: OffloadConfig
    optim: AdamWConfig  # the engine's own: set_lr changes its lr
    device: torch.device  # where blocks compute
    mode: str  # "full" or "frozen_base" (_partition.py)
    blocks: list[torch.nn.Module]
    named: list[tuple[str, torch.nn.Parameter]]  # model.named_parameters() at start
    layouts: list[BlockLayout]  # one per block: its streamed parameters' regions
    block_resident: list[list[torch.nn.Parameter]]  # a block's resident trainable params
    resident_trainable: list[tuple[str, torch.nn.Parameter]]
    norm_order: list[torch.nn.Parameter]  # clip_grad_norm_'s reduction order
    clip: bool  # AdamWConfig.max_grad_norm is set
    parallel: bool  # OffloadConfig.data_parallel: gradients summed across ranks

    # -- storage and transfers ---------------------------------------------------------------
    store: SwapStore
    pool: BufferPool
    io: IOExecutor
    stats: IOStats
    pager: Pager
    o_direct: bool
    prefetch_pages: int  # how far prefetch walks ahead of the demands, in pages
    source: SafetensorsSource | None  # the model's files, frozen blocks read from there
    dev: DeviceCopies | None  # the CUDA path's GPU slots and copy stream (_device.py)
    staging: torch.Tensor | None  # CUDA: pinned host buffer for a block's gradients

    # -- optimizers --------------------------------------------------------------------------
    optimizers: Optimizers  # one AdamW per block, one for the resident group (_optim.py)
    anchor: torch.Tensor  # requires grad: puts every block in the autograd graph

    # -- the pass in progress ----------------------------------------------------------------
    step_count: int = 0
    in_step: bool = False  # inside OffloadEngine.step
    keep_graphs: bool = False  # this step keeps block graphs (no recompute)
    micro: int = 0  # the micro-batch being run
    final: bool = True  # it is the step's last
    schedule: list[tuple[Key, bool]] = field(default_factory=list)  # (region, read) in order
    sched_pos: int = 0
    pinned: dict[Key, Any] = field(default_factory=dict)  # region -> its pinned page
    norms: dict[int, torch.Tensor] = field(default_factory=dict)  # clipping: per tensor
    has_grad: dict[int, bool] = field(default_factory=dict)  # spilled gradient present
    total_norm: torch.Tensor | None = None  # clipping: this step's global norm
    last_grad_norm: float | None = None  # the last clipped step's
    reduced: ReduceStats = field(default_factory=ReduceStats)  # data parallel's all_reduces

    # -- pipeline parallel (_pipeline.py) ----------------------------------------------------
    pipelined: bool = False  # inside OffloadEngine.step_pipelined
    pipe_micros: int = 1  # micro-batches in the step
    pipe_forwards: int = 0  # forwards begun this step
    pipe_backwards: int = 0  # backwards begun this step
    tied: list[torch.nn.Parameter] = field(default_factory=list)  # held by another stage too
    tied_group: Any = None  # the process group of the stages holding them
    uncounted: set[int] = field(default_factory=set)  # ids left out of this stage's norm

    def close(self, remove: bool) -> None:
        """Stop the I/O threads and the device copies, close the swap and model files."""
        self.io.close()
        if self.dev is not None:
            self.dev.close()
        self.store.close(remove=remove)
        if self.source is not None:
            self.source.close()
