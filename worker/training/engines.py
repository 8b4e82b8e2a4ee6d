"""How one optimizer step is carried out: where weights, gradients and optimizer states live.

A recipe hands the engine a padded batch and gets the loss back; it knows nothing about where
the training state lives. `InMemoryEngine` keeps all of it in RAM, the plain PyTorch way, and
is the reference. `OffloadTrainEngine` (what jobs use) runs the same arithmetic through the
SSD offload engine (offload/) under a memory budget, and matches it bit for bit.

Both offer: step(batch) -> loss, learning_rate, steps_done, save_checkpoint(dir) /
load_checkpoint(dir) (files in a directory the recipe owns), telemetry(), close().
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from worker.dataset.corpus import IGNORE_INDEX


def lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the positions whose label is not IGNORE_INDEX.

    A sum (not a mean) so micro-batches of an accumulated step add up to exactly the loss of
    the whole batch once divided by its token count.

    Only the positions that predict a label go through the output layer (the model's own
    `logits_to_keep`): a practice question's system prompt and question are most of its
    tokens, and a vocabulary-wide matmul and softmax at each of them computes nothing the
    loss reads (about 15% of a full fine-tuning step on the fixture corpus).
    """
    labels = batch["labels"]
    if not _keeps_logits(model):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return token_loss_sum(logits, labels)
    keep = predicting(labels)
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], logits_to_keep=keep
    ).logits  # (kept positions, vocabulary)
    return kept_loss_sum(logits, labels, keep)


def predicting(labels: torch.Tensor) -> torch.Tensor:
    """keep[r, t]: position t of row r predicts a label (its next token's): the positions
    whose logits the loss reads."""
    return F.pad(labels[:, 1:] != IGNORE_INDEX, (0, 1), value=False)


