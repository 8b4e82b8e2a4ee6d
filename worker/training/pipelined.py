"""Pipeline-parallel training: the model cut into stages, one per rank, each stage's blocks
paged through its own offload engine; torch.distributed.pipelining's GPipe schedule moves
the micro-batches' hidden states forward and their gradients back between the ranks.

For a model whose training state does not fit one machine's memory (each stage pages only
its own blocks, where data parallel has every rank page the whole model), or to add a
second machine's compute to one job when data parallel would send too much (a full
fine-tune's gradients are the model's size on every step; a stage boundary sends one hidden
state per token).

- `cut_stage`: stage s of n keeps a contiguous range of a Llama-shaped causal LM's blocks
  (or a peft model's around one), the ranges cut so that the stages' work is even
  (`stage_range`: the output layer counts as the blocks it equals in parameters); the first
  stage also holds the embeddings, the last the final norm and the output layer. Tied input and output embeddings are then held by the first and the
  last stage; their gradients are summed between the two before the step (offload's
  tie_across_stages), so both copies stay equal.
- `PipelineTrainEngine`: OffloadTrainEngine's contract (step, checkpoints, telemetry) for one
  stage. Every rank is handed the whole batch (the first stage feeds its token ids, the
  last computes the loss from its labels, every stage uses its attention mask), cut into
  `grad_accum` micro-batches (at least two, or the stages would wait for each other all
  the time). Pipelining wants static shapes: a stage and its schedule are built per
  (micro-batch rows, sequence length) and kept (STAGE_CACHE of them).

The result equals one process's with the same micro-batches: bitwise for LoRA and for full
fine-tuning without tied embeddings; with tied embeddings the two halves of that weight's
gradient are added in another order (tests/worker/distributed/test_pipeline_training.py).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from worker.dataset.corpus import IGNORE_INDEX
from worker.training.engines import OffloadTrainEngine, kept_loss_sum, predicting

STAGE_CACHE = 8  # schedules kept for distinct batch shapes
MIN_MICRO_BATCHES = 2


class StageModule(torch.nn.Module):
    """One stage of a cut causal LM: token ids (first stage) or hidden states in, hidden
    states out (on the last stage after the final norm: the output layer runs in the loss,
    at the positions that predict a label only, as lm_loss_sum runs it in one process). It
    runs the model's own code (rotary embeddings, causal mask from the attention mask) over
    its blocks, so what it computes is what the whole model computes there."""

    def __init__(self, lm: torch.nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.lm, self.first, self.last = lm, first, last
        # The model's shape with the stage's blocks: what the engine sizes activations by.
        self.config = copy.copy(lm.config)
        self.config.num_hidden_layers = len(lm.model.layers)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        return self.lm.model(**given, attention_mask=attention_mask,
                             use_cache=False).last_hidden_state


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside `model` (a peft model wraps one)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def stage_range(n_blocks: int, stage: int, stages: int, head_blocks: float = 0.0
                ) -> tuple[int, int]:
    """Blocks [lo, hi) of `stage`: the stages' work made even, the last stage's output layer
    counted as `head_blocks` blocks' worth (a 49k-word vocabulary's layer is as much
    arithmetic as eight of SmolLM2-135M's blocks); every stage gets a block at least."""
    if not 1 < stages <= n_blocks:
        raise ValueError(f"{n_blocks} blocks do not make {stages} pipeline stages")
    share = (n_blocks + head_blocks) / stages

    def end(s: int) -> int:  # where stage s's blocks end
        if s == stages - 1:
            return n_blocks
        return min(max(round(share * (s + 1)), s + 1), n_blocks - (stages - 1 - s))

    return (end(stage - 1) if stage else 0), end(stage)


