"""Where each parameter of a block lives inside its flat region, and how to bind it there.

A block's region of one kind (weights, Adam m, Adam v, gradients) is the block's tensors
back to back, each starting on a 64-byte boundary (the CPU allocator's alignment, so
kernels see the same alignment class as in plain torch), the whole padded to 4 KiB.
Weights hold every streamed parameter; the other kinds only the trainable ones.

A parameter that is not loaded points at a placeholder of the right shape and dtype that
reads as NaN and refuses writes, so accidental use outside the engine is loud."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._io import align_up

PARAM_ALIGN = 64

WEIGHT = "weight"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
GRAD = "grad"
STATE_KINDS = (EXP_AVG, EXP_AVG_SQ, GRAD)


@dataclass
class Slot:
    name: str
    param: torch.nn.Parameter
    offset: int
    nbytes: int

    def view(self, page: torch.Tensor) -> torch.Tensor:
        p = self.param
        raw = page[self.offset : self.offset + self.nbytes]
        return raw.view(p.dtype).view(p.shape)


def _pack(named: list[tuple[str, torch.nn.Parameter]]) -> tuple[list[Slot], int]:
    slots, off = [], 0
    for name, p in named:
        off = align_up(off, PARAM_ALIGN)
        n = p.numel() * p.element_size()
        slots.append(Slot(name, p, off, n))
        off += n
    return slots, align_up(off) if off else 0


_placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def placeholder(p: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    key = (p.dtype, device if device is not None else p.device)
    base = _placeholders.get(key)
    if base is None:
        fill = float("nan") if p.dtype.is_floating_point else 0
        base = torch.full((1,), fill, dtype=p.dtype, device=key[1])
        _placeholders[key] = base
    return base.expand(p.shape)


class BlockLayout:
    """The flat layout of one block: `streamed` params (in weights), `trainable` subset."""

    def __init__(
        self,
        index: int,
        streamed: list[tuple[str, torch.nn.Parameter]],
        trainable: list[tuple[str, torch.nn.Parameter]],
    ):
        self.index = index
        self.weight_slots, wbytes = _pack(streamed)
        self.state_slots, sbytes = _pack(trainable)
        self.region_bytes = {WEIGHT: wbytes, EXP_AVG: sbytes, EXP_AVG_SQ: sbytes, GRAD: sbytes}
        self.trainable = [p for _, p in trainable]
        self.trainable_names = [n for n, _ in trainable]
        # Where an unbound parameter's placeholder lives (None: where the parameter is);
        # the CUDA path binds blocks on the GPU and, for their steps, on the host.
        self.home: torch.device | None = None

    def bind(self, page: torch.Tensor) -> None:
        for s in self.weight_slots:
            s.param.data = s.view(page)

    def unbind(self) -> None:
        for s in self.weight_slots:
            s.param.data = placeholder(s.param, self.home)

    def fill(self, page: torch.Tensor, skip: set[int] | frozenset = frozenset()) -> None:
        """Copy the parameters' current values into a weights page (engine start-up),
        except those whose id is in `skip` (created in the page by the caller)."""
        for s in self.weight_slots:
            if id(s.param) not in skip:
                s.view(page).copy_(s.param.data)

    def state_views(self, page: torch.Tensor) -> list[torch.Tensor]:
        return [s.view(page) for s in self.state_slots]

    def weight_bytes(self) -> int:
        return sum(s.nbytes for s in self.weight_slots)

    def trainable_bytes(self) -> int:
        return sum(s.nbytes for s in self.state_slots)
