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

One step (see _hooks.py for the per-block mechanics, _step.py for the steps):
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
  data parallel  (OffloadConfig.data_parallel) each rank runs its share of the batch;
            a block's gradients are summed over the ranks once final, the resident
            group's after the backward, before any norm or step (_parallel.py).
  pipeline  (OffloadConfig.pipeline_parallel) the model is one stage's blocks; a
            schedule runs every micro-batch's forward, then their backwards, and the
            norm is the whole model's (step_pipelined, _pipeline.py).

Memory: the budget covers the pool of page buffers (allocated once), the resident group
with its gradients and Adam state, one block's gradients, AdamW's scratch tensors and
the step's activations (an estimate from the model config; a batch that would not fit
is refused before it starts; _memory.py). Prefetch and write-behind happen inside the pool; when
the pool can hold every region, nothing is read twice or written before a checkpoint.

CUDA (OffloadConfig.device, default: where the resident parameters are): the resident
group moves to the GPU, blocks compute there from two device copies filled on a copy
stream, and the pool, the block steps and everything on the swap's side stay on the host
as above; the budget is then GPU memory and host_budget_bytes sizes the pool (_device.py).

Where things live: this module is the public API and the start-up (its steps, in order:
partition the model (_partition.py), plan memory (_memory.py), open the swap, pool and
I/O threads with the optimizers into one EngineState (_state.py), move the weights out,
patch the blocks (_hooks.py)). The engine hands that state, never itself, to the parts:
_schedule.py (the pass's page order, where block weights are bound), _step.py (backward,
clipping, AdamW), _checkpoint.py; none of them imports this module.
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
from ._device import open_copies, resolve_device, streams_to_device
from ._hooks import patch_block, unpatch_block
from ._io import BufferPool, IOExecutor, IOStats, OffloadError, SwapStore, probe_o_direct
from ._layout import WEIGHT
from ._malloc import fix_mmap_threshold
from ._memory import MemoryPlan, activation_need, peak_rss_bytes, plan_memory
from ._optim import make_optimizers, norm_order
from ._pager import Pager
from ._parallel import check_same_model, sum_loss, world
from ._partition import (
    FROZEN_BASE,
    Partition,
    find_blocks,
    move_resident,
    outside_blocks,
    partition,
    unmeta_blocks,
)
from ._pipeline import PipelineError, sum_tied
from ._safetensors import SafetensorsSource, map_to_files
from ._schedule import abandon_pass, settle_device, start_schedule, stop_schedule
from ._state import EngineState
from ._step import clip_and_step_blocks, set_lr, step_resident, sum_resident_grads