def kept_loss_sum(logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of the logits at the `keep` positions (kept positions, vocabulary)
    against the labels they predict."""
    return F.cross_entropy(logits.float(), labels[:, 1:][keep[:, :-1]], reduction="sum")


def _keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the model's forward slices its hidden states by a boolean `logits_to_keep`
    mask of (rows, positions). Transformers' causal LMs take `logits_to_keep` (a PEFT wrapper
    passes it on), but only releases whose modeling code slices through
    `slice_logits_to_keep` accept a mask; older ones (5.17, on the GPU machine, raised an
    IndexError after the whole forward) get every position's logits instead."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    helper = getattr(sys.modules.get(type(base).__module__), "slice_logits_to_keep", None)
    return _class_keeps_logits(type(base), helper)


@functools.cache
def _class_keeps_logits(cls: type, helper) -> bool:
    """_keeps_logits for a model class and its module's helper (asked once, not each step)."""
    if "logits_to_keep" not in inspect.signature(cls.forward).parameters:
        return False
    return helper is not None and _slices_by_mask(helper)


def _slices_by_mask(helper) -> bool:
    """The helper keeps the True positions of a (rows, positions) mask."""
    hidden = torch.arange(6.0).reshape(1, 3, 2)
    try:
        kept = helper(hidden, torch.tensor([[False, True, True]]))
    except (IndexError, RuntimeError, TypeError):
        return False
    return kept.shape == (2, 2) and bool((kept == hidden[0, 1:]).all())


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """lm_loss_sum from the logits (the last stage of a pipeline has those, not the model)."""
    shift_logits = logits[:, :-1, :].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def fused_adamw(devices) -> bool | None:
    """torch's fused AdamW for parameters all on the CPU: one kernel a parameter instead of
    ten elementwise passes over it (a full fine-tuning step of the embedded model: about
    0.18 s of optimizer against 0.06 s on 2 cores). None (torch's default) elsewhere. Both
    engines ask this, so they keep computing the same bits."""
    return True if all(torch.device(d).type == "cpu" for d in devices) else None


def warmup_linear_decay(total_steps: int, warmup_steps: int):
    """LR factor: linear warmup, then linear decay; no step runs at LR 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


class InMemoryEngine:
    """Model, AdamW, LR schedule and gradient clipping, all in memory.

    `step(batch)` runs forward, backward, clip, optimizer step and zero-grad for one optimizer
    step; with `grad_accum > 1` the batch is split into that many micro-batches whose gradients
    add up (same result as one big batch, less activation memory).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        total_steps: int,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        grad_accum: int = 1,
    ) -> None:
        self.model = model
        self.grad_clip = grad_clip
        self.grad_accum = max(1, grad_accum)
        # named_parameters() lists a tied weight (embeddings = lm_head) once.
        self.trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.trainable:
            raise ValueError("The model has no trainable parameters.")
        # Norm gains and biases (1-D) are not decayed: shrinking them toward 0 is not a prior.
        decay = [p for p in self.trainable.values() if p.ndim >= 2]
        no_decay = [p for p in self.trainable.values() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        self.optimizer = torch.optim.AdamW(
            groups, lr=learning_rate, betas=(0.9, 0.999), eps=1e-8,
            fused=fused_adamw(p.device for p in self.trainable.values()),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_linear_decay(total_steps, warmup_steps)
        )
        self.device = next(iter(self.trainable.values())).device  # batches go where it is
        self.steps_done = 0
        self.rank, self.world_size = 0, 1  # one process (data parallel: the offload engine)

    @property
    def learning_rate(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on `batch` (input_ids, attention_mask, labels); returns the mean
        token loss of the batch."""
        n_tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        denom = max(1, n_tokens)
        total = 0.0
        n = batch["input_ids"].size(0)
        size = math.ceil(n / self.grad_accum)
        for start in range(0, n, size):
            micro = {k: v[start : start + size].to(self.device) for k, v in batch.items()}
            loss = lm_loss_sum(self.model, micro) / denom
            loss.backward()
            total += loss.item()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(list(self.trainable.values()), self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_done += 1
        return total

    def state_dict(self) -> dict:
        """Everything needed to continue bit-exactly: trainable weights (tensors, by name),
        optimizer and scheduler states, step counter."""
        return {
            "weights": {n: p.detach() for n, p in self.trainable.items()},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "steps_done": self.steps_done,
        }

    def load_state_dict(self, state: dict) -> None:
        weights = state["weights"]
        missing = set(self.trainable) - set(weights)
        unexpected = set(weights) - set(self.trainable)
        if missing or unexpected:
            raise ValueError(
                f"Checkpoint does not fit this model: {len(missing)} weights missing, "
                f"{len(unexpected)} unexpected (e.g. {sorted(missing or unexpected)[:2]})."
            )
        with torch.no_grad():
            for name, param in self.trainable.items():
                param.copy_(weights[name])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps_done = int(state["steps_done"])

    # -- the checkpoint calls the recipe makes (files in a directory it owns) ---------------
    def save_checkpoint(self, directory: Path) -> None:
        """Trainable weights (weights.safetensors) and optimizer/scheduler/step (state.pt)."""
        state = self.state_dict()
        weights = {n: t.contiguous() for n, t in state.pop("weights").items()}
        save_file(weights, Path(directory) / "weights.safetensors")
        torch.save(state, Path(directory) / "state.pt")

    def load_checkpoint(self, directory: Path) -> None:
        state = torch.load(Path(directory) / "state.pt", weights_only=True)
        state["weights"] = load_file(Path(directory) / "weights.safetensors")
        self.load_state_dict(state)

    def telemetry(self) -> dict | None:
        """Nothing pages: no memory or disk figures to report."""
        return None

    def close(self, restore_weights: bool = True) -> None:
        """Free the gradients and optimizer state; the model keeps its weights."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer.state.clear()

# The engine's figures a job row keeps (the page shows a few, /api/jobs/{id} all of them).
TELEMETRY_KEYS = (
    "mode", "streaming", "o_direct", "budget_bytes", "pool_bytes", "peak_bytes",
    "peak_rss_bytes", "swap_bytes", "blocks_read_from_weights_files", "step_s",
    "bytes_read", "bytes_written", "read_gbps", "write_gbps", "stall_s",
    "prefetch_hits", "prefetch_misses", "prefetch_hit_rate",
    "world_size", "reduce_bytes", "reduce_s", "pipeline_parallel",
)  # fmt: skip


class OffloadTrainEngine:
    """InMemoryEngine's contract and arithmetic, run by `offload.OffloadEngine`.

    The transformer blocks page between a memory budget and files in `swap_dir`; what does
    not fit streams from the SSD (LoRA: the frozen base weights are read straight from the
    model's `weights_files`, nothing is written). Same AdamW, same parameter groups (1-D
    parameters not decayed), same clipping, same summed loss over the batch's label tokens
    and the same LR schedule as InMemoryEngine: the losses and weights are bitwise equal.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        learning_rate: float,
        total_steps: int,
        budget_bytes: int,
        swap_dir: str | os.PathLike,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        grad_clip: float | None = 1.0,
        grad_accum: int = 1,
        weights_files: list[str | os.PathLike] | None = None,
        prefetch: int = 2,
        activation_bytes: int | None = None,
        init_weights=None,
        device: str | None = None,
        host_budget_bytes: int | None = None,
        data_parallel: bool = False,
        pipeline_parallel: bool = False,
        blocks: list[torch.nn.Module] | None = None,
    ) -> None:
        from offload import AdamWConfig, OffloadConfig, OffloadEngine, find_blocks

        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError("The model has no trainable parameters.")
        self.model = model
        self.grad_accum = max(1, grad_accum)
        self.base_lr = learning_rate
        self._factor = warmup_linear_decay(total_steps, warmup_steps)
        self.steps_done = 0
        blocks = blocks if blocks is not None else find_blocks(model)
        self.n_blocks = len(blocks)
        optim = AdamWConfig(
            lr=learning_rate * self._factor(0),
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=weight_decay,
            max_grad_norm=grad_clip or None,  # InMemoryEngine clips only when grad_clip is set
            no_decay_1d=True,
            # The offload engine steps each block's AdamW where its pages are: on the CPU
            # unless blocks compute on a GPU.
            fused=fused_adamw(
                [device or "cpu"] + [p.device for p in model.parameters() if not p.is_meta]
            ),
        )
        config = OffloadConfig(
            budget_bytes=int(budget_bytes),
            swap_dir=os.fspath(swap_dir),
            prefetch=prefetch,
            activation_bytes=activation_bytes,
            # CUDA: blocks compute on the GPU (budget: GPU memory), the page pool is pinned
            # host memory of host_budget_bytes.
            device=device,
            host_budget_bytes=host_budget_bytes,
            data_parallel=data_parallel,
            pipeline_parallel=pipeline_parallel,
        )
        files = [os.fspath(f) for f in weights_files or []]
        # init_weights: fills the pages of block parameters that hold no values (a model
        # larger than memory, worker/training/streamed.py) from the model's files.
        self.engine = OffloadEngine(
            model, optim, config, blocks=blocks, weights_files=files or None,
            init_weights=init_weights,
        )
        # Data parallel (worker/distributed/): this process is rank `rank` of `world_size`.
        self.rank, self.world_size = self.engine.rank, self.engine.world_size

    @property
    def learning_rate(self) -> float:
        """The LR of the next step (as InMemoryEngine's scheduler leaves it)."""
        return self.base_lr * self._factor(self.steps_done)

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on `batch`; returns the mean token loss of the batch.

        Data parallel: every rank is handed the whole batch and runs its share of the rows
        (offload.batch_share), in grad_accum / world_size micro-batches; the loss is still
        divided by the whole batch's token count, so the summed gradients are one
        process's."""
        denom = max(1, int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
        micro_batches = self.grad_accum
        if self.world_size > 1:
            from offload import batch_share

            batch = batch_share(batch, self.rank, self.world_size, IGNORE_INDEX)
            micro_batches = max(1, self.grad_accum // self.world_size)
        self.engine.set_lr(self.learning_rate)
        loss = self.engine.step(
            batch,
            loss_fn=lambda model, micro: lm_loss_sum(model, micro) / denom,
            micro_batches=micro_batches,
        )
        self.steps_done += 1
        return loss

    def save_checkpoint(self, directory: Path) -> None:
        """The engine's checkpoint (manifest.json and its .bin files: the swap files for full
        fine-tuning, the resident parameters with their Adam state, the torch RNG)."""
        self.engine.save_checkpoint(directory, extra={"steps_done": self.steps_done})

    def load_checkpoint(self, directory: Path) -> None:
        extra = self.engine.load_checkpoint(directory)
        self.steps_done = int(extra["steps_done"])

    def telemetry(self) -> dict:
        """The engine's counters since it started, JSON-safe, plus the block count."""
        t = self.engine.telemetry()
        out = {k: t.get(k) for k in TELEMETRY_KEYS}
        out["blocks"] = self.n_blocks
        return out

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's real weights (copies), streamed blocks included: for export."""
        return self.engine.model_state_dict()

    def close(self, restore_weights: bool = True) -> None:
        """Stop the engine and remove its swap files; with `restore_weights` the model holds
        its trained weights in memory again (for scoring and export)."""
        from offload import OffloadError

        try:
            self.engine.close(restore_weights=restore_weights)
        except OffloadError:  # a failed step: the weights are only good in the checkpoint
            self.engine.close()
