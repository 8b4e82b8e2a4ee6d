"""Pipeline parallel: this process is one stage of a pipeline (a contiguous range of the
model's blocks, OffloadConfig.pipeline_parallel); a schedule such as
torch.distributed.pipelining's ScheduleGPipe drives the step's passes.

The engine's part (OffloadEngine.step_pipelined):
- Passes in a schedule's order. GPipe runs every micro-batch's forward, then their
  backwards in the same order. The stage's first block marks a forward's start, its last
  block a backward's start (the hooks call `begin_forward` and `begin_backward`): each pass
  gets its own page schedule, and a backward knows which micro-batch it is, so gradients
  add up in the swap exactly as in OffloadEngine.step (micro-batch 0 first, stepped or
  spilled with the last).
- The gradient norm for clipping is the whole model's: every stage's per-tensor norms are
  gathered in stage order, so on a float the total is clip_grad_norm_'s over the whole
  model (bitwise, when every stage's gradients are).
- Parameters two stages hold as one (tied input and output embeddings: the first stage's
  embeddings, the last's output layer) get their gradients summed between those stages
  before any norm, are counted once in the norm, and are stepped alike on both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._io import OffloadError
from ._parallel import ReduceStats, sum_across_ranks
from ._schedule import start_schedule
from ._state import EngineState


class PipelineError(OffloadError):
    """The stages cannot run the step together (no process group, a broken schedule)."""


def begin_forward(st: EngineState) -> None:
    """A micro-batch's forward reaches the stage's first block."""
    st.pipe_forwards += 1
    start_schedule(st, training=True, forward=True, backward=False)


def begin_backward(st: EngineState) -> None:
    """A micro-batch's backward reaches the stage's last block: micro-batches come back in
    the order they went forward (GPipe, 1F1B)."""
    j = st.pipe_backwards
    if j >= st.pipe_forwards:
        raise PipelineError("a backward pass came before its forward pass")
    st.micro, st.final = j, j == st.pipe_micros - 1
    st.pipe_backwards += 1
    start_schedule(st, training=True, forward=False, backward=True)


def sum_tied(st: EngineState) -> None:
    """Gradients of parameters tied across stages, summed between the stages holding them."""
    if st.tied:
        grads = [p.grad for p in st.tied if p.grad is not None]
        if len(grads) != len(st.tied):
            raise PipelineError("a tied parameter got no gradient on this stage")
        sum_across_ranks(grads, st.reduced, st.tied_group)


def gather_norms(norms: list[torch.Tensor], stats: ReduceStats) -> list[torch.Tensor]:
    """Every stage's per-tensor norms, stage after stage (the model's order)."""
    world = dist.get_world_size()
    dtype = norms[0].dtype if norms else torch.float32
    mine = torch.stack(norms) if norms else torch.zeros(0, dtype=dtype)
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([mine.numel()], dtype=torch.int64))
    most = max(int(c) for c in counts)
    padded = torch.zeros(most, dtype=dtype)
    padded[: mine.numel()] = mine
    every = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(every, padded)
    stats.bytes += most * padded.element_size() * world
    return [n for t, c in zip(every, counts) for n in t[: int(c)].unbind()]
