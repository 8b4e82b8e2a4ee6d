"""The CUDA path: blocks compute on the GPU, their pages stay in pinned host memory.

Shaped as ZeRO-Infinity shapes it, kept to what one GPU needs:

- The resident group (embeddings, final norm, lm_head, adapters) lives on the GPU with its
  gradients and Adam state, and is stepped there by its own AdamW.
- The page pool stays in host memory (the swap's side of the engine is unchanged), made
  page-locked in place with cudaHostRegister: torch's pinned allocator would round the
  pool's one large allocation up to a power of two.
- A block's weights are copied host -> GPU into one of two device slots on a dedicated copy
  stream (non_blocking). The event recorded after the copy is what the compute stream
  waits on, so compute waits only for the block it needs; the host waits for a copy only
  before it hands that block's page back to the pager. The next block's copy is started
  as soon as the current block's kernels are queued (forward: block i+1 when block i
  exits; backward: block i-1 once block i is done), so it runs while the GPU computes. A
  slot is overwritten only after the compute stream has passed the event recorded when
  its block was released.
- A block's gradients are copied GPU -> host into a pinned staging buffer, and its AdamW
  step runs on the host over the fp32 pages exactly as on the CPU path (the tested
  arithmetic); the updated weights reach the GPU with the block's next copy.
- Budgets: `OffloadConfig.budget_bytes` is GPU memory (resident group and its state, the
  two slots, one block's gradients, the resident AdamW's scratch, activations);
  `host_budget_bytes` is host memory (the pool, the staging buffer, the host AdamW's
  scratch). `plan_device_memory` does that arithmetic.

Besides `DeviceCopies` and the CUDA branch of the RNG helpers, this is plain bookkeeping
that the CPU tests exercise (test_device.py also runs the engine's CUDA control flow with
CPU stand-ins for `DeviceCopies`'s streams and events).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._io import BufferPool, OffloadError, aligned_empty

SLOTS = 2  # device copies of block weights: the block computing and the next one


def resolve_device(requested: str | None, resident: Iterable[torch.Tensor]) -> torch.device:
    """The device blocks compute on: `requested`, else that of the resident parameters
    (those outside the blocks); CPU when there are none. CUDA must be available."""
    if requested is not None:
        device = torch.device(requested)
    else:
        found = {p.device for p in resident}
        if len(found) > 1:
            names = ", ".join(sorted(map(str, found)))
            raise OffloadError(
                f"the model's resident parameters are on several devices ({names}); "
                "set OffloadConfig.device"
            )
        device = found.pop() if found else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OffloadError(f"device {device} was asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise NotImplementedError(f"the engine computes on the CPU or a CUDA GPU, not {device}")
    return device


@dataclass(frozen=True)
class DevicePlan:
    """How the two budgets of the CUDA path are spent (bytes)."""

    device_fixed: int  # GPU: resident group + state, slots, a block's grads, AdamW scratch
    activations: int  # GPU left for activations: budget - device_fixed
    host_fixed: int  # host besides the pool: gradient staging, host AdamW scratch
    pool_room: int  # host left for the page pool
    slots: int
    slot_bytes: int


def plan_device_memory(
    budget: int,
    host_budget: int,
    *,
    resident_bytes: int,
    resident_trainable_bytes: int,
    block_grad_bytes: int,
    staging_bytes: int,
    host_scratch_bytes: int,
    slot_bytes: int,
    slots: int = SLOTS,
) -> DevicePlan:
    """Split the CUDA path's memory: what must sit on the GPU, what on the host.

    GPU: the resident group with gradients and Adam m, v (`resident_bytes`); `slots`
    copies of a block's weights (`slot_bytes` each); one block's gradients as autograd
    makes them; the resident AdamW's scratch (its foreach step makes temporaries for the
    whole group: counted twice, to err high). Host: the staging buffer for one block's
    gradients (a gradient region, padded) and the single-tensor AdamW's scratch; the rest
    of `host_budget` is the pool's."""
    device_fixed = (
        resident_bytes + slots * slot_bytes + block_grad_bytes + 2 * resident_trainable_bytes
    )
    host_fixed = staging_bytes + host_scratch_bytes
    return DevicePlan(
        device_fixed=device_fixed,
        activations=budget - device_fixed,
        host_fixed=host_fixed,
        pool_room=host_budget - host_fixed,
        slots=slots,
        slot_bytes=slot_bytes,
    )


