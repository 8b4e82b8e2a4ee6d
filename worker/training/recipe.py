"""The fine-tuning recipe: LoRA or full fine-tuning of a causal LM on prepared examples.

One readable run, torchtune style: `setup()` wraps the model and builds the engine (resuming
from `workdir/checkpoint/` when one is there), `train()` loops over deterministic batches and
hands the trained model back in memory, `save_checkpoint()` writes the run's state atomically,
`cleanup()` frees it.

The engine is the SSD offload engine (worker.training.engines.OffloadTrainEngine) unless
`EngineOptions(kind="memory")` asks for the plain in-memory reference; both give the same bits.

Determinism: batches are a permutation seeded by seed + epoch, the LoRA init by seed, and a
checkpoint holds weights, optimizer, scheduler and RNG states, so a run killed after a
checkpoint and resumed ends with the same weights, bit for bit, as one never interrupted.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from app.contract.training import (
    CHECKPOINT_EVERY,
    LIMITS,
    LORA_MODULES,
    METHODS,
    checkpoints_after,
    is_checkpoint_step,
)
from worker.errors import UserFacingError
from worker.files import fsync_dir, fsync_file
from worker.training.batches import (
    epoch_order,
    examples_digest,
    pad_batch,
    predicting_count,
    step_members,
)
from worker.training.engines import InMemoryEngine, OffloadTrainEngine
from worker.training.flops import head_flops, matmul_flops, step_flops
from worker.training.noise import noisy_embeddings
from worker.training.resources import auto_budget_bytes, configure_threads

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 2  # 2: the engine writes its own files; meta.json names the engine
TRAINED = "trained.safetensors"  # a pipeline-parallel run's trained weights, after its last step
ENGINES = ("offload", "memory")


class Cancelled(Exception):
    """The user cancelled the job; the run's state is in its last checkpoint."""


def _noop(*_args, **_kwargs) -> None:
    return None


@dataclass
class Hooks:
    """How a run reports to whoever drives it (Celery task, CLI, test)."""

    # (state, text): state in {"running", "evaluating"}; text says what is happening.
    on_phase: Callable[[str, str], None] = _noop
    # {"step", "total_steps", "loss", "tokens_per_s", "eta_s", "epoch", "epochs", "lr",
    #  "telemetry"}: telemetry is the offload engine's figures (None in memory).
    on_progress: Callable[[dict], None] = _noop
    should_cancel: Callable[[], bool] = lambda: False
    # The settings the job's dataset decided (app.contract.training.settle): {name: value}.
    on_settings: Callable[[dict], None] = _noop


@dataclass
class EngineOptions:
    """Where the training state lives. Not part of TrainConfig: it changes the speed and the
    memory used, never the result."""

    kind: str = "offload"  # "offload" (SSD offload engine) | "memory" (the reference)
    budget_bytes: int | None = None  # None: a share of the free memory (auto_budget_bytes)
    swap_dir: Path | None = None  # None: workdir / "swap"
    # The base model's *.safetensors: LoRA streams its frozen weights from them, read-only.
    weights_files: list[Path] = field(default_factory=list)
    prefetch: int = 2
    activation_bytes: int | None = None  # None: the engine keeps a quarter of the budget
    # A model whose blocks hold no values yet (worker/training/streamed.py): fills a block parameter's
    # page in the engine, init_weights(name, tensor), from the model's files.
    init_weights: Callable[[str, torch.Tensor], None] | None = None
    # "cuda": blocks compute on the GPU, budget_bytes is GPU memory and host_budget_bytes
    # (None: half of the free RAM) holds the engine's page pool. None: where the model is.
    device: str | None = None
    host_budget_bytes: int | None = None
    # One rank of a data-parallel run (worker/distributed/): torch.distributed is set up,
    # every rank trains its share of each batch, rank 0 alone writes the checkpoints.
    data_parallel: bool = False
    # One stage of a pipeline-parallel run (worker/training/pipelined.py): rank r trains its
    # range of the blocks; every stage writes its part of each checkpoint.
    pipeline_parallel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ValueError(f"Unknown engine {self.kind!r}; use one of {ENGINES}.")
        if (self.data_parallel or self.pipeline_parallel) and self.kind != "offload":
            raise ValueError("Data and pipeline parallel run through the offload engine only.")
        if self.data_parallel and self.pipeline_parallel:
            raise ValueError("A run is data parallel or pipeline parallel, not both.")