def cut_stage(model: torch.nn.Module, stage: int, stages: int
              ) -> tuple[StageModule, dict[str, str], bool]:
    """Cut `model` in place to stage `stage` of `stages` (see the module's docstring).
    Returns the stage module, the whole model's name of each stage parameter, and whether
    the input and output embeddings are one (tied) trainable weight."""
    lm = causal_lm(model)
    inner = lm.model
    whole = {id(p): n for n, p in model.named_parameters()}
    block = sum(p.numel() for p in inner.layers[0].parameters())
    lo, hi = stage_range(len(inner.layers), stage, stages, lm.lm_head.weight.numel() / block)
    first, last = stage == 0, stage == stages - 1
    tied = lm.lm_head.weight is inner.embed_tokens.weight and lm.lm_head.weight.requires_grad
    inner.layers = torch.nn.ModuleList(list(inner.layers)[lo:hi])
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = torch.nn.Identity()
        lm.lm_head = None
    module = StageModule(lm, first, last)
    names = {n: whole[id(p)] for n, p in module.named_parameters()}
    return module, names, tied


class PipelineTrainEngine(OffloadTrainEngine):
    """This rank's stage of `model`, trained through the offload engine (see the module's
    docstring). torch.distributed's default group is the pipeline: rank r is stage r."""

    def __init__(self, model: torch.nn.Module, **options) -> None:
        self.stage, self.stages = dist.get_rank(), dist.get_world_size()
        module, self.names, tied = cut_stage(model, self.stage, self.stages)
        self.first, self.last = module.first, module.last
        super().__init__(module, pipeline_parallel=True, blocks=list(module.lm.model.layers),
                         **options)
        group = None
        if tied:  # the first stage's embeddings are the last one's output layer
            ends = [0, self.stages - 1]
            group = dist.new_group(ends) if self.stages > 2 else None
            if self.stage in ends:
                weight = (module.lm.model.embed_tokens.weight if self.first
                          else module.lm.lm_head.weight)
                self.engine.tie_across_stages([weight], group, counted=self.first)
        self.module = module
        self._schedules: OrderedDict[tuple[int, int, bool], ScheduleGPipe] = OrderedDict()
        self._denom = 1
        self._micro = self._last_rows = self._losses_done = 0  # the step's micro-batches

    def _loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's summed token loss over the whole batch's token count (as
        OffloadTrainEngine.step divides it). The output layer (a 49k-word vocabulary) runs
        only at the positions that predict a label."""
        i, self._losses_done = self._losses_done, self._losses_done + 1
        if i == self._micro - 1:  # the last micro-batch: its real rows only (as one process)
            hidden, labels = hidden[: self._last_rows], labels[: self._last_rows]
        keep = predicting(labels)
        logits = self.module.lm.lm_head(hidden[keep])
        return kept_loss_sum(logits, labels, keep) / self._denom

    def _schedule(self, rows: int, seq: int, micro: int, train: bool = True) -> ScheduleGPipe:
        key = (rows, seq, train)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        config = self.module.lm.config
        # What crosses the stage boundary carries gradients back (requires_grad: part of
        # the static shapes a stage is told).
        hidden = torch.empty(rows, seq, config.hidden_size, device="meta", requires_grad=True)
        inputs = torch.empty(rows, seq, dtype=torch.long, device="meta") if self.first else hidden
        outputs = hidden  # the last stage's too: its output layer runs in the loss
        stage = PipelineStage(self.module, self.stage, self.stages, torch.device("cpu"),
                              input_args=(inputs,), output_args=(outputs,))
        schedule = ScheduleGPipe(stage, micro,
                                 # every stage's (only the last calls it): a schedule
                                 # without one runs no backward
                                 loss_fn=self._loss if train else None,
                                 scale_grads=False)
        self._schedules[key] = schedule
        while len(self._schedules) > STAGE_CACHE:
            self._schedules.popitem(last=False)
        return schedule

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One optimizer step on `batch` (every rank gets the whole batch); returns the
        mean token loss of the batch, on every rank."""
        self._denom = max(1, int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
        batch, micro = self._equal_micro_batches(batch)
        ids = batch["input_ids"]
        n, seq = int(ids.shape[0]), int(ids.shape[1])
        schedule = self._schedule(n // micro, seq, micro)
        losses: list[torch.Tensor] = []

        def run() -> None:
            args = (ids,) if self.first else ()
            extra = {"target": batch["labels"], "losses": losses} if self.last else {}
            schedule.step(*args, attention_mask=batch["attention_mask"], **extra)

        self.engine.set_lr(self.learning_rate)
        self.engine.step_pipelined(run, micro, n // micro, seq)
        total = torch.tensor([sum(float(x) for x in losses)], dtype=torch.float64)
        dist.broadcast(total, src=self.stages - 1)  # the last stage has the loss
        self.steps_done += 1
        return float(total.item())

    def _micro_batches(self, rows: int) -> int:
        """grad_accum, at least MIN_MICRO_BATCHES, at most one per row."""
        return max(1, min(rows, max(MIN_MICRO_BATCHES, self.grad_accum)))

    def _equal_micro_batches(self, batch: dict[str, torch.Tensor]
                             ) -> tuple[dict[str, torch.Tensor], int]:
        """The batch cut as OffloadTrainEngine cuts it (micro-batches of ceil(n / k) rows),
        the last one topped up to the others' size (the schedule's static shapes) with rows
        whose labels are all ignored: they add nothing to the loss or the gradients."""
        n = int(batch["input_ids"].shape[0])
        size = -(-n // self._micro_batches(n))
        micro = -(-n // size)
        missing = micro * size - n
        self._micro, self._last_rows, self._losses_done = micro, size - missing, 0
        if not missing:
            return batch, micro
        filler = {k: v[-1:].expand(missing, *v.shape[1:]) for k, v in batch.items()}
        filler["labels"] = torch.full_like(filler["labels"], IGNORE_INDEX)
        return {k: torch.cat([v, filler[k]]) for k, v in batch.items()}, micro

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The model's logits for `batch`, forward only through the stages: on the last
        stage (None on the others)."""
        rows = int(batch["input_ids"].shape[0])
        batch, micro = self._equal_micro_batches(batch)
        ids = batch["input_ids"]
        n, seq = int(ids.shape[0]), int(ids.shape[1])
        schedule = self._schedule(n // micro, seq, micro, train=False)
        args = (ids,) if self.first else ()
        out = schedule.eval(*args, attention_mask=batch["attention_mask"])
        return self.module.lm.lm_head(out[:rows]) if self.last else None

    def save_checkpoint(self, directory: Path) -> None:
        """This stage's engine checkpoint in directory/stage<r> (every stage writes its own)."""
        part = Path(directory) / f"stage{self.stage}"
        part.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(part, extra={"steps_done": self.steps_done,
                                                 "stages": self.stages})

    def load_checkpoint(self, directory: Path) -> None:
        extra = self.engine.load_checkpoint(Path(directory) / f"stage{self.stage}")
        if int(extra.get("stages", 0)) != self.stages:
            raise ValueError(f"the checkpoint was made by {extra.get('stages')} stages, "
                             f"not {self.stages}")
        self.steps_done = int(extra["steps_done"])

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's weights under the whole model's names."""
        return {self.names.get(k, k): v for k, v in super().model_state_dict().items()}

    def trained_weights(self) -> dict[str, torch.Tensor] | None:
        """The trainable weights of every stage, under the whole model's names, gathered on
        rank 0 (None on the others): what the job keeps (an adapter, or a full model)."""
        state = self.model_state_dict()
        mine = {self.names[n]: state[self.names[n]]
                for n, p in self.module.named_parameters() if p.requires_grad}
        gathered: list = [None] * self.stages
        dist.gather_object(mine, gathered if self.stage == 0 else None, dst=0)
        if self.stage != 0:
            return None
        out: dict[str, torch.Tensor] = {}
        for part in gathered:
            for k, v in part.items():
                out.setdefault(k, v)  # a tied weight: the first stage's (both are equal)
        return out

