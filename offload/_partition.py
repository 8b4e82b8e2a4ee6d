"""The model as the engine splits it: its blocks, what streams, what stays resident.

- The blocks are the longest ModuleList whose items share one type (`find_blocks`).
- Full fine-tuning: every block parameter streams. Frozen base (LoRA, adapters): when the
  blocks hold frozen parameters, only those stream (read-only) and the blocks' trainable
  parameters stay resident with everything outside the blocks ("resident group").
- A parameter that holds no values (the meta device, or a placeholder from
  `release_parameters`) is created in its swap page by the engine's `init_weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._io import OffloadError
from ._layout import BlockLayout

FULL = "full"
FROZEN_BASE = "frozen_base"


def find_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks: the longest ModuleList whose items all share one type."""
    best: torch.nn.ModuleList | None = None
    for mod in model.modules():
        if (
            isinstance(mod, torch.nn.ModuleList)
            and len(mod) > 1
            and len({type(m) for m in mod}) == 1
            and (best is None or len(mod) > len(best))
        ):
            best = mod
    if best is None:
        raise OffloadError("found no list of transformer blocks; pass blocks=")
    return list(best)


def is_unloaded(p: torch.Tensor) -> bool:
    """True for a parameter that holds no values: on the meta device, or a placeholder
    (one element broadcast to the parameter's shape, as release_parameters leaves it)."""
    if p.device.type == "meta":
        return True
    return (
        p.numel() > 1
        and all(s == 0 for s in p.stride())
        and p.untyped_storage().nbytes() <= p.element_size()
    )


def release_parameters(module: torch.nn.Module) -> int:
    """Replace `module`'s meta-device parameters by placeholders of the same shape, dtype and
    requires_grad that hold no memory (one element, NaN, broadcast). A model too large for
    memory, built under torch.device("meta") or accelerate's init_empty_weights, can then
    be wrapped (peft creates real adapters next to them) like a loaded one; the engine
    creates the values block by block (OffloadEngine's init_weights). Returns how many."""
    made: dict[int, torch.nn.Parameter] = {}  # a tied parameter stays one parameter
    for mod in module.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            if id(p) not in made:
                fill = float("nan") if p.dtype.is_floating_point else 0
                data = torch.full((1,), fill, dtype=p.dtype).expand(p.shape)
                made[id(p)] = torch.nn.Parameter(data, requires_grad=p.requires_grad)
            mod._parameters[name] = made[id(p)]
    return len(made)


def unmeta_blocks(blocks: Sequence[torch.nn.Module]) -> set[int]:
    """Make the blocks' meta-device parameters placeholders (release_parameters); returns
    the ids of every block parameter that holds no values, for init_weights to create."""
    for block in blocks:
        release_parameters(block)
    return {id(p) for block in blocks for p in block.parameters() if is_unloaded(p)}


def outside_blocks(
    named: list[tuple[str, torch.nn.Parameter]], blocks: Sequence[torch.nn.Module]
) -> list[torch.nn.Parameter]:
    """The parameters of no block (embeddings, final norm, lm_head)."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    return [p for _, p in named if id(p) not in in_blocks]


@dataclass(eq=False)
class Partition:
    """Which parameters stream (one BlockLayout per block) and which stay resident."""

    mode: str  # FULL or FROZEN_BASE
    layouts: list[BlockLayout]
    block_resident: list[list[torch.nn.Parameter]]  # a block's resident trainable params
    resident: list[tuple[str, torch.nn.Parameter]]  # everything that does not stream
    resident_trainable: list[tuple[str, torch.nn.Parameter]]
    trainable: list[torch.nn.Parameter]  # every trainable parameter, in model order


def partition(
    named: list[tuple[str, torch.nn.Parameter]], blocks: Sequence[torch.nn.Module]
) -> Partition:
    name_of = {id(p): n for n, p in named}
    frozen_in_blocks = any(not p.requires_grad for b in blocks for p in b.parameters())
    streamed_ids: set[int] = set()
    layouts: list[BlockLayout] = []
    block_resident: list[list[torch.nn.Parameter]] = []
    for i, block in enumerate(blocks):
        bnamed = [(name_of[id(p)], p) for p in block.parameters()]
        if frozen_in_blocks:
            streamed = [(n, p) for n, p in bnamed if not p.requires_grad]
        else:
            streamed = bnamed
        for _, p in streamed:
            if id(p) in streamed_ids:
                raise NotImplementedError("a parameter shared between blocks cannot stream")
            streamed_ids.add(id(p))
        trainable = [(n, p) for n, p in streamed if p.requires_grad]
        layouts.append(BlockLayout(i, streamed, trainable))
        block_resident.append(
            [p for _, p in bnamed if p.requires_grad and id(p) not in streamed_ids]
        )
    resident = [(n, p) for n, p in named if id(p) not in streamed_ids]
    return Partition(
        mode=FROZEN_BASE if frozen_in_blocks else FULL,
        layouts=layouts,
        block_resident=block_resident,
        resident=resident,
        resident_trainable=[(n, p) for n, p in resident if p.requires_grad],
        trainable=[p for _, p in named if p.requires_grad],
    )


def move_resident(model: torch.nn.Module, part: Partition, device: torch.device) -> None:
    """The CUDA path: the resident group and every buffer live on `device`, and unbound
    block parameters read as placeholders there (as in plain torch on that device)."""
    for _, p in part.resident:
        p.data = p.data.to(device)
    for mod in model.modules():
        for k, b in mod._buffers.items():
            if b is not None and b.device != device:
                mod._buffers[k] = b.to(device)
    for layout in part.layouts:
        layout.home = device
