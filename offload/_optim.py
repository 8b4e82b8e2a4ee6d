"""AdamW and gradient clipping, done piecewise but with torch's own arithmetic.

Bitwise equality with plain torch comes from running the same code, not a re-derivation:
each block is stepped by a real torch.optim.AdamW whose state entries are, for the
duration of the step, views into the pages holding that block's Adam m and v. AdamW is
elementwise per tensor (torch's CPU default is the single-tensor path), so stepping a
block alone gives the same bits as stepping the whole model at once.

Clipping by global norm needs every gradient's norm before any parameter moves. The
per-tensor norms are computed with the kernel clip_grad_norm_ uses (torch._foreach_norm
where supported, else linalg.vector_norm), kept (one scalar per tensor), and reduced in
the order clip_grad_norm_ reduces them: parameters in model.parameters() order, grouped
by (device, dtype) in order of first appearance. Same inputs, same kernels, same order:
the same bits."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from ._config import AdamWConfig
from ._layout import BlockLayout


def make_adamw(named: list[tuple[str, torch.nn.Parameter]], cfg: AdamWConfig):
    """A torch.optim.AdamW over `named`, split into decay / no-decay groups."""
    decay = [p for n, p in named if cfg.decays(n, p.ndim)]
    no_decay = [p for n, p in named if not cfg.decays(n, p.ndim)]
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": cfg.weight_decay})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    if not groups:
        return None
    return torch.optim.AdamW(groups, **cfg.torch_kwargs())


def step_tensor_factory(cfg: AdamWConfig, dtype: torch.dtype, device: torch.device):
    """How torch.optim.AdamW makes a fresh `step` state (dtype, device) for these settings.

    Learned by stepping a one-element parameter once, rather than copying torch internals."""
    p = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device))
    p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW([p], **cfg.torch_kwargs())
    opt.step()
    ref = opt.state[p]["step"]

    def fresh() -> torch.Tensor:
        return torch.zeros((), dtype=ref.dtype, device=ref.device)

    return fresh


class Optimizers(NamedTuple):
    blocks: list[torch.optim.AdamW | None]  # one per block; state attached while it steps
    resident: torch.optim.AdamW | None  # the resident group's
    steps: dict[int, torch.Tensor]  # id(streamed trainable parameter) -> its AdamW step
    fresh_step: Callable[[], torch.Tensor]  # a new `step` state, as torch's AdamW makes it


def make_optimizers(
    layouts: list[BlockLayout],
    resident_trainable: list[tuple[str, torch.nn.Parameter]],
    cfg: AdamWConfig,
    dtype: torch.dtype,
) -> Optimizers:
    """One AdamW per block and one for the resident group (decay groups by name)."""
    fresh_step = step_tensor_factory(cfg, dtype, torch.device("cpu"))
    return Optimizers(
        blocks=[
            make_adamw(list(zip(layout.trainable_names, layout.trainable)), cfg)
            for layout in layouts
        ],
        resident=make_adamw(resident_trainable, cfg),
        steps={id(p): fresh_step() for layout in layouts for p in layout.trainable},
        fresh_step=fresh_step,
    )


def tensor_norms(tensors: list[torch.Tensor], foreach: bool | None = None) -> list[torch.Tensor]:
    """Per-tensor L2 norms, with the kernel clip_grad_norm_ would use for these tensors."""
    if not tensors:
        return []
    device = tensors[0].device
    use_foreach = foreach if foreach is not None else device.type in ("cpu", "cuda", "xpu")
    if use_foreach and all(t.device == device and t.dtype == tensors[0].dtype for t in tensors):
        return list(torch._foreach_norm(tensors, 2.0))
    return [torch.linalg.vector_norm(t, 2.0) for t in tensors]


def norm_order(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """The order in which clip_grad_norm_ concatenates per-tensor norms: grouped by
    (device, dtype) in order of first appearance, model order within a group."""
    groups: dict[tuple, list] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    return [p for g in groups.values() for p in g]


def total_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