class SlotTable:
    """Which block's weights each device slot holds; the least recently used free slot is
    reused first. Bookkeeping only (no CUDA)."""

    def __init__(self, n: int):
        self.block: list[int | None] = [None] * n
        self.in_use = [False] * n
        self._lru = list(range(n))  # least recently used first

    def find(self, block: int) -> int | None:
        return self.block.index(block) if block in self.block else None

    def assign(self, block: int) -> int:
        """A slot for `block`, which no slot holds: the least recently used one not in use."""
        if block in self.block:
            raise ValueError(f"block {block} already has a slot")
        for s in self._lru:
            if not self.in_use[s]:
                self.block[s] = block
                self._touch(s)
                return s
        raise OffloadError("every device slot is in use (engine bug)")

    def use(self, s: int) -> None:
        self.in_use[s] = True
        self._touch(s)

    def done(self, s: int) -> None:
        self.in_use[s] = False

    def invalidate(self, block: int | None = None) -> None:
        """Forget `block`'s copy (None: every copy); in-use marks stay as they are."""
        for s, b in enumerate(self.block):
            if block is None or b == block:
                self.block[s] = None

    def _touch(self, s: int) -> None:
        self._lru.remove(s)
        self._lru.append(s)


def rng_state(device: torch.device) -> Any:
    """What a recomputed block must replay: the CPU generator's state, and the GPU's when
    the block computes there (dropout draws from the generator of its tensors' device)."""
    cpu = torch.get_rng_state()
    return cpu if device.type == "cpu" else (cpu, torch.cuda.get_rng_state(device))


@contextlib.contextmanager
def replay_rng(state: Any, device: torch.device) -> Iterator[None]:
    """Run with the generators set to `state`, restoring them afterwards."""
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            yield
        return
    with torch.random.fork_rng(devices=[device.index]):
        torch.set_rng_state(state[0])
        torch.cuda.set_rng_state(state[1], device)
        yield


def streams_to_device(device: torch.device) -> bool:
    """Whether blocks are copied to `device` to compute there (the engine's CUDA path)."""
    return device.type == "cuda"


