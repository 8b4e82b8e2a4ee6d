"""Data parallel: every rank holds the whole model and steps it on its share of the batch;
the gradients are summed across the ranks before any norm is taken or any weight moves.

Why not torch's DistributedDataParallel: DDP reduces in hooks on each parameter's
AccumulateGrad, and a streamed block's gradients never reach `.grad` (they come from
torch.autograd.grad per block and go to the block's pages, _step.py). So the engine calls
torch.distributed's all_reduce itself, at the two places where gradients are final:
- a streamed block's, once its last micro-batch is added (block_grads_ready), before its
  per-tensor norms (clipping) or its AdamW step;
- the resident group's (embeddings, lm_head, LoRA adapters), after the backward.
With the loss divided by the token count of the whole (global) batch, the sum over ranks
is the one-process gradient. On two ranks the sum of two values is the same float in any
order, so the result is bitwise that of one process running the two shares as two
micro-batches; on more ranks it is equal up to the reduction order.

Every rank must bring the same gradients to each call (a parameter without a gradient on
one rank must have none on all): an empty share is a row whose labels are all ignored
(zero gradients), never a skipped step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import xxhash
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class DataParallelError(RuntimeError):
    """The ranks cannot train together (no process group, or their models differ)."""


def world(mode: str = "data_parallel") -> tuple[int, int]:
    """(rank, world size) of the default process group; it must be initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise DataParallelError(
            f"{mode} needs torch.distributed's default process group "
            "(torch.distributed.init_process_group, e.g. under torchrun)."
        )
    return dist.get_rank(), dist.get_world_size()


@dataclass
class ReduceStats:
    """What the reductions cost this rank: bytes handed to all_reduce, seconds waited in it
    (the wire, and waiting for the slowest rank)."""

    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0


def sum_across_ranks(tensors: list[torch.Tensor], stats: ReduceStats | None = None,
                     group=None) -> None:
    """Sum `tensors` in place over all ranks (of `group`, default all): one all_reduce per
    dtype and device (the tensors flattened into one buffer: fewer, larger messages; the
    same sums)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for same in groups.values():
        flat = _flatten_dense_tensors(same)
        started = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        if stats is not None:
            stats.seconds += time.perf_counter() - started
            stats.bytes += flat.numel() * flat.element_size()
            stats.calls += 1
        for t, summed in zip(same, _unflatten_dense_tensors(flat, same)):
            t.copy_(summed)


def batch_share(batch: dict[str, torch.Tensor], rank: int, world_size: int,
                ignore_index: int = -100) -> dict[str, torch.Tensor]:
    """Rank `rank`'s rows of `batch`: the contiguous slices of ceil(n / world_size) rows that
    OffloadEngine.step cuts for micro-batches, so the ranks' shares are one process's
    micro-batches. A rank left without rows gets the first row with every label ignored:
    it joins the step's reductions with zero gradients and adds nothing to the loss."""
    n = int(batch["input_ids"].shape[0])
    size = -(-n // world_size)
    start = rank * size
    if start < n:
        return {k: v[start : start + size] for k, v in batch.items()}
    share = {k: v[:1].clone() for k, v in batch.items()}
    share["labels"].fill_(ignore_index)
    return share


def sum_loss(loss: float) -> float:
    """The batch's loss: the ranks' shares added (in float64, as Python adds floats)."""
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item())


def weights_fingerprint(named: list[tuple[str, torch.nn.Parameter]]) -> torch.Tensor:
    """One 63-bit hash of each parameter's bytes (xxh3), and the count: equal exactly when
    the values are, whatever thread count a rank runs with (a float sum is not: torch adds
    a tensor in as many pieces as it has threads, so two machines with other core counts
    got other last bits from the same weights). Meta parameters are left out alike."""
    digests = [xxhash.xxh3_64_intdigest(_bytes_of(p)) >> 1 for _, p in named if not p.is_meta]
    return torch.tensor([*digests, len(named)], dtype=torch.int64)


def _bytes_of(p: torch.Tensor) -> memoryview:
    t = p.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def check_same_model(named: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Refuse to start when the ranks' models differ (another seed, another file): each
    rank's weights_fingerprint is gathered and compared with rank 0's."""
    mine = weights_fingerprint(named)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    differ = [r for r, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differ:
        raise DataParallelError(
            f"rank(s) {differ} start from other weights than rank 0: every rank must load "
            "the same model (same files, same seed for new adapters)."
        )