@dataclass
class TrainConfig:
    """How to run one fine-tune. Round-trips through a plain dict (stored with the job)."""

    method: str = "lora"  # "lora" | "full"
    epochs: int = 3
    learning_rate: float = 2e-4
    lora_rank: int = 16
    lora_alpha: float | None = None  # None -> 2 * rank
    lora_dropout: float = 0.0  # 0: no RNG in the forward pass, runs repeat exactly
    lora_modules: str = "all"  # which projections LoRA adapts: a key of LORA_MODULES
    # NEFTune's noise on the input embeddings while training (worker.training.noise): 0, none
    neftune_alpha: float = 0.0
    max_seq_len: int = 256
    # Examples per micro-batch. On a CPU tokens/s barely depends on it (matmuls are already
    # large at 256 tokens); smaller batches give small corpora more optimizer steps.
    batch_size: int = 4
    grad_accum: int = 1  # micro-batches per optimizer step
    # Batch examples of similar length (within windows of 16 batches of the shuffled order,
    # then the batches shuffled): a batch is padded to its longest example, so mixing short
    # practice questions with full text chunks computes mostly padding.
    group_by_length: bool = True
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_every: int = CHECKPOINT_EVERY  # optimizer steps; also at every epoch end
    max_steps: int | None = None  # cap on optimizer steps (tests, quick trials)

    def __post_init__(self) -> None:
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        self.validate()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise UserFacingError(f"Unknown training method {self.method!r}; use one of {METHODS}.")
        for name, (lo, hi) in LIMITS.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise UserFacingError(f"{name} = {value} is outside the allowed range {lo}..{hi}.")
        for name in ("batch_size", "grad_accum", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise UserFacingError(f"{name} must be at least 1.")
        if not isinstance(self.lora_modules, str) or self.lora_modules not in LORA_MODULES:
            raise UserFacingError(
                f"lora_modules must be one of {', '.join(LORA_MODULES)}, not {self.lora_modules!r}."
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise UserFacingError("max_steps must be at least 1.")
        if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.lora_dropout < 1.0:
            raise UserFacingError("warmup_ratio and lora_dropout must be in [0, 1).")
        if not 0.0 <= self.neftune_alpha <= 50.0:
            raise UserFacingError("neftune_alpha must be in [0, 50].")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"Unknown training settings: {sorted(unknown)}")
        return cls(**data)

    def steps_per_epoch(self, n_examples: int) -> int:
        return math.ceil(n_examples / (self.batch_size * self.grad_accum))

    def total_steps(self, n_examples: int) -> int:
        total = self.epochs * self.steps_per_epoch(n_examples)
        return min(total, self.max_steps) if self.max_steps else total


@dataclass
class _Progress:
    """Counters that survive a resume (stored in the checkpoint's meta.json)."""

    step: int = 0
    train_seconds: float = 0.0
    tokens: int = 0  # non-padding tokens seen
    losses: list[float] = field(default_factory=list)  # one per optimizer step


# Weights a run starts from instead of the method's fresh ones (a previous version's
# adapter, worker.training.continued.adapter_start): called by setup() with the model wrapped
# for its method, before the engine takes its parameters over; loads them into it and
# returns how many tensors it loaded. A checkpoint, loaded after it, still wins.
StartWeights = Callable[[torch.nn.Module], int]


def _matmul_flops(model: torch.nn.Module, method: str) -> tuple[tuple[float, float], float]:
    """((linear, attention) FLOPs per token, the output layer's share of linear)
    (worker.training.flops); padded tokens alone for a model whose shape it cannot read (the
    dataset plan's tests lay out batches with a stand-in model)."""
    try:
        return matmul_flops(model, method), head_flops(model, method)
    except (AttributeError, TypeError):
        return (1.0, 0.0), 0.0


class FineTuneRecipe:
    """LoRA (peft) or full fine-tuning of `model` on `train_examples`, checkpointed in `workdir`.

    After `setup()`, `self.model` is the model being trained (a PeftModel for LoRA), and
    `loaded_tensors` says how many tensors `start_weights` loaded into it (0: none).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        train_examples: list[dict],
        config: TrainConfig,
        workdir: Path,
        hooks: Hooks | None = None,
        pad_token_id: int = 0,
        engine: EngineOptions | None = None,
        start_weights: StartWeights | None = None,
    ) -> None:
        if not train_examples:
            raise ValueError("No training examples.")
        self.model = model
        self.examples = train_examples
        self.config = config
        self.workdir = Path(workdir)
        self.hooks = hooks or Hooks()
        self.pad_token_id = pad_token_id
        self.engine_options = engine or EngineOptions()
        self.engine: InMemoryEngine | OffloadTrainEngine | None = None
        self.start_weights = start_weights
        self.loaded_tensors = 0
        self.progress = _Progress()
        self.steps_per_epoch = config.steps_per_epoch(len(train_examples))
        self.total_steps = config.total_steps(len(train_examples))
        # Before an engine takes the model over.
        self._flops, self._head_flops = _matmul_flops(model, config.method)
        self._digest = examples_digest(train_examples)
        self._last_saved_step = -1
        self._checkpoint_s = 0.0  # how long the last checkpoint took to write (for the ETA)
        self._perm_cache: tuple[int, list[int]] | None = None

    # -- paths -------------------------------------------------------------------------------
    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoint"

    @property
    def _tmp_dir(self) -> Path:
        return self.workdir / "checkpoint.tmp"

    @property
    def _old_dir(self) -> Path:
        return self.workdir / "checkpoint.old"

    @property
    def swap_dir(self) -> Path:
        return Path(self.engine_options.swap_dir or self.workdir / "swap")

    # -- setup -------------------------------------------------------------------------------
    def setup(self) -> None:
        """Wrap the model for the method, load its start weights if any, build the engine,
        resume from a checkpoint if any."""
        configure_threads()
        cfg = self.config
        torch.manual_seed(cfg.seed)  # LoRA's A matrices are drawn here
        random.seed(cfg.seed)
        if cfg.method == "lora":
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                lora_dropout=cfg.lora_dropout,
                target_modules=list(LORA_MODULES[cfg.lora_modules]),
                task_type="CAUSAL_LM",
            )
            self.model = get_peft_model(self.model, lora)
        else:
            for p in self.model.parameters():
                p.requires_grad_(True)
        self.model.train()
        if self.start_weights is not None:
            self.loaded_tensors = self.start_weights(self.model)
        finished = self._finished_on_stages()  # before the engine takes the weights over
        self.engine = self._build_engine()
        try:
            if finished is not None:
                self._restore_progress(finished)
            else:
                self._resume()
        except BaseException:
            self._release_engine(restore=False)
            raise

    def _build_engine(self) -> InMemoryEngine | OffloadTrainEngine:
        cfg = self.config
        common = {
            "learning_rate": cfg.learning_rate,
            "total_steps": self.total_steps,
            "warmup_steps": round(cfg.warmup_ratio * self.total_steps),
            "weight_decay": cfg.weight_decay,
            "grad_clip": cfg.grad_clip,
            "grad_accum": cfg.grad_accum,
        }
        opts = self.engine_options
        if opts.kind == "memory":
            return InMemoryEngine(self.model, **common)
        device = torch.device(opts.device) if opts.device else None
        budget = opts.budget_bytes or auto_budget_bytes(self.model, device=device)
        host_budget = None
        if device is not None and device.type == "cuda":
            host_budget = opts.host_budget_bytes or auto_budget_bytes(device=torch.device("cpu"))
        kind = OffloadTrainEngine
        if opts.pipeline_parallel:  # this rank's stage of the model
            from worker.training.pipelined import PipelineTrainEngine as kind
        engine = kind(
            self.model,
            budget_bytes=budget,
            swap_dir=self.swap_dir,
            weights_files=list(opts.weights_files),
            prefetch=opts.prefetch,
            activation_bytes=opts.activation_bytes,
            init_weights=opts.init_weights,
            device=opts.device,
            host_budget_bytes=host_budget,
            data_parallel=opts.data_parallel,
            **common,
        )
        t = engine.telemetry()
        log.info(
            "Offload engine: budget %.0f MiB, %s, %d blocks.",
            budget / 2**20,
            "streaming from the SSD" if t["streaming"] else "everything fits in memory",
            t["blocks"],
        )
        return engine

    def _release_engine(self, restore: bool) -> None:
        """Close the engine (its swap files go); with `restore` the model gets its trained
        weights back in memory. The swap directory goes too once empty."""
        if self.engine is None:
            return
        engine, self.engine = self.engine, None
        engine.close(restore_weights=restore)
        if isinstance(engine, OffloadTrainEngine):
            try:
                self.swap_dir.rmdir()
            except OSError:  # not empty (someone else's files) or already gone
                pass

    def _meta(self) -> dict:
        return {
            "format": CHECKPOINT_FORMAT,
            "engine": self.engine_options.kind,
            "config": self._config_key(),
            "n_examples": len(self.examples),
            "examples_sha256": self._digest,
            "total_steps": self.total_steps,
            "step": self.progress.step,
            "epoch": self.progress.step // self.steps_per_epoch,
            "train_seconds": self.progress.train_seconds,
            "tokens": self.progress.tokens,
            "losses": self.progress.losses,
            "stages": getattr(self.engine, "stages", 1),  # pipeline parallel: one part each
        }

    def _config_key(self) -> dict:
        key = self.config.to_dict()
        key.pop("checkpoint_every")  # saving more or less often does not change the result
        return key

    def _checkpoint_meta(self) -> dict | None:
        """The checkpoint's meta.json when it was made by this run (same settings, data and
        engine), else None."""
        # A crash between the two renames of save_checkpoint leaves only checkpoint.old.
        if not self.checkpoint_dir.exists() and self._old_dir.exists():
            os.rename(self._old_dir, self.checkpoint_dir)
        meta_path = self.checkpoint_dir / "meta.json"
        if not meta_path.is_file():
            return None
        meta = json.loads(meta_path.read_text())
        same = (
            meta.get("format") == CHECKPOINT_FORMAT
            and meta.get("engine") == self.engine_options.kind
            and meta.get("config") == self._config_key()
            and meta.get("examples_sha256") == self._digest
        )
        if not same:
            log.warning("Ignoring %s: made with other settings or data.", self.checkpoint_dir)
            return None
        return meta

    def _resume(self) -> None:
        meta = self._checkpoint_meta()
        if meta is None:
            return
        stages = getattr(self.engine, "stages", 1)
        if int(meta.get("stages", 1)) != stages:
            log.warning("Ignoring %s: written by %s pipeline stages, this run has %d.",
                        self.checkpoint_dir, meta.get("stages", 1), stages)
            return
        self.engine.load_checkpoint(self.checkpoint_dir)
        rng = torch.load(self.checkpoint_dir / "rng.pt", weights_only=True)
        if stages == 1:  # a stage's own generator came back with its engine's checkpoint
            torch.set_rng_state(rng["torch"])
        random.setstate(_tuplify(rng["python"]))
        self._restore_progress(meta)

    def _finished_on_stages(self) -> dict | None:
        """A pipeline-parallel run of this job that reached its last step (its ranks wrote
        the checkpoint, worker/distributed/): its trained weights, loaded into the model;
        returns the checkpoint's meta. None otherwise (and in the ranks themselves)."""
        if self.engine_options.pipeline_parallel:
            return None
        meta = self._checkpoint_meta()
        trained = self.checkpoint_dir / TRAINED
        if (meta is None or int(meta.get("stages", 1)) <= 1
                or int(meta["step"]) < self.total_steps or not trained.is_file()):
            return None
        from safetensors.torch import load_file

        weights = load_file(trained)
        params = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if weights.keys() != params.keys():
            log.warning("Ignoring %s: its weights do not fit this model.", trained)
            return None
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(weights[name])
        return meta

    def _restore_progress(self, meta: dict) -> None:
        self.progress = _Progress(
            step=int(meta["step"]),
            train_seconds=float(meta["train_seconds"]),
            tokens=int(meta["tokens"]),
            losses=[float(x) for x in meta["losses"]],
        )
        self._last_saved_step = self.progress.step
        log.info("Resumed from step %d of %d.", self.progress.step, self.total_steps)

    # -- batches -----------------------------------------------------------------------------
    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            cfg = self.config
            lengths = [min(len(ex["input_ids"]), cfg.max_seq_len) for ex in self.examples]
            order = epoch_order(
                lengths, cfg.seed, epoch, cfg.batch_size * cfg.grad_accum, cfg.group_by_length
            )
            self._perm_cache = (epoch, order)
        return self._perm_cache[1]

    def batch_for_step(self, step: int) -> dict[str, torch.Tensor]:
        """The batch of optimizer step `step` (0-based): a pure function of seed and step, so
        a resumed run skips exactly the batches already done."""
        epoch, index = divmod(step, self.steps_per_epoch)
        per_step = self.config.batch_size * self.config.grad_accum
        order = self._permutation(epoch)[index * per_step : (index + 1) * per_step]
        return pad_batch(
            [self.examples[i] for i in order], self.pad_token_id, self.config.max_seq_len
        )

    # -- train -------------------------------------------------------------------------------
    def train(self, keep_engine: bool = False) -> dict:
        """Run the remaining optimizer steps; returns metrics. Raises Cancelled (after saving a
        checkpoint) when `hooks.should_cancel()` turns true.

        Either way the engine is closed on the way out and the model holds its trained
        weights in memory again (scoring and export use it as an ordinary model); after an
        error the model's state is only good in the last checkpoint. With `keep_engine`
        a run that finishes leaves the engine open instead (a model larger than memory is
        scored and exported through it; cleanup(restore=False) closes it)."""
        if self.engine is None:
            raise RuntimeError("call setup() first")
        try:
            with noisy_embeddings(self.model, self.config.neftune_alpha, self.config.seed,
                                  lambda: self.progress.step, self.pad_token_id):
                self._train_steps()
        except Cancelled:  # a streamed model (keep_engine) is not brought into memory
            self._release_engine(restore=not keep_engine)
            raise
        except BaseException:
            self._release_engine(restore=False)
            raise
        if not keep_engine:
            self._release_engine(restore=True)
        return self.metrics()

    def step_costs(self) -> list[float]:
        """Each step's matmul FLOPs from its padded shape and its positions that predict a
        label (worker.training.flops): the ETA weighs the steps left by these, so a run that
        started on its long batches does not take every later, shorter one to be as slow."""
        cfg = self.config
        lengths = [min(len(ex["input_ids"]), cfg.max_seq_len) for ex in self.examples]
        predicting = [predicting_count(ex, cfg.max_seq_len) for ex in self.examples]
        return [step_flops(self._flops, len(b), max(lengths[i] for i in b),
                           sum(predicting[i] for i in b), self._head_flops)
                for b in step_members(lengths, cfg.seed, cfg.batch_size * cfg.grad_accum,
                                      cfg.group_by_length, self.steps_per_epoch,
                                      self.total_steps)]

    def _train_steps(self) -> None:
        self.model.train()
        recent: list[tuple[float, int]] = []  # (seconds, tokens) of the last steps
        costs = self.step_costs()
        left = [0.0] * (len(costs) + 1)  # left[i]: the cost of steps i and after
        for i in range(len(costs) - 1, -1, -1):
            left[i] = left[i + 1] + costs[i]
        done_s = done_cost = 0.0  # this run's steps, for the ETA
        while self.progress.step < self.total_steps:
            if self.hooks.should_cancel():
                self.save_checkpoint()
                raise Cancelled(f"Cancelled at step {self.progress.step} of {self.total_steps}.")
            batch = self.batch_for_step(self.progress.step)
            tokens = int(batch["attention_mask"].sum())
            started = time.perf_counter()
            loss = self.engine.step(batch)
            seconds = time.perf_counter() - started
            done_s, done_cost = done_s + seconds, done_cost + costs[self.progress.step]
            p = self.progress
            p.step += 1
            p.train_seconds += seconds
            p.tokens += tokens
            p.losses.append(loss)
            recent = (recent + [(seconds, tokens)])[-10:]
            recent_s = sum(s for s, _ in recent)
            # The checkpoints still to write, at the last one's time (none measured yet: 0).
            later = self._checkpoint_s * checkpoints_after(
                p.step, self.total_steps, self.steps_per_epoch, self.config.checkpoint_every)
            self.hooks.on_progress(
                {
                    "step": p.step,
                    "total_steps": self.total_steps,
                    "loss": loss,
                    "tokens_per_s": sum(t for _, t in recent) / max(recent_s, 1e-9),
                    "eta_s": done_s / max(done_cost, 1e-9) * left[p.step] + later,
                    "epoch": (p.step - 1) // self.steps_per_epoch + 1,
                    "epochs": math.ceil(self.total_steps / self.steps_per_epoch),
                    "lr": self.engine.learning_rate,
                    "telemetry": self.engine.telemetry(),
                }
            )
            if is_checkpoint_step(p.step, self.total_steps, self.steps_per_epoch,
                                  self.config.checkpoint_every):
                started = time.perf_counter()
                self.save_checkpoint()
                self._checkpoint_s = time.perf_counter() - started

    def metrics(self) -> dict:
        p = self.progress
        return {
            "steps": p.step,
            "total_steps": self.total_steps,
            "train_seconds": round(p.train_seconds, 3),
            "tokens": p.tokens,
            "tokens_per_s": p.tokens / p.train_seconds if p.train_seconds else 0.0,
            "final_loss": p.losses[-1] if p.losses else None,
            "losses": list(p.losses),
        }

    # -- checkpoints -------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        """Write the engine's state (weights, optimizer, step), the RNG states and the
        counters to `workdir/checkpoint`.

        Built in checkpoint.tmp/, fsynced, then swapped in by rename; the previous checkpoint
        is kept (as checkpoint.old) until the new one is in place.
        """
        if self._last_saved_step == self.progress.step and self.checkpoint_dir.exists():
            return self.checkpoint_dir  # up to date (train() always ends with a checkpoint)
        if self.engine is None:
            raise RuntimeError("call setup() first")
        if getattr(self.engine, "stages", 1) > 1:  # pipeline parallel: every stage writes
            self._write_stage_checkpoint()
            return self.checkpoint_dir
        if self.engine.world_size > 1:  # data parallel: rank 0 writes
            if self.engine.rank == 0:
                self._write_checkpoint()
            import torch.distributed as dist

            dist.barrier()  # no rank goes on before the checkpoint is in place
            self._last_saved_step = self.progress.step
            return self.checkpoint_dir
        self._write_checkpoint()
        return self.checkpoint_dir

    def _write_checkpoint(self) -> None:
        tmp = self._fresh_tmp()
        self.engine.save_checkpoint(tmp)
        self._seal_checkpoint(tmp)

    def _fresh_tmp(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_dir
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def _write_stage_checkpoint(self) -> None:
        """Pipeline parallel: each stage writes its part (tmp/stage<r>); after the last
        step every stage's trained weights go to rank 0 too, into TRAINED (what the job's
        own process takes back); then rank 0 seals the checkpoint and swaps it in."""
        import torch.distributed as dist
        from safetensors.torch import save_file

        first = self.engine.stage == 0
        tmp = self._fresh_tmp() if first else self._tmp_dir
        dist.barrier()  # the folder is there, empty
        self.engine.save_checkpoint(tmp)
        weights = self.engine.trained_weights() if self.progress.step >= self.total_steps else None
        dist.barrier()  # every part is written
        if first:
            if weights is not None:
                save_file({k: v.contiguous() for k, v in weights.items()}, tmp / TRAINED)
            self._seal_checkpoint(tmp)
        dist.barrier()  # no stage goes on before the checkpoint is in place
        self._last_saved_step = self.progress.step

    def _seal_checkpoint(self, tmp: Path) -> None:
        """The RNG states and counters next to the engine's files, all fsynced; then the
        folder is swapped in for the previous checkpoint."""
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate()}, tmp / "rng.pt")
        (tmp / "meta.json").write_text(json.dumps(self._meta()) + "\n")
        for path in tmp.iterdir():
            if path.is_file():  # an engine's folder (a pipeline stage's) syncs its own
                fsync_file(path)
        fsync_dir(tmp)
        if self.checkpoint_dir.exists():
            shutil.rmtree(self._old_dir, ignore_errors=True)
            os.rename(self.checkpoint_dir, self._old_dir)
        os.rename(tmp, self.checkpoint_dir)
        fsync_dir(self.workdir)
        shutil.rmtree(self._old_dir, ignore_errors=True)
        self._last_saved_step = self.progress.step

    def cleanup(self, remove_checkpoint: bool = False, restore: bool = True) -> None:
        """Close the engine (with `restore` the model keeps its weights); with
        `remove_checkpoint`, delete the run's checkpoints (once the job's results are safely
        stored)."""
        self._release_engine(restore=restore)
        if remove_checkpoint:
            for path in (self.checkpoint_dir, self._tmp_dir, self._old_dir):
                shutil.rmtree(path, ignore_errors=True)


def _tuplify(value):
    """random.setstate wants tuples; a state that went through torch.save may hold lists."""
    if isinstance(value, list | tuple):
        return tuple(_tuplify(v) for v in value)
    return value
