"""Where the budget goes: the page pool's size, and the errors when the budget is too small.

The budget (OffloadConfig.budget_bytes) covers, on the CPU: the resident group with its
gradients and Adam m and v, one block's gradients, AdamW's scratch, an activation share
(OffloadConfig.activation_bytes, else a quarter of the budget) and the pool of page
buffers (what is left, allocated once). On CUDA the budget is GPU memory and the pool
lives in host memory of host_budget_bytes (the split is `plan_device_memory`, _device.py).

The pool holds at least `reserve` pages (the most the engine pins at once: a block's
weights, gradients, m and v when it trains, its weights alone otherwise). When it can
hold every region besides, nothing streams; otherwise it gets `reserve` pages for the
block in use and for each of the 1 + prefetch blocks after it, and the engine streams.
A batch whose estimated activations do not fit the share left is refused before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._config import OffloadConfig
from ._device import DevicePlan, plan_device_memory
from ._io import OffloadError
from ._layout import EXP_AVG, EXP_AVG_SQ, GRAD, WEIGHT, BlockLayout
from ._partition import Partition
from ._plan import activation_bytes, graph_bytes

MIB = 2**20


class OffloadBudgetError(OffloadError):
    """The budget cannot hold what the engine needs (at start, or for this batch)."""


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


@dataclass(frozen=True)
class MemoryPlan:
    """How the engine spends its budget (bytes, except the counts)."""

    budget: int
    kinds: list[str]  # the swap files: weights, and m, v, gradients when something trains
    regions: dict[str, list[int]]  # kind -> each block's region (0: read from model files)
    page_bytes: int  # one pool buffer: the largest region
    reserve: int  # the most pages the engine pins at once
    n_pages: int
    streaming: bool  # the pool cannot hold every region
    resident_bytes: int  # resident parameters, their gradients, Adam m and v
    block_grad_bytes: int  # one block's gradients as autograd makes them
    scratch_bytes: int  # AdamW's temporaries for the largest trainable tensor
    staging_bytes: int  # CUDA: the pinned buffer a block's gradients come back to
    owned: int  # what the budget holds besides activations (on CUDA the pool is host memory)
    device_plan: DevicePlan | None  # the CUDA path's two budgets

    @property
    def act_budget(self) -> int:
        """What the budget leaves for a step's activations."""
        return self.budget - self.owned


def _regions(
    layouts: list[BlockLayout], from_files: dict[int, list]
) -> tuple[list[str], dict[str, list[int]], int]:
    """The swap files' kinds, each block's region in them, and the page size."""
    kinds = [WEIGHT]
    if any(layout.trainable for layout in layouts):
        kinds += [EXP_AVG, EXP_AVG_SQ, GRAD]  # gradients spill when clipping or accumulating
    regions = {k: [layout.region_bytes[k] for layout in layouts] for k in kinds}
    page_bytes = max(max(v) for v in regions.values())
    for i in from_files:
        regions[WEIGHT][i] = 0  # no swap region: read from the model's files
    return kinds, regions, page_bytes


def _plan_device(
    config: OffloadConfig, act_reserve: int, device: torch.device, **sizes: int
) -> DevicePlan:
    """The CUDA path's split (plan_device_memory with `sizes`); OffloadBudgetError when the
    GPU budget leaves less than the activation share."""
    budget = config.budget_bytes
    plan = plan_device_memory(budget, config.host_budget_bytes or budget, **sizes)
    if plan.activations < act_reserve:
        raise OffloadBudgetError(
            f"GPU budget {budget / MIB:.1f} MiB is too small: the engine needs at least "
            f"{(plan.device_fixed + act_reserve) / MIB:.1f} MiB on {device} "
            f"(resident parameters and their state {sizes['resident_bytes'] / MIB:.1f} "
            f"MiB, {plan.slots} copies of a block's weights of "
            f"{plan.slot_bytes / MIB:.1f} MiB, one block's gradients "
            f"{sizes['block_grad_bytes'] / MIB:.1f} MiB, optimizer scratch "
            f"{2 * sizes['resident_trainable_bytes'] / MIB:.1f} MiB, activations "
            f"{act_reserve / MIB:.1f} MiB)"
        )
    return plan


