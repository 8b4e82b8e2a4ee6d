"""OffloadEngine: train a transformer whose training state is larger than the memory budget.

What stays resident and what streams:
- Parameters outside the transformer blocks (embeddings, final norm, lm_head) stay
  resident with their gradients and Adam state ("resident group").
- Full fine-tuning: every block parameter streams. A block's weights, Adam m, Adam v and
  gradients are four flat regions in preallocated swap files (the gradient region is
  used when clipping or accumulating micro-batches).
- Frozen base (LoRA, adapters): when blocks hold frozen parameters, those stream
  read-only (never written back) and the block's trainable parameters (the adapters)
  stay resident.

One step (see _hooks.py for the per-block mechanics):
  forward   blocks 0..L-1 paged in with prefetch, only block inputs kept;
  backward  blocks L-1..0 paged in, recomputed, differentiated; without clipping each
            block is stepped by AdamW at once and written back behind the next block's
            compute, so the gradients of the whole model never exist at once;
  clipping  needs the global norm before any parameter moves, so during backward each
            block's gradients are spilled to the swap (one extra write and read of a
            block's size) with their per-tensor norms kept; then the total norm is
            reduced in clip_grad_norm_'s order and blocks 0..L-1 are paged in again
            (weights, gradients, m, v), clipped and stepped. Cost: one more read of
            weights and gradients per block and one more write (the spill) per step,
            against a second full forward/backward for a two-pass design.
  micro-batches  gradients of all but the last micro-batch are spilled and read back
            to be added (as autograd accumulates .grad), then stepped as above.
  resident  the resident group is clipped and stepped last, by its own AdamW.

Memory: the budget covers the pool of page buffers (allocated once), the resident group
with its gradients and Adam state, one block's gradients, AdamW's scratch tensors and
the step's activations (an estimate from the model config; a batch that would not fit
is refused before it starts). Prefetch and write-behind happen inside the pool; when
the pool can hold every region, nothing is read twice or written before a checkpoint.

CUDA (OffloadConfig.device, default: where the resident parameters are): the resident
group moves to the GPU, blocks compute there from two device copies filled on a copy
stream, and the pool, the block steps and everything on the swap's side stay on the host
as above; the budget is then GPU memory and host_budget_bytes sizes the pool (_device.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import torch

from . import _checkpoint
from ._config import AdamWConfig, OffloadConfig
from ._device import (
    DeviceCopies,
    DevicePlan,
    plan_device_memory,
    replay_rng,
    resolve_device,
    rng_state,
    streams_to_device,
)
from ._hooks import patch_block, unpatch_block
from ._io import (
    BufferPool,
    IOExecutor,
    IOStats,
    OffloadError,
    SwapStore,
    aligned_empty,
    byte_view,
    probe_o_direct,
)
from ._layout import EXP_AVG, EXP_AVG_SQ, GRAD, WEIGHT, BlockLayout
from ._malloc import fix_mmap_threshold
from ._optim import make_adamw, norm_order, step_tensor_factory, tensor_norms, total_norm
from ._pager import Key, Pager
from ._plan import activation_bytes, graph_bytes
from ._safetensors import SafetensorsSource

_PAGE_REF = object()  # marks a saved tensor kept as a place in a weight page (_page_refs)


class OffloadBudgetError(OffloadError):
    """The budget cannot hold what the engine needs (at start, or for this batch)."""


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


def _nbytes(p: torch.Tensor) -> int:
    return p.numel() * p.element_size()


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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


def _unmeta_blocks(blocks: Sequence[torch.nn.Module]) -> set[int]:
    """Make the blocks' meta-device parameters placeholders (release_parameters); returns
    the ids of every block parameter that holds no values, for init_weights to create."""
    for block in blocks:
        release_parameters(block)
    return {id(p) for block in blocks for p in block.parameters() if is_unloaded(p)}


class OffloadEngine:
    """Trains `model` under `config.budget_bytes` of memory, paging blocks to `config.swap_dir`.

    step(batch) -> float has the contract of an in-memory engine: forward, backward,
    optional clipping by global norm, AdamW step; returns the loss."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_config: AdamWConfig | dict[str, Any] | None = None,
        config: OffloadConfig | dict[str, Any] | None = None,
        *,
        blocks: Sequence[torch.nn.Module] | None = None,
        weights_files: Sequence[str | os.PathLike] | None = None,
        init_weights: Callable[[str, torch.Tensor], None] | None = None,
    ):
        """`weights_files`: the .safetensors files the model was loaded from. With a frozen
        base, blocks whose frozen weights are found there byte for byte (same names, dtype,
        shape) are read from those files directly: no swap copy, nothing ever written.

        `init_weights(name, tensor)`: block parameters that hold no values (on the meta
        device, a model built under `torch.device("meta")` too large to exist in memory, or
        placeholders from release_parameters) are created in their swap page instead, one
        block at a time: the engine hands each one's page view to init_weights, which fills
        it in place. Everything outside the blocks must be real. Such a parameter found in
        `weights_files` (frozen base) by name, dtype and shape is read from there instead:
        with nothing to compare, the file is taken as its values."""
        if config is None:
            raise ValueError("an OffloadConfig (budget_bytes, swap_dir) is required")
        self.config = (
            config if isinstance(config, OffloadConfig) else OffloadConfig.from_dict(dict(config))
        )
        self.optim = AdamWConfig.coerce(optimizer_config)
        self.malloc_mmap_threshold: int | None = None  # set below when the engine streams
        self.model = model
        self._blocks = list(blocks) if blocks is not None else find_blocks(model)
        self._meta_params = _unmeta_blocks(self._blocks) if init_weights is not None else set()
        self.step_count = 0
        self._in_step = False
        self._failed: BaseException | None = None
        self._closed = False
        self.last_grad_norm: float | None = None
        self._step_time_s = 0.0
        self._micro, self._final = 0, True

        named = list(model.named_parameters())
        in_blocks = {id(p) for b in self._blocks for p in b.parameters()}
        self.device = resolve_device(
            self.config.device, [p for _, p in named if id(p) not in in_blocks]
        )
        self._cuda = streams_to_device(self.device)
        self._dev: DeviceCopies | None = None  # the CUDA path's transfers (_device.py)
        self.device_plan: DevicePlan | None = None
        self._named = named
        name_of = {id(p): n for n, p in named}
        frozen_in_blocks = any(not p.requires_grad for b in self._blocks for p in b.parameters())
        # Frozen-base mode (LoRA): frozen block weights stream read-only, adapters resident.
        self.mode = "frozen_base" if frozen_in_blocks else "full"

        streamed_ids: set[int] = set()
        self._layouts: list[BlockLayout] = []
        self._block_resident: list[list[torch.nn.Parameter]] = []
        for i, block in enumerate(self._blocks):
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
            self._layouts.append(BlockLayout(i, streamed, trainable))
            self._block_resident.append(
                [p for _, p in bnamed if p.requires_grad and id(p) not in streamed_ids]
            )
        self._resident = [(n, p) for n, p in named if id(p) not in streamed_ids]
        self._resident_trainable = [(n, p) for n, p in self._resident if p.requires_grad]
        if self._cuda:  # the resident group and every buffer live on the GPU
            for _, p in self._resident:
                p.data = p.data.to(self.device)
            for mod in model.modules():
                for k, b in mod._buffers.items():
                    if b is not None and b.device != self.device:
                        mod._buffers[k] = b.to(self.device)
            for layout in self._layouts:
                layout.home = self.device
        self._trainable_all = [p for _, p in named if p.requires_grad]
        self._norm_order = norm_order(self._trainable_all)

        self._clip = self.optim.max_grad_norm is not None
        has_trainable = any(layout.trainable for layout in self._layouts)
        kinds = [WEIGHT]
        if has_trainable:  # gradients spill when clipping or accumulating micro-batches
            kinds += [EXP_AVG, EXP_AVG_SQ, GRAD]
        self._kinds = kinds
        regions = {k: [layout.region_bytes[k] for layout in self._layouts] for k in kinds}
        page_bytes = max(max(v) for v in regions.values())
        self._source = None
        from_files: dict[int, list[tuple[int, int, int, int]]] = {}
        if weights_files and self.mode == "frozen_base":
            self._source = SafetensorsSource([os.fspath(f) for f in weights_files])
            from_files = self._map_to_files()
            for i in from_files:
                regions[WEIGHT][i] = 0  # no swap region: read from the model's files
        # Most pages the engine pins at once: forward 1; a block's step w+g+m+v.
        self._reserve = 4 if has_trainable else 1

        # -- memory plan -----------------------------------------------------------------
        budget = self.config.budget_bytes
        res_params = sum(_nbytes(p) for _, p in self._resident)
        res_train = sum(_nbytes(p) for _, p in self._resident_trainable)
        self.resident_bytes = res_params + 3 * res_train  # + grads, Adam m, Adam v
        self.block_grad_bytes = max(
            (layout.trainable_bytes() for layout in self._layouts), default=0
        )
        # AdamW's single-tensor step makes two temporaries the size of the parameter
        # (sqrt of v, then its division by the bias correction).
        self.scratch_bytes = 2 * max((_nbytes(p) for _, p in named if p.requires_grad), default=0)
        act_reserve = (
            self.config.activation_bytes
            if self.config.activation_bytes is not None
            else budget // 4
        )
        fixed = self.resident_bytes + self.block_grad_bytes + self.scratch_bytes
        avail = budget - fixed - act_reserve
        if self._cuda:  # budget: GPU memory; the pool lives in host memory (_device.py)
            self.device_plan = self._plan_cuda(budget, act_reserve, res_train)
            fixed, avail = self.device_plan.device_fixed, self.device_plan.pool_room
        affordable = avail // page_bytes if page_bytes else 0
        if affordable < self._reserve and self._cuda:
            plan = self.device_plan
            raise OffloadBudgetError(
                f"host budget {(plan.pool_room + plan.host_fixed) / 2**20:.1f} MiB is too "
                f"small: the pinned page pool needs {self._reserve} buffers of "
                f"{page_bytes / 2**20:.1f} MiB besides {plan.host_fixed / 2**20:.1f} MiB "
                "(one block's gradients, optimizer scratch); raise host_budget_bytes"
            )
        if affordable < self._reserve:
            need = fixed + act_reserve + self._reserve * page_bytes
            raise OffloadBudgetError(
                f"budget {budget / 2**20:.1f} MiB is too small: the engine needs at least "
                f"{need / 2**20:.1f} MiB (resident parameters and their state "
                f"{self.resident_bytes / 2**20:.1f} MiB, one block's gradients "
                f"{self.block_grad_bytes / 2**20:.1f} MiB, optimizer scratch "
                f"{self.scratch_bytes / 2**20:.1f} MiB, {self._reserve} buffers of "
                f"{page_bytes / 2**20:.1f} MiB, activations {act_reserve / 2**20:.1f} MiB)"
            )
        total_pages = sum(1 for k in kinds for s in regions[k] if s) + len(from_files)
        if affordable >= total_pages + self._reserve:
            n_pages, self.streaming = total_pages + self._reserve, False
        else:
            n_pages = min(affordable, self._reserve * (2 + self.config.prefetch))
            self.streaming = True
            # Memory is what limits this run: before the pool and the steps allocate, make
            # freed tensors go back to the system (_malloc.py). Not when everything fits:
            # the fixed threshold costs speed (fresh pages for every large tensor).
            threshold = self.config.malloc_mmap_threshold
            if threshold is not None and fix_mmap_threshold(threshold):
                self.malloc_mmap_threshold = threshold
        self._prefetch_pages = self.config.prefetch * self._reserve
        self._schedule: list[tuple[Key, bool]] = []
        self._sched_pos = 0

        # -- storage -----------------------------------------------------------------------
        if self.config.o_direct == "auto":
            self.o_direct = probe_o_direct(self.config.swap_dir)
        else:
            self.o_direct = bool(self.config.o_direct)
        try:
            self._store = SwapStore(self.config.swap_dir, regions, self.o_direct)
        except BaseException:
            if self._source is not None:
                self._source.close()
            raise
        try:
            for i, extents in from_files.items():
                self._store.map_external(i, WEIGHT, extents, "model weights file")
            self._pool = BufferPool(n_pages, page_bytes)
            if self._cuda:
                self._setup_cuda()
            self._stats = IOStats()
            self._io = IOExecutor(self.config.io_threads, self.config.chunk_bytes, self._stats)
            self._pager = Pager(
                self._store, self._pool, self._io, self._reserve, write_behind=self.streaming
            )
            self.pool_bytes = self._pool.nbytes
            # What the budget holds besides activations (on CUDA the pool is host memory).
            self._owned_bytes = fixed if self._cuda else self.pool_bytes + fixed
            self._act_budget = budget - self._owned_bytes
            self.peak_bytes = self._owned_bytes
            self._last_act_est: int | None = None
            self._keep_graphs = False  # this step keeps block graphs (no recompute)
            self.kept_graphs = False  # the last step did

            # -- optimizers ------------------------------------------------------------------
            dtype = named[0][1].dtype if named else torch.float32
            self._fresh_step = step_tensor_factory(self.optim, dtype, torch.device("cpu"))
            self._block_opts = [
                make_adamw(list(zip(layout.trainable_names, layout.trainable)), self.optim)
                for layout in self._layouts
            ]
            self._steps: dict[int, torch.Tensor] = {
                id(p): self._fresh_step() for layout in self._layouts for p in layout.trainable
            }
            self._resident_opt = make_adamw(self._resident_trainable, self.optim)
            self._norms: dict[int, torch.Tensor] = {}
            self._has_grad: dict[int, bool] = {}

            # -- move the blocks' weights out to the swap -------------------------------------
            for layout in self._layouts:
                if layout.index in from_files:
                    layout.unbind()
                    continue
                page = self._pager.get((layout.index, WEIGHT), read=False)
                page.tensor.zero_()
                layout.fill(page.tensor, skip=self._meta_params)
                for s in layout.weight_slots:
                    if id(s.param) in self._meta_params:
                        init_weights(s.name, s.view(page.tensor))
                layout.unbind()
                self._pager.release(page, dirty=True)
            self._pager.flush()
        except BaseException:
            self._shutdown_io(remove=True)
            raise

        if self._cuda:  # blocks' parameters now read as GPU placeholders, as in plain torch
            self._norm_order = norm_order(self._trainable_all)
        # Puts every block in the graph.
        self._anchor = torch.zeros((), requires_grad=True, device=self.device)
        self._pinned: dict[Key, Any] = {}
        for i, block in enumerate(self._blocks):
            patch_block(self, i, block)

    # -- public API ------------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return self.optim.lr

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter (for a schedule, before step())."""
        self.optim.lr = lr
        for opt in [*self._block_opts, self._resident_opt]:
            if opt is not None:
                for g in opt.param_groups:
                    g["lr"] = lr

    def step(
        self,
        batch: dict[str, torch.Tensor],
        *,
        loss_fn: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
        micro_batches: int = 1,
    ) -> float:
        """One optimizer step: forward and backward of each micro-batch (gradients add
        up), clipping by global norm if configured, AdamW. Returns the sum of the
        micro-batches' losses (the loss, for one micro-batch).

        loss_fn(model, micro_batch) -> loss tensor; default: the model's own loss from
        `labels`. The batch is split into `micro_batches` slices of ceil(n / micro_batches)
        rows, as worker/training/engines.py's InMemoryEngine splits it."""
        self._check_usable()
        batch = self._to_device(batch)
        n = int(batch["input_ids"].shape[0])
        size = math.ceil(n / max(1, micro_batches))
        micros = [{k: v[s : s + size] for k, v in batch.items()} for s in range(0, n, size)]
        keep = [
            self._check_activations(int(m["input_ids"].shape[0]), int(m["input_ids"].shape[-1]))
            for m in micros
        ]
        t0 = time.perf_counter()
        total = 0.0
        self._in_step = True
        self._keep_graphs = self.kept_graphs = all(keep)
        try:
            for j, micro in enumerate(micros):
                self._micro, self._final = j, j == len(micros) - 1
                self._start_schedule(training=True)
                if loss_fn is None:
                    out = self.model(**micro, use_cache=False)
                    loss = out.loss if hasattr(out, "loss") else out["loss"]
                else:
                    loss = loss_fn(self.model, micro)
                loss.backward()
                total += loss.item()
            if self._clip:
                self._clip_and_step_blocks()
            self._step_resident()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._in_step = False
            self._keep_graphs = False
            self._has_grad.clear()
            self._norms.clear()
        self.step_count += 1
        self._step_time_s += time.perf_counter() - t0
        return total

    @torch.no_grad()
    def evaluate(
        self,
        batch: dict[str, torch.Tensor],
        loss_fn: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor] | None = None,
    ) -> float:
        """Loss of `batch` without training (blocks stream as in the forward)."""
        self._check_usable()
        batch = self._to_device(batch)
        ids = batch["input_ids"]
        self._check_activations(int(ids.shape[0]), int(ids.shape[-1]), training=False)
        self._start_schedule(training=False)
        if loss_fn is not None:
            return float(loss_fn(self.model, batch))
        return float(self.model(**batch, use_cache=False).loss)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with real values for the streamed parameters (copies, on
        the host; on the CPU path resident tensors are copied where they are).

        Needs memory for the whole model: it is the export path, not a training one."""
        self._check_usable()
        self._schedule = []
        self._pager.cancel_prefetches()
        if self._dev is not None:
            self._settle_device()
        values: dict[int, torch.Tensor] = {}
        for layout in self._layouts:
            page = self._pager.get((layout.index, WEIGHT))
            try:
                for s in layout.weight_slots:
                    values[id(s.param)] = s.view(page.tensor).clone()
            finally:
                self._pager.release(page)
        out = {}
        for k, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in values:
                out[k] = values[id(t)]
            else:  # on CUDA, host copies of the resident group too
                out[k] = t.detach().clone() if self._dev is None else t.detach().cpu()
        return out

    @contextlib.contextmanager
    def block_weights(self, i: int):
        """Block i's streamed parameters hold their values (host memory) inside the `with`;
        outside it they are placeholders again. For reading a model larger than memory one
        block at a time (export); nothing written to them is kept."""
        self._check_usable()
        if self._dev is not None:
            self._settle_device()
        self._schedule = []
        self._pager.cancel_prefetches()
        layout = self._layouts[i]
        page = self._pager.get((layout.index, WEIGHT))
        try:
            layout.bind(page.tensor)
            yield self._blocks[i]
        finally:
            layout.unbind()
            self._pager.release(page)

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The transformer blocks the engine streams, in order."""
        return list(self._blocks)

    def save_checkpoint(self, directory: str | os.PathLike, extra: dict | None = None) -> None:
        """Swap files + resident state + manifest into `directory`, atomically: a crash or a
        full disk at any point leaves the previous checkpoint there loadable."""
        self._check_usable()
        _checkpoint.save(self, os.fspath(directory), extra or {})

    def load_checkpoint(self, directory: str | os.PathLike) -> dict:
        """Restore the state saved by save_checkpoint(), including torch's CPU RNG state;
        returns its `extra` dict. Also recovers an engine whose step failed."""
        if self._closed:
            raise OffloadError("engine is closed")
        extra = _checkpoint.load(self, os.fspath(directory))
        self._failed = None
        return extra

    def telemetry(self) -> dict[str, Any]:
        """Counters since start: I/O volume and rates, stalls, prefetch hits, memory."""
        d: dict[str, Any] = {
            "steps": self.step_count,
            "mode": self.mode,
            "device": str(self.device),
            "streaming": self.streaming,
            "o_direct": self.o_direct,
            "budget_bytes": self.config.budget_bytes,
            "pool_bytes": self.pool_bytes,
            "page_bytes": self._pool.page_bytes,
            "pages": self._pool.n_pages,
            "resident_bytes": self.resident_bytes,
            "block_grad_bytes": self.block_grad_bytes,
            "scratch_bytes": self.scratch_bytes,
            "activation_bytes_est": self._last_act_est,
            "kept_graphs": self.kept_graphs,
            "peak_bytes": self.peak_bytes,
            "peak_rss_bytes": _peak_rss_bytes(),
            "malloc_mmap_threshold": self.malloc_mmap_threshold,
            "swap_bytes": self._store.nbytes,
            "blocks_read_from_weights_files": len(self._store.external),
            "step_s": self._step_time_s,
            "last_grad_norm": self.last_grad_norm,
        }
        d.update(self._stats.snapshot())
        d.update(self._pager.snapshot())
        if self._dev is not None:
            d["host_budget_bytes"] = self.device_plan.pool_room + self.device_plan.host_fixed
            d.update(self._dev.snapshot())
        return d

    def close(self, restore_weights: bool = False) -> None:
        """Stop the I/O threads and remove the swap files (unless keep_swap). With
        `restore_weights` the model gets its streamed parameters back in memory."""
        if self._closed:
            return
        if restore_weights:
            state = self.model_state_dict()
            for n, p in self._named:
                if any(p is s.param for layout in self._layouts for s in layout.weight_slots):
                    p.data = state[n].to(self.device)
        for block in self._blocks:
            unpatch_block(block)
        self._shutdown_io(remove=not self.config.keep_swap)
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- called by the block hooks ----------------------------------------------------------

    def _check_training_call(self) -> None:
        if not self._in_step:
            raise OffloadError(
                "this model's blocks are streamed by an OffloadEngine: train with "
                "engine.step(batch), and run inference under torch.no_grad()"
            )

    def _forward_enter(self, i: int) -> None:
        if not self._schedule:  # a no-grad call from outside step()/evaluate()
            self._start_schedule(training=False)
        if self._dev is not None:
            self._bind_on_device(i, keep_host=False)
            return
        page = self._demand((i, WEIGHT))
        self._layouts[i].bind(page.tensor)
        self._pinned[(i, WEIGHT)] = page

    def _forward_exit(self, i: int) -> None:
        self._layouts[i].unbind()
        if self._dev is not None:
            self._dev.release(i)
            if i + 1 < len(self._layouts):
                self._load_to_device(i + 1)  # copied while the GPU computes block i
        else:
            self._pager.release(self._pinned.pop((i, WEIGHT)))
        if i == len(self._layouts) - 1 and not self._in_step:
            self._schedule = []

    def _page_refs(self, i: int):
        """saved_tensors_hooks for block i's kept graph: a saved tensor inside the pool
        (block i's weights, bound in its page) is stored as its place in that page and
        rebuilt from whichever page holds block i's weights when the backward runs. On
        CUDA the same holds for the device slots block i's weights are bound in."""
        arena = self._pool.storage if self._dev is None else self._dev.arena
        pool = arena.untyped_storage().data_ptr()

        def bound() -> torch.Tensor:  # the buffer holding block i's weights just now
            if self._dev is not None:
                return self._dev.slot_of(i)
            return self._pinned[(i, WEIGHT)].tensor

        def pack(t: torch.Tensor):
            if t.device != arena.device or t.untyped_storage().data_ptr() != pool:
                return t
            page = bound()
            off = t.data_ptr() - page.data_ptr()
            if not 0 <= off < page.numel():
                raise OffloadError(f"block {i} saved a tensor of another block's page")
            return (_PAGE_REF, off // t.element_size(), tuple(t.shape), t.stride(), t.dtype)

        def unpack(v):
            if not (isinstance(v, tuple) and v and v[0] is _PAGE_REF):
                return v
            _, off, shape, stride, dtype = v
            flat = bound().view(dtype)
            return flat.as_strided(shape, stride, flat.storage_offset() + off)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _backward_block(self, i, fn, hidden, args, kwargs, rng, grad_out, need_x, graph=None):
        """Block i's gradients: from its kept graph (x, out), or by recomputing it."""
        layout = self._layouts[i]
        streamed = layout.trainable
        if self._dev is not None:  # its host page stays pinned when the block is stepped
            self._bind_on_device(i, keep_host=bool(streamed))
        else:
            w = self._demand((i, WEIGHT))
            layout.bind(w.tensor)
            self._pinned[(i, WEIGHT)] = w
        resident = self._block_resident[i]
        if graph is not None:
            x, out = graph
            del graph
        else:
            x = hidden.detach().requires_grad_(need_x)
            with torch.enable_grad(), replay_rng(rng, self.device):
                out = fn(x, *args, **kwargs)
        inputs = ([x] if need_x else []) + streamed + resident
        grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True) if inputs else ()
        del out
        nx = 1 if need_x else 0
        grad_x = grads[0] if need_x else None
        block_grads = list(grads[nx : nx + len(streamed)])
        for p, g in zip(resident, grads[nx + len(streamed) :]):
            if g is not None:  # as AccumulateGrad would: set, or add when already there
                p.grad = g if p.grad is None else p.grad + g
        del grads
        if self._dev is not None:
            self._dev.release(i)
            if streamed:
                block_grads = self._grads_to_host(i, block_grads)
        if streamed:
            self._block_grads_ready(i, block_grads)
        else:
            layout.unbind()
            if self._dev is None:
                self._pager.release(self._pinned.pop((i, WEIGHT)))
        if self._dev is not None and i > 0:
            self._load_to_device(i - 1)  # copied while the GPU finishes block i
        return grad_x

    # -- the CUDA path (see _device.py) ------------------------------------------------------

    def _plan_cuda(self, budget: int, act_reserve: int, res_train: int) -> DevicePlan:
        plan = plan_device_memory(
            budget,
            self.config.host_budget_bytes or budget,
            resident_bytes=self.resident_bytes,
            resident_trainable_bytes=res_train,
            block_grad_bytes=self.block_grad_bytes,
            staging_bytes=self._staging_bytes(),
            host_scratch_bytes=self.scratch_bytes,
            slot_bytes=max((layout.region_bytes[WEIGHT] for layout in self._layouts), default=0),
        )
        if plan.activations < act_reserve:
            raise OffloadBudgetError(
                f"GPU budget {budget / 2**20:.1f} MiB is too small: the engine needs at least "
                f"{(plan.device_fixed + act_reserve) / 2**20:.1f} MiB on {self.device} "
                f"(resident parameters and their state {self.resident_bytes / 2**20:.1f} "
                f"MiB, {plan.slots} copies of a block's weights of "
                f"{plan.slot_bytes / 2**20:.1f} MiB, one block's gradients "
                f"{self.block_grad_bytes / 2**20:.1f} MiB, optimizer scratch "
                f"{2 * res_train / 2**20:.1f} MiB, activations {act_reserve / 2**20:.1f} MiB)"
            )
        return plan

    def _staging_bytes(self) -> int:
        return max((layout.region_bytes[GRAD] for layout in self._layouts), default=0)

    def _setup_cuda(self) -> None:
        """GPU slots and copy stream; the pool and a gradient staging buffer page-locked."""
        plan = self.device_plan
        assert plan is not None
        self._dev = DeviceCopies(self.device, plan.slots, plan.slot_bytes)
        self._dev.pin(self._pool.storage)
        self._staging = aligned_empty(self._staging_bytes())
        self._dev.pin(self._staging)

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self._dev is None:
            return batch
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _rng_state(self) -> Any:
        return rng_state(self.device)

    def _load_to_device(self, i: int) -> None:
        """Pin block i's host page (read from the swap if needed), start its copy to the GPU."""
        key = (i, WEIGHT)
        if key not in self._pinned:
            self._pinned[key] = self._demand(key)
        self._dev.load(i, self._pinned[key].tensor, self._layouts[i].region_bytes[WEIGHT])

    def _bind_on_device(self, i: int, keep_host: bool) -> None:
        """Bind block i's parameters to its GPU copy. keep_host: its host page stays pinned
        (the block's step updates it there); otherwise it goes back once copied."""
        self._load_to_device(i)
        self._layouts[i].bind(self._dev.acquire(i))
        if not keep_host:
            self._dev.wait_copied(i)
            self._pager.release(self._pinned.pop((i, WEIGHT)))

    def _grads_to_host(self, i: int, grads: list[torch.Tensor | None]) -> list:
        """Block i's gradients GPU -> pinned staging; the block is bound to its host page
        again, where AdamW steps it (its GPU copy is stale from then on)."""
        layout = self._layouts[i]
        host = self._dev.to_host(grads, layout.state_views(self._staging))
        self._dev.wait_copied(i)  # (done: the compute stream waited for it)
        self._dev.invalidate(i)
        layout.bind(self._pinned[(i, WEIGHT)].tensor)
        return host

    def _settle_device(self) -> None:
        """Before a new pass: let queued copies finish, give back host pages held for them,
        and forget which blocks the GPU holds."""
        self._dev.reset()
        for key in [k for k in self._pinned if k[1] == WEIGHT]:
            self._pager.release(self._pinned.pop(key))

    # -- stepping ----------------------------------------------------------------------------

    def _step_block(self, i: int, grads: list[torch.Tensor | None]) -> None:
        """AdamW on block i (weights bound) with `grads`; then page everything out."""
        layout = self._layouts[i]
        m = self._demand((i, EXP_AVG))
        self._pinned[(i, EXP_AVG)] = m
        v = self._demand((i, EXP_AVG_SQ))
        self._pinned[(i, EXP_AVG_SQ)] = v
        opt = self._block_opts[i]
        stepped = []
        for p, g, mv, vv in zip(
            layout.trainable, grads, layout.state_views(m.tensor), layout.state_views(v.tensor)
        ):
            if g is None:
                continue
            p.grad = g
            opt.state[p] = {"step": self._steps[id(p)], "exp_avg": mv, "exp_avg_sq": vv}
            stepped.append(p)
        opt.step()
        for p in stepped:
            p.grad = None
            del opt.state[p]
        layout.unbind()
        for kind in (WEIGHT, EXP_AVG, EXP_AVG_SQ):
            self._pager.release(self._pinned.pop((i, kind)), dirty=True)

    def _block_grads_ready(self, i: int, grads: list[torch.Tensor | None]) -> None:
        """Block i's gradients for this micro-batch exist (weights still bound).

        Earlier micro-batches' gradients are in the swap: read and add (as AccumulateGrad
        adds). Last micro-batch without clipping: step the block now. Otherwise (more
        micro-batches, or clipping needs the global norm first): write them back, keeping
        per-tensor norms when they are final."""
        layout = self._layouts[i]
        gp = None
        if self._micro > 0:
            gp = self._demand((i, GRAD))
            self._pinned[(i, GRAD)] = gp
            for p, g, view in zip(layout.trainable, grads, layout.state_views(gp.tensor)):
                if g is None:
                    continue
                if self._has_grad.get(id(p)):
                    view.add_(g)
                else:
                    view.copy_(g)
                    self._has_grad[id(p)] = True
            grads = [
                view if self._has_grad.get(id(p)) else None
                for p, view in zip(layout.trainable, layout.state_views(gp.tensor))
            ]
        if self._final and not self._clip:
            self._step_block(i, grads)
            if gp is not None:
                self._pager.discard(self._pinned.pop((i, GRAD)))
            return
        if self._final:  # clipping: per-tensor norms of the finished gradients
            present = [(p, g) for p, g in zip(layout.trainable, grads) if g is not None]
            norms = tensor_norms([g for _, g in present], self.optim.foreach)
            for (p, _), norm in zip(present, norms):
                self._norms[id(p)] = norm
        if gp is None:
            gp = self._demand((i, GRAD), read=False)
            self._pinned[(i, GRAD)] = gp
            for p, g, view in zip(layout.trainable, grads, layout.state_views(gp.tensor)):
                self._has_grad[id(p)] = g is not None
                if g is not None:
                    view.copy_(g)
        del grads
        self._pager.release(self._pinned.pop((i, GRAD)), dirty=True)
        layout.unbind()
        self._pager.release(self._pinned.pop((i, WEIGHT)))

    def _clip_and_step_blocks(self) -> None:
        res = [(p, p.grad) for _, p in self._resident_trainable if p.grad is not None]
        for (p, _), n in zip(res, tensor_norms([g for _, g in res], self.optim.foreach)):
            self._norms[id(p)] = n
        norms = [self._norms[id(p)] for p in self._norm_order if id(p) in self._norms]
        self._total_norm = total_norm(norms)
        self.last_grad_norm = float(self._total_norm)
        max_norm = float(self.optim.max_grad_norm)
        for i, layout in enumerate(self._layouts):
            if not layout.trainable:
                continue
            w = self._demand((i, WEIGHT))
            layout.bind(w.tensor)
            self._pinned[(i, WEIGHT)] = w
            g = self._demand((i, GRAD))
            self._pinned[(i, GRAD)] = g
            grads = [
                view if self._has_grad.get(id(p)) else None
                for p, view in zip(layout.trainable, layout.state_views(g.tensor))
            ]
            with_grad = [(p, gv) for p, gv in zip(layout.trainable, grads) if gv is not None]
            for p, gv in with_grad:
                p.grad = gv
            torch.nn.utils.clip_grads_with_norm_(
                [p for p, _ in with_grad], max_norm, self._total_norm, foreach=self.optim.foreach
            )
            for p, _ in with_grad:
                p.grad = None
            self._step_block(i, grads)
            self._pager.discard(self._pinned.pop((i, GRAD)))

    def _step_resident(self) -> None:
        params = [p for _, p in self._resident_trainable if p.grad is not None]
        if self._clip and params:
            torch.nn.utils.clip_grads_with_norm_(
                params,
                float(self.optim.max_grad_norm),
                self._total_norm,
                foreach=self.optim.foreach,
            )
        if self._resident_opt is not None:
            self._resident_opt.step()
        for _, p in self._resident_trainable:
            p.grad = None

    # -- paging ------------------------------------------------------------------------------

    def _start_schedule(self, training: bool) -> None:
        """Every region this pass will pin, in order ((key, read) pairs; read False: a
        page the engine fills itself). Prefetch walks ahead of the demands along it."""
        self._pager.cancel_prefetches()
        if self._dev is not None:
            self._settle_device()
        n = len(self._layouts)
        sched: list[tuple[Key, bool]] = [((i, WEIGHT), True) for i in range(n)]
        if training:
            final, acc = self._final, self._micro > 0
            for i in reversed(range(n)):
                sched.append(((i, WEIGHT), True))
                if not self._layouts[i].trainable:
                    continue
                if acc:
                    sched.append(((i, GRAD), True))
                if final and not self._clip:
                    sched += [((i, EXP_AVG), True), ((i, EXP_AVG_SQ), True)]
                elif not acc:
                    sched.append(((i, GRAD), False))  # the spill page
            if final and self._clip:
                for i in range(n):
                    if self._layouts[i].trainable:
                        sched += [((i, k), True) for k in (WEIGHT, GRAD, EXP_AVG, EXP_AVG_SQ)]
        self._schedule = sched
        self._sched_pos = 0

    def _demand(self, key: Key, read: bool = True):
        """Pin `key`'s page, prefetching in schedule order what comes next."""
        pos = self._sched_pos
        while pos < len(self._schedule) and self._schedule[pos][0] != key:
            pos += 1
        if pos < len(self._schedule):
            self._sched_pos = pos + 1
            for k, r in self._schedule[pos : pos + 1 + self._prefetch_pages]:
                if not self._pager.prefetch(k, r):
                    break  # strictly in order: see _pager.py's deadlock rule
        return self._pager.get(key, read)

    # -- budget and failure ------------------------------------------------------------------

    def _check_activations(self, batch: int, seq: int, training: bool = True) -> bool:
        """Refuse a batch whose activations do not fit the budget. True when, on top of
        them, every block's autograd graph fits too (config.keep_graphs): the step then
        keeps the graphs instead of recomputing each block in the backward."""
        cfg = getattr(self.model, "config", None)
        if cfg is None or getattr(cfg, "hidden_size", None) is None:
            return False
        dtype_bytes = self._named[0][1].element_size() if self._named else 4
        est = activation_bytes(cfg, batch, seq, dtype_bytes)
        if est > self._act_budget:
            raise OffloadBudgetError(
                f"a batch of {batch} x {seq} tokens needs about {est / 2**20:.1f} MiB of "
                f"activations; the budget leaves {self._act_budget / 2**20:.1f} MiB after the "
                "engine's buffers. Use a smaller batch or sequence, or a larger budget."
            )
        keep = False
        if training and self.config.keep_graphs:
            kept = est + graph_bytes(cfg, batch, seq, dtype_bytes)
            if kept <= self._act_budget:
                est, keep = kept, True
        self._last_act_est = est
        self.peak_bytes = max(self.peak_bytes, self._owned_bytes + est)
        return keep

    def _check_usable(self) -> None:
        if self._closed:
            raise OffloadError("engine is closed")
        if self._failed is not None:
            raise OffloadError(
                "an earlier step failed part-way, so the training state is inconsistent; "
                "load a checkpoint to continue"
            ) from self._failed

    def _fail(self, exc: BaseException) -> None:
        self._failed = exc
        self._schedule = []
        self._pager.cancel_prefetches()
        if self._dev is not None:
            with contextlib.suppress(Exception):  # a broken CUDA context must not hide exc
                self._dev.reset()  # no copy reads a host page past this point
        for layout in self._layouts:
            layout.unbind()
        for key, page in list(self._pinned.items()):
            self._pager.discard(page)
            del self._pinned[key]
        for _, p in self._named:
            p.grad = None
        self._norms.clear()
        self._has_grad.clear()

    def _map_to_files(self) -> dict[int, list[tuple[int, int, int, int]]]:
        """Blocks whose streamed weights all lie, byte for byte, in the weights files:
        block -> (fd, file offset, page offset, nbytes) extents. Each candidate tensor is
        read once and compared, so a model changed since loading falls back to the swap."""
        src = self._source
        assert src is not None
        out = {}
        for layout in self._layouts:
            extents = []
            for slot in layout.weight_slots:
                e = src.find(slot.name, slot.param)
                if e is None:
                    break
                if id(slot.param) not in self._meta_params:  # a loaded one must match
                    data = torch.empty(e.nbytes, dtype=torch.uint8)
                    if os.preadv(src.fds[e.path], [byte_view(data)], e.offset) != e.nbytes:
                        break
                    mine = slot.param.detach().cpu().contiguous().reshape(-1)
                    if not torch.equal(data, mine.view(torch.uint8)):
                        break
                extents.append((src.fds[e.path], e.offset, slot.offset, slot.nbytes))
            else:
                out[layout.index] = extents
        return out

    def _shutdown_io(self, remove: bool) -> None:
        io = getattr(self, "_io", None)
        if io is not None:
            io.close()
        if self._dev is not None:
            self._dev.close()
        self._store.close(remove=remove)
        if self._source is not None:
            self._source.close()