class DeviceCopies:
    """The GPU side of the CUDA path: weight slots, the copy stream, pinned host memory,
    and counters of what crossed the bus. Streams and events come from the few primitives
    at the end (and pin/close), so a test double can run the bookkeeping on the CPU."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int):
        self.device = device
        self.slot_bytes = slot_bytes
        self.arena = torch.empty(max(slots * slot_bytes, 1), dtype=torch.uint8, device=device)
        self.slots = [self.arena[i * slot_bytes : (i + 1) * slot_bytes] for i in range(slots)]
        self.table = SlotTable(slots)
        self.stream = self._new_stream()
        self._copied: list[Any] = [None] * slots  # event: the slot's last copy is done
        self._released: list[Any] = [None] * slots  # event: compute is done reading it
        self._registered: list[int] = []
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.copies = 0
        self.wait_s = 0.0

    def pin(self, t: torch.Tensor) -> None:
        """Page-lock a host tensor's memory in place (cudaHostRegister), for DMA copies."""
        n = t.numel() * t.element_size()
        if n == 0:
            return
        rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0))
        if rc != 0:
            raise OffloadError(
                f"could not page-lock {n / 2**20:.1f} MiB of host memory for the GPU "
                f"(cudaHostRegister error {rc}); try a smaller host_budget_bytes"
            )
        self._registered.append(t.data_ptr())

    def _slot(self, block: int) -> int:
        s = self.table.find(block)
        if s is None:
            raise OffloadError(f"block {block} is not on the device (engine bug)")
        return s

    def load(self, block: int, host: torch.Tensor, nbytes: int) -> bool:
        """Start copying a block's weights from its pinned host page into a slot, unless a
        slot holds them already (False). The page must stay as it is until
        wait_copied(block)."""
        if self.table.find(block) is not None:
            return False
        s = self.table.assign(block)
        with self._on(self.stream):
            if self._released[s] is not None:  # the last kernels reading this slot
                self.stream.wait_event(self._released[s])
            self.slots[s][:nbytes].copy_(host[:nbytes], non_blocking=True)
            self._copied[s] = self._record(self.stream)
        self.h2d_bytes += nbytes
        self.copies += 1
        return True

    def acquire(self, block: int) -> torch.Tensor:
        """The slot holding `block`, for compute: the compute stream waits for its copy."""
        s = self._slot(block)
        if self._copied[s] is not None:
            self._compute_stream().wait_event(self._copied[s])
        self.table.use(s)
        return self.slots[s]

    def slot_of(self, block: int) -> torch.Tensor:
        return self.slots[self._slot(block)]

    def release(self, block: int) -> None:
        """The compute stream's kernels queued so far are the last to read this slot."""
        s = self._slot(block)
        self._released[s] = self._record(self._compute_stream())
        self.table.done(s)

    def wait_copied(self, block: int) -> None:
        """Host waits until `block`'s copy has read its host page (the page can go)."""
        s = self.table.find(block)
        ev = self._copied[s] if s is not None else None
        if ev is not None and not ev.query():
            t0 = time.perf_counter()
            ev.synchronize()
            self.wait_s += time.perf_counter() - t0

    def invalidate(self, block: int | None = None) -> None:
        self.table.invalidate(block)

    def to_host(
        self, tensors: list[torch.Tensor | None], views: list[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Copy GPU tensors (made on the current stream) into pinned host views; wait."""
        out: list[torch.Tensor | None] = []
        for t, view in zip(tensors, views):
            if t is None:
                out.append(None)
                continue
            view.copy_(t, non_blocking=True)
            self.d2h_bytes += t.numel() * t.element_size()
            out.append(view)
        done = self._record(self._compute_stream())
        t0 = time.perf_counter()
        done.synchronize()
        self.wait_s += time.perf_counter() - t0
        return out

    def reset(self) -> None:
        """Wait for everything queued on the GPU, then forget every slot's contents."""
        try:
            self._synchronize()
        finally:
            self.table = SlotTable(len(self.slots))
            self._copied = [None] * len(self.slots)
            self._released = [None] * len(self.slots)

    def close(self) -> None:
        self._synchronize()
        for ptr in self._registered:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._registered = []

    def snapshot(self) -> dict[str, Any]:
        return {
            "h2d_bytes": self.h2d_bytes,
            "d2h_bytes": self.d2h_bytes,
            "h2d_copies": self.copies,
            "device_slots": len(self.slots),
            "device_slot_bytes": self.slot_bytes,
            "transfer_wait_s": self.wait_s,
            "device_peak_bytes": self._peak_bytes(),
        }

    # -- the CUDA primitives --------------------------------------------------------------

    def _new_stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def _compute_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def _on(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def _record(self, stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def open_copies(
    device: torch.device, plan: DevicePlan, pool: BufferPool, staging_bytes: int
) -> tuple[DeviceCopies, torch.Tensor]:
    """The engine's GPU side: device slots and the copy stream, with the page pool and a
    gradient staging buffer (`staging_bytes`, allocated here) page-locked."""
    dev = DeviceCopies(device, plan.slots, plan.slot_bytes)
    try:
        dev.pin(pool.storage)
        staging = aligned_empty(staging_bytes)
        dev.pin(staging)
    except BaseException:
        dev.close()
        raise
    return dev, staging
