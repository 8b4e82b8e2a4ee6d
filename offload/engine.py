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
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Self

import torch

from . import _checkpoint
from ._config import AdamWConfig, OffloadConfig
from ._hooks import patch_block, unpatch_block
from ._io import (
    BufferPool,
    IOExecutor,
    IOStats,
    OffloadError,
    SwapStore,
    byte_view,
    probe_o_direct,
)
from ._layout import EXP_AVG, EXP_AVG_SQ, GRAD, WEIGHT, BlockLayout
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


def _unmeta_blocks(blocks: Sequence[torch.nn.Module]) -> set[int]:
    """Replace the blocks' meta-device parameters by CPU ones of the same shape, dtype and
    requires_grad that hold no memory (a broadcast NaN, like an unbound parameter), so the
    engine can page them; returns the ids of the new parameters."""
    out: set[int] = set()
    for block in blocks:
        for mod in block.modules():
            for name, p in list(mod._parameters.items()):
                if p is None or p.device.type != "meta":
                    continue
                fill = float("nan") if p.dtype.is_floating_point else 0
                data = torch.full((1,), fill, dtype=p.dtype).expand(p.shape)
                new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
                mod._parameters[name] = new
                out.add(id(new))
    return out


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

        `init_weights(name, tensor)`: block parameters on the meta device (a model built
        under `torch.device("meta")`, too large to exist in memory) are created in their
        swap page instead, one block at a time: the engine hands each one's page view to
        init_weights, which fills it in place. Everything outside the blocks must be real."""
        if config is None:
            raise ValueError("an OffloadConfig (budget_bytes, swap_dir) is required")
        self.config = (
            config if isinstance(config, OffloadConfig) else OffloadConfig.from_dict(dict(config))
        )
        self.optim = AdamWConfig.coerce(optimizer_config)
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
        if any(p.device.type != "cpu" for _, p in named):
            raise NotImplementedError("this version of the engine trains on the CPU only")
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
        affordable = avail // page_bytes if page_bytes else 0
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
            self._stats = IOStats()
            self._io = IOExecutor(self.config.io_threads, self.config.chunk_bytes, self._stats)
            self._pager = Pager(
                self._store, self._pool, self._io, self._reserve, write_behind=self.streaming
            )
            self.pool_bytes = self._pool.nbytes
            self._owned_bytes = self.pool_bytes + fixed
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

        self._anchor = torch.zeros((), requires_grad=True)  # puts every block in the graph
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
        rows, as worker/engine.py's InMemoryEngine splits it."""
        self._check_usable()
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
        ids = batch["input_ids"]
        self._check_activations(int(ids.shape[0]), int(ids.shape[-1]), training=False)
        self._start_schedule(training=False)
        if loss_fn is not None:
            return float(loss_fn(self.model, batch))
        return float(self.model(**batch, use_cache=False).loss)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with real values for the streamed parameters (copies).

        Needs memory for the whole model: it is the export path, not a training one."""
        self._check_usable()
        self._schedule = []
        self._pager.cancel_prefetches()
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
            out[k] = values[id(t)] if id(t) in values else t.detach().clone()
        return out

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
            "swap_bytes": self._store.nbytes,
            "blocks_read_from_weights_files": len(self._store.external),
            "step_s": self._step_time_s,
            "last_grad_norm": self.last_grad_norm,
        }
        d.update(self._stats.snapshot())
        d.update(self._pager.snapshot())
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
                    p.data = state[n]
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
        page = self._demand((i, WEIGHT))
        self._layouts[i].bind(page.tensor)
        self._pinned[(i, WEIGHT)] = page

    def _forward_exit(self, i: int) -> None:
        self._layouts[i].unbind()
        self._pager.release(self._pinned.pop((i, WEIGHT)))
        if i == len(self._layouts) - 1 and not self._in_step:
            self._schedule = []

    def _page_refs(self, i: int):
        """saved_tensors_hooks for block i's kept graph: a saved tensor inside the pool
        (block i's weights, bound in its page) is stored as its place in that page and
        rebuilt from whichever page holds block i's weights when the backward runs."""
        pool = self._pool.storage.untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.device.type != "cpu" or t.untyped_storage().data_ptr() != pool:
                return t
            page = self._pinned[(i, WEIGHT)].tensor
            off = t.data_ptr() - page.data_ptr()
            if not 0 <= off < page.numel():
                raise OffloadError(f"block {i} saved a tensor of another block's page")
            return (_PAGE_REF, off // t.element_size(), tuple(t.shape), t.stride(), t.dtype)

        def unpack(v):
            if not (isinstance(v, tuple) and v and v[0] is _PAGE_REF):
                return v
            _, off, shape, stride, dtype = v
            flat = self._pinned[(i, WEIGHT)].tensor.view(dtype)
            return flat.as_strided(shape, stride, flat.storage_offset() + off)

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _backward_block(self, i, fn, hidden, args, kwargs, rng, grad_out, need_x, graph=None):
        """Block i's gradients: from its kept graph (x, out), or by recomputing it."""
        layout = self._layouts[i]
        w = self._demand((i, WEIGHT))
        layout.bind(w.tensor)
        self._pinned[(i, WEIGHT)] = w
        streamed = layout.trainable
        resident = self._block_resident[i]
        if graph is not None:
            x, out = graph
            del graph
        else:
            x = hidden.detach().requires_grad_(need_x)
            with torch.enable_grad(), torch.random.fork_rng(devices=[]):
                torch.set_rng_state(rng)
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
        if streamed:
            self._block_grads_ready(i, block_grads)
        else:
            layout.unbind()
            self._pager.release(self._pinned.pop((i, WEIGHT)))
        return grad_x

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
                data = torch.empty(e.nbytes, dtype=torch.uint8)
                if os.preadv(src.fds[e.path], [byte_view(data)], e.offset) != e.nbytes:
                    break
                mine = slot.param.detach().contiguous().reshape(-1).view(torch.uint8)
                if not torch.equal(data, mine):
                    break
                extents.append((src.fds[e.path], e.offset, slot.offset, slot.nbytes))
            else:
                out[layout.index] = extents
        return out

    def _shutdown_io(self, remove: bool) -> None:
        io = getattr(self, "_io", None)
        if io is not None:
            io.close()
        self._store.close(remove=remove)
        if self._source is not None:
            self._source.close()