def plan_memory(
    part: Partition,
    config: OffloadConfig,
    from_files: dict[int, list],
    device: torch.device,
    cuda: bool,
) -> MemoryPlan:
    """The pool's size and whether the engine streams; OffloadBudgetError when the budget
    cannot hold the pool's `reserve` pages besides everything else."""
    kinds, regions, page_bytes = _regions(part.layouts, from_files)
    reserve = 4 if len(kinds) > 1 else 1  # a block's step pins w+g+m+v; forward 1
    budget = config.budget_bytes
    res_train = sum(_nbytes(p) for _, p in part.resident_trainable)
    resident_bytes = sum(_nbytes(p) for _, p in part.resident) + 3 * res_train
    block_grad_bytes = max((layout.trainable_bytes() for layout in part.layouts), default=0)
    # AdamW's single-tensor step makes two temporaries the size of the parameter
    # (sqrt of v, then its division by the bias correction).
    scratch_bytes = 2 * max((_nbytes(p) for p in part.trainable), default=0)
    staging_bytes = max((layout.region_bytes[GRAD] for layout in part.layouts), default=0)
    act_reserve = config.activation_bytes if config.activation_bytes is not None else budget // 4
    fixed = resident_bytes + block_grad_bytes + scratch_bytes
    avail = budget - fixed - act_reserve
    device_plan = None
    if cuda:  # budget: GPU memory; the pool lives in host memory (_device.py)
        device_plan = _plan_device(
            config,
            act_reserve,
            device,
            resident_bytes=resident_bytes,
            resident_trainable_bytes=res_train,
            block_grad_bytes=block_grad_bytes,
            staging_bytes=staging_bytes,
            host_scratch_bytes=scratch_bytes,
            slot_bytes=max((layout.region_bytes[WEIGHT] for layout in part.layouts), default=0),
        )
        fixed, avail = device_plan.device_fixed, device_plan.pool_room
    affordable = avail // page_bytes if page_bytes else 0
    if affordable < reserve and device_plan is not None:
        raise OffloadBudgetError(
            f"host budget {(device_plan.pool_room + device_plan.host_fixed) / MIB:.1f} MiB is "
            f"too small: the pinned page pool needs {reserve} buffers of "
            f"{page_bytes / MIB:.1f} MiB besides {device_plan.host_fixed / MIB:.1f} MiB "
            "(one block's gradients, optimizer scratch); raise host_budget_bytes"
        )
    if affordable < reserve:
        need = fixed + act_reserve + reserve * page_bytes
        raise OffloadBudgetError(
            f"budget {budget / MIB:.1f} MiB is too small: the engine needs at least "
            f"{need / MIB:.1f} MiB (resident parameters and their state "
            f"{resident_bytes / MIB:.1f} MiB, one block's gradients "
            f"{block_grad_bytes / MIB:.1f} MiB, optimizer scratch "
            f"{scratch_bytes / MIB:.1f} MiB, {reserve} buffers of "
            f"{page_bytes / MIB:.1f} MiB, activations {act_reserve / MIB:.1f} MiB)"
        )
    total_pages = sum(1 for k in kinds for s in regions[k] if s) + len(from_files)
    if affordable >= total_pages + reserve:
        n_pages, streaming = total_pages + reserve, False
    else:
        n_pages, streaming = min(affordable, reserve * (2 + config.prefetch)), True
    return MemoryPlan(
        budget=budget,
        kinds=kinds,
        regions=regions,
        page_bytes=page_bytes,
        reserve=reserve,
        n_pages=n_pages,
        streaming=streaming,
        resident_bytes=resident_bytes,
        block_grad_bytes=block_grad_bytes,
        scratch_bytes=scratch_bytes,
        staging_bytes=staging_bytes,
        owned=fixed if cuda else n_pages * page_bytes + fixed,
        device_plan=device_plan,
    )


def activation_need(
    model: torch.nn.Module,
    dtype_bytes: int,
    act_budget: int,
    keep_graphs: bool,
    batch: int,
    seq: int,
) -> tuple[int, bool] | None:
    """(estimated bytes, whether the step keeps every block's autograd graph) for a batch
    of `batch` x `seq` tokens; OffloadBudgetError when even its activations do not fit.
    The graphs are kept (no recompute in the backward) when `keep_graphs` and they fit on
    top of the activations. None when the model has no config to estimate from."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "hidden_size", None) is None:
        return None
    est = activation_bytes(cfg, batch, seq, dtype_bytes)
    if est > act_budget:
        raise OffloadBudgetError(
            f"a batch of {batch} x {seq} tokens needs about {est / MIB:.1f} MiB of "
            f"activations; the budget leaves {act_budget / MIB:.1f} MiB after the "
            "engine's buffers. Use a smaller batch or sequence, or a larger budget."
        )
    if keep_graphs:
        kept = est + graph_bytes(cfg, batch, seq, dtype_bytes)
        if kept <= act_budget:
            return kept, True
    return est, False


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory (VmHWM), for telemetry; None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
