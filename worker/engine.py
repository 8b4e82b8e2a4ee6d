"""How one optimizer step is carried out: the seam the SSD offload engine will plug into.

A recipe hands the engine a padded batch and gets the loss back; it knows nothing about where
weights, gradients and optimizer states live. `InMemoryEngine` keeps all of them in RAM, the
plain PyTorch way, and is the reference the offload engine must match bit for bit.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # label value that carries no loss (prompt tokens, padding)


def configure_threads() -> int:
    """Use every core this process may run on for intra-op work, unless the user set
    OMP_NUM_THREADS. Returns the thread count in effect.

    On a 2-core box torch already picks 2; in containers and Celery children the default
    can be the host's core count, which oversubscribes and crawls.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        if torch.get_num_threads() != cores:
            torch.set_num_threads(max(1, cores))
    return torch.get_num_threads()


def lm_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross-entropy over the positions whose label is not IGNORE_INDEX.

    A sum (not a mean) so micro-batches of an accumulated step add up to exactly the loss of
    the whole batch once divided by its token count.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift_logits = logits[:, :-1, :].float()
    shift_labels = batch["labels"][:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)),
        shift_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


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
        self.optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.999), eps=1e-8)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_linear_decay(total_steps, warmup_steps)
        )
        self.steps_done = 0

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
            micro = {k: v[start : start + size] for k, v in batch.items()}
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