LossFn = Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]


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
        self.malloc_mmap_threshold: int | None = None  # set by _plan when the engine streams
        self.model = model
        self._failed: BaseException | None = None
        self._closed = False
        self._step_time_s = 0.0
        self._last_act_est: int | None = None
        self.kept_graphs = False  # the last step kept the blocks' graphs (no recompute)

        blocks = list(blocks) if blocks is not None else find_blocks(model)
        unloaded = unmeta_blocks(blocks) if init_weights is not None else set()
        named = list(model.named_parameters())
        if self.config.data_parallel:
            self.rank, self.world_size = world()
            check_same_model(named)
        elif self.config.pipeline_parallel:  # rank: this stage's place in the pipeline
            self.rank, self.world_size = world("pipeline_parallel")
        else:
            self.rank, self.world_size = 0, 1
        self.device = resolve_device(self.config.device, outside_blocks(named, blocks))
        cuda = streams_to_device(self.device)
        part = partition(named, blocks)
        self.mode = part.mode  # frozen base (LoRA): frozen block weights stream read-only
        if cuda:  # the resident group and every buffer live on the GPU
            move_resident(model, part, self.device)

        source, from_files = None, {}
        try:
            if weights_files and self.mode == FROZEN_BASE:
                source = SafetensorsSource([os.fspath(f) for f in weights_files])
                from_files = map_to_files(source, part.layouts, unloaded)
            mem = self._plan(part, from_files, cuda)
        except BaseException:
            if source is not None:
                source.close()
            raise
        st = self._state = self._open(model, blocks, named, part, mem, source, from_files)
        try:
            self._create_weights(from_files, unloaded, init_weights)
        except BaseException:
            st.close(remove=True)
            raise
        if cuda:  # blocks' parameters now read as GPU placeholders, as in plain torch
            st.norm_order = norm_order(part.trainable)
        for i, block in enumerate(blocks):
            patch_block(st, i, block)

    # -- start-up steps ----------------------------------------------------------------------

    def _plan(self, part: Partition, from_files: dict, cuda: bool) -> MemoryPlan:
        """The memory plan (_memory.py), its figures kept for telemetry; when the engine
        streams, glibc's mmap threshold fixed before the pool and the steps allocate."""
        mem = plan_memory(part, self.config, from_files, self.device, cuda)
        self.device_plan = mem.device_plan
        self.resident_bytes = mem.resident_bytes
        self.block_grad_bytes = mem.block_grad_bytes
        self.scratch_bytes = mem.scratch_bytes
        self.streaming = mem.streaming
        self.pool_bytes = mem.n_pages * mem.page_bytes
        self._mem = mem
        self.peak_bytes = mem.owned  # what the budget holds besides activations
        # Memory is what limits this run: make freed tensors go back to the system
        # (_malloc.py). Not when everything fits: the fixed threshold costs speed (fresh
        # pages for every large tensor).
        threshold = self.config.malloc_mmap_threshold
        if mem.streaming and threshold is not None and fix_mmap_threshold(threshold):
            self.malloc_mmap_threshold = threshold
        return mem

    def _open(self, model, blocks, named, part, mem, source, from_files) -> EngineState:
        """The swap files, the page pool, the I/O threads (and on CUDA the device copies),
        the optimizers: the engine's state, before any weight is in the swap."""
        cfg = self.config
        store = io = dev = None
        try:
            auto = cfg.o_direct == "auto"
            self.o_direct = probe_o_direct(cfg.swap_dir) if auto else bool(cfg.o_direct)
            store = SwapStore(cfg.swap_dir, mem.regions, self.o_direct)
            for i, extents in from_files.items():
                store.map_external(i, WEIGHT, extents, "model weights file")
            pool = BufferPool(mem.n_pages, mem.page_bytes)
            staging = None
            if mem.device_plan is not None:  # GPU slots, copy stream; pool and staging pinned
                dev, staging = open_copies(self.device, mem.device_plan, pool, mem.staging_bytes)
            stats = IOStats()
            io = IOExecutor(cfg.io_threads, cfg.chunk_bytes, stats)
            pager = Pager(store, pool, io, mem.reserve, write_behind=mem.streaming)
            dtype = named[0][1].dtype if named else torch.float32
            return EngineState(
                model=model,
                config=cfg,
                optim=self.optim,
                device=self.device,
                mode=part.mode,
                blocks=blocks,
                named=named,
                layouts=part.layouts,
                block_resident=part.block_resident,
                resident_trainable=part.resident_trainable,
                norm_order=norm_order(part.trainable),
                clip=self.optim.max_grad_norm is not None,
                parallel=cfg.data_parallel,
                store=store,
                pool=pool,
                io=io,
                stats=stats,
                pager=pager,
                o_direct=self.o_direct,
                prefetch_pages=cfg.prefetch * mem.reserve,
                source=source,
                dev=dev,
                staging=staging,
                optimizers=make_optimizers(
                    part.layouts, part.resident_trainable, self.optim, dtype
                ),
                anchor=torch.zeros((), requires_grad=True, device=self.device),
            )
        except BaseException:
            if io is not None:
                io.close()
            if dev is not None:
                dev.close()
            if store is not None:
                store.close(remove=True)
            if source is not None:
                source.close()
            raise

    def _create_weights(self, from_files: dict, unloaded: set[int], init_weights) -> None:
        """Move the blocks' weights out to the swap (those read from the model's files
        stay there); create those that hold no values in their pages (init_weights)."""
        st = self._state
        for layout in st.layouts:
            if layout.index in from_files:
                layout.unbind()
                continue
            page = st.pager.get((layout.index, WEIGHT), read=False)
            page.tensor.zero_()
            layout.fill(page.tensor, skip=unloaded)
            for s in layout.weight_slots:
                if id(s.param) in unloaded:
                    init_weights(s.name, s.view(page.tensor))
            layout.unbind()
            st.pager.release(page, dirty=True)
        st.pager.flush()

    # -- public API ------------------------------------------------------------------------

    @property
    def lr(self) -> float:
        return self.optim.lr

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter (for a schedule, before step())."""
        set_lr(self._state, lr)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (restored by load_checkpoint)."""
        return self._state.step_count

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step that clipped."""
        return self._state.last_grad_norm

    def step(
        self,
        batch: dict[str, torch.Tensor],
        *,
        loss_fn: LossFn | None = None,
        micro_batches: int = 1,
    ) -> float:
        """One optimizer step: forward and backward of each micro-batch (gradients add
        up), clipping by global norm if configured, AdamW. Returns the sum of the
        micro-batches' losses (the loss, for one micro-batch).

        loss_fn(model, micro_batch) -> loss tensor; default: the model's own loss from
        `labels`. The batch is split into `micro_batches` slices of ceil(n / micro_batches)
        rows, as worker/training/engines.py's InMemoryEngine splits it.

        With OffloadConfig.data_parallel, `batch` is this rank's share (batch_share) and
        the loss returned is the sum over the ranks (every rank gets the same)."""
        self._check_usable()
        st = self._state
        batch = self._to_device(batch)
        n = int(batch["input_ids"].shape[0])
        size = math.ceil(n / max(1, micro_batches))
        micros = [{k: v[s : s + size] for k, v in batch.items()} for s in range(0, n, size)]
        keep = [
            self._check_activations(int(m["input_ids"].shape[0]), int(m["input_ids"].shape[-1]))
            for m in micros
        ]
        total = 0.0
        with self._optimizer_step(keep_graphs=all(keep)):
            for j, micro in enumerate(micros):
                st.micro, st.final = j, j == len(micros) - 1
                start_schedule(st, training=True)
                if loss_fn is None:
                    out = self.model(**micro, use_cache=False)
                    loss = out.loss if hasattr(out, "loss") else out["loss"]
                else:
                    loss = loss_fn(self.model, micro)
                loss.backward()
                total += loss.item()
            if st.parallel:
                sum_resident_grads(st)
                total = sum_loss(total)
            self._clip_and_step(st)
        return total

    def step_pipelined(self, run: Callable[[], Any], micro_batches: int, rows: int,
                       seq: int) -> Any:
        """One optimizer step of a pipeline stage (OffloadConfig.pipeline_parallel):
        `run()` drives the step's passes through this stage's model (a pipeline schedule's
        step: `micro_batches` forwards of `rows` x `seq` tokens each, then their backwards
        in the same order); then the gradients tied with another stage are summed, clipped
        by the whole model's norm, and AdamW steps. Returns what `run()` returns."""
        self._check_usable()
        if not self.config.pipeline_parallel:
            raise OffloadError("step_pipelined needs OffloadConfig(pipeline_parallel=True)")
        st = self._state
        # Every micro-batch's forward comes before the first backward: the activations (and
        # the graphs, when kept) of all of them at once.
        keep = self._check_activations(rows * micro_batches, seq)
        st.pipe_micros, st.pipe_forwards, st.pipe_backwards = micro_batches, 0, 0
        with self._optimizer_step(keep_graphs=keep, pipelined=True):
            result = run()
            if st.pipe_backwards != micro_batches:
                raise PipelineError(f"the schedule ran {st.pipe_backwards} backward passes "
                                    f"through this stage, not {micro_batches}")
            sum_tied(st)
            self._clip_and_step(st)
        return result

    @contextlib.contextmanager
    def _optimizer_step(self, keep_graphs: bool, pipelined: bool = False):
        """The frame of one optimizer step: the state says a step is on; a failure part-way
        leaves the engine failed (only a checkpoint is good then); the step is counted and
        timed once it is through."""
        st = self._state
        t0 = time.perf_counter()
        st.in_step, st.pipelined = True, pipelined
        st.keep_graphs = self.kept_graphs = keep_graphs
        try:
            yield
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            st.in_step = st.pipelined = st.keep_graphs = False
            st.has_grad.clear()
            st.norms.clear()
        st.step_count += 1
        self._step_time_s += time.perf_counter() - t0

    @staticmethod
    def _clip_and_step(st: EngineState) -> None:
        """After the backward: blocks clipped by the global norm and stepped (when clipping;
        otherwise they were stepped in the backward), then the resident group."""
        if st.clip:
            clip_and_step_blocks(st)
        step_resident(st)

    def tie_across_stages(self, params: Sequence[torch.nn.Parameter], group: Any,
                          counted: bool) -> None:
        """`params` are also held by another stage of the pipeline (tied embeddings): their
        gradients are summed over `group` (the stages holding them) before the norm, which
        counts them on one stage only (`counted`)."""
        st = self._state
        st.tied, st.tied_group = list(params), group
        st.uncounted = set() if counted else {id(p) for p in params}

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor], loss_fn: LossFn | None = None) -> float:
        """Loss of `batch` without training (blocks stream as in the forward): in eval
        mode (no dropout, no draw from the generators)."""
        self._check_usable()
        batch = self._to_device(batch)
        ids = batch["input_ids"]
        self._check_activations(int(ids.shape[0]), int(ids.shape[-1]), training=False)
        start_schedule(self._state, training=False)
        was_training = self.model.training
        self.model.eval()
        try:  # (no gradients: the method runs under torch.no_grad)
            if loss_fn is not None:
                return float(loss_fn(self.model, batch))
            return float(self.model(**batch, use_cache=False).loss)
        finally:
            self.model.train(was_training)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with real values for the streamed parameters (copies, on
        the host; on the CPU path resident tensors are copied where they are).

        Needs memory for the whole model: it is the export path, not a training one."""
        self._check_usable()
        st = self._state
        stop_schedule(st)
        if st.dev is not None:
            settle_device(st)
        values: dict[int, torch.Tensor] = {}
        for layout in st.layouts:
            page = st.pager.get((layout.index, WEIGHT))
            try:
                for s in layout.weight_slots:
                    values[id(s.param)] = s.view(page.tensor).clone()
            finally:
                st.pager.release(page)
        out = {}
        for k, t in self.model.state_dict(keep_vars=True).items():
            if id(t) in values:
                out[k] = values[id(t)]
            else:  # on CUDA, host copies of the resident group too
                out[k] = t.detach().clone() if st.dev is None else t.detach().cpu()
        return out

    @contextlib.contextmanager
    def block_weights(self, i: int):
        """Block i's streamed parameters hold their values (host memory) inside the `with`;
        outside it they are placeholders again. For reading a model larger than memory one
        block at a time (export); nothing written to them is kept."""
        self._check_usable()
        st = self._state
        if st.dev is not None:
            settle_device(st)
        stop_schedule(st)
        layout = st.layouts[i]
        page = st.pager.get((layout.index, WEIGHT))
        try:
            layout.bind(page.tensor)
            yield st.blocks[i]
        finally:
            layout.unbind()
            st.pager.release(page)

    @property
    def blocks(self) -> list[torch.nn.Module]:
        """The transformer blocks the engine streams, in order."""
        return list(self._state.blocks)

    def save_checkpoint(self, directory: str | os.PathLike, extra: dict | None = None) -> None:
        """Swap files + resident state + manifest into `directory`, atomically: a crash or a
        full disk at any point leaves the previous checkpoint there loadable."""
        self._check_usable()
        _checkpoint.save(self._state, os.fspath(directory), extra or {})

    def load_checkpoint(self, directory: str | os.PathLike) -> dict:
        """Restore the state saved by save_checkpoint(), including torch's CPU RNG state;
        returns its `extra` dict. Also recovers an engine whose step failed."""
        if self._closed:
            raise OffloadError("engine is closed")
        extra = _checkpoint.load(self._state, os.fspath(directory))
        self._failed = None
        return extra

    def telemetry(self) -> dict[str, Any]:
        """Counters since start: I/O volume and rates, stalls, prefetch hits, memory."""
        st = self._state
        d: dict[str, Any] = {
            "steps": st.step_count,
            "mode": self.mode,
            "device": str(self.device),
            "streaming": self.streaming,
            "o_direct": self.o_direct,
            "budget_bytes": self.config.budget_bytes,
            "pool_bytes": self.pool_bytes,
            "page_bytes": st.pool.page_bytes,
            "pages": st.pool.n_pages,
            "resident_bytes": self.resident_bytes,
            "block_grad_bytes": self.block_grad_bytes,
            "scratch_bytes": self.scratch_bytes,
            "activation_bytes_est": self._last_act_est,
            "kept_graphs": self.kept_graphs,
            "peak_bytes": self.peak_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            "malloc_mmap_threshold": self.malloc_mmap_threshold,
            "swap_bytes": st.store.nbytes,
            "blocks_read_from_weights_files": len(st.store.external),
            "step_s": self._step_time_s,
            "last_grad_norm": st.last_grad_norm,
            "world_size": self.world_size,
            "reduce_bytes": st.reduced.bytes,  # data parallel: handed to all_reduce
            "reduce_s": st.reduced.seconds,  # and waited in it
            "pipeline_parallel": self.config.pipeline_parallel,
        }
        d.update(st.stats.snapshot())
        d.update(st.pager.snapshot())
        if st.dev is not None:
            d["host_budget_bytes"] = self.device_plan.pool_room + self.device_plan.host_fixed
            d.update(st.dev.snapshot())
        return d

    def close(self, restore_weights: bool = False) -> None:
        """Stop the I/O threads and remove the swap files (unless keep_swap). With
        `restore_weights` the model gets its streamed parameters back in memory."""
        if self._closed:
            return
        st = self._state
        if restore_weights:
            state = self.model_state_dict()
            streamed = {id(s.param) for layout in st.layouts for s in layout.weight_slots}
            for n, p in st.named:
                if id(p) in streamed:
                    p.data = state[n].to(self.device)
        for block in st.blocks:
            unpatch_block(block)
        st.close(remove=not self.config.keep_swap)
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        if self._state.dev is None:
            return batch
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _check_activations(self, batch: int, seq: int, training: bool = True) -> bool:
        """Refuse a batch whose activations do not fit the budget (_memory.py). True when,
        on top of them, every block's autograd graph fits too (config.keep_graphs): the step
        then keeps the graphs instead of recomputing each block in the backward."""
        named = self._state.named
        dtype_bytes = named[0][1].element_size() if named else 4
        keep_graphs = training and self.config.keep_graphs
        need = activation_need(
            self.model, dtype_bytes, self._mem.act_budget, keep_graphs, batch, seq
        )
        if need is None:
            return False
        est, keep = need
        self._last_act_est = est
        self.peak_bytes = max(self.peak_bytes, self._mem.owned + est)
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
        abandon_pass(self._state)
