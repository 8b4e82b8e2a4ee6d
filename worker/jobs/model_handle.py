"""The job's base model, and everything that follows from where it lives.

A base model that fits is loaded whole (`InMemoryBaseModel`); one larger than memory is
built without its block weights and streamed from the disk by the offload engine
(`StreamedBaseModel`, worker/training/streamed.py). The pipeline asks the handle, never the
model, how to score it, which engine options train it, how a previous version's merged
weights go in, how it is trained and read for export, and how it is released: the two give
the same results bit for bit (tests/worker/jobs/test_streamed.py).
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from worker.export.tensor_source import StreamedSource, TensorSource
from worker.export.writers import MAX_SHARD_BYTES
from worker.training.continued import load_model_weights
from worker.training.recipe import EngineOptions, FineTuneRecipe, Hooks
from worker.training.resources import auto_budget_bytes
from worker.training.streamed import (
    WeightsReader,
    describe,
    eval_batch_size,
    load_resident_weights,
    load_unloaded_model,
    scoring_engine,
    should_stream,
)

log = logging.getLogger(__name__)

# Prompts per generate() call when the model is in memory.
EVAL_BATCH = 8


class BaseModelHandle(ABC):
    """The base model of one job (`model`, after `load`), on `device`; `swap_dir` is where
    an offload engine pages, `budget_bytes` the memory it may use (None: automatic)."""

    def __init__(
        self, model_dir: str, device: torch.device, budget_bytes: int | None, swap_dir: Path
    ) -> None:
        self.model_dir = model_dir  # a folder, or a hub id
        self.device = device
        self.cuda = device.type == "cuda"
        self.budget_bytes = budget_bytes
        self.swap_dir = Path(swap_dir)
        self.model: torch.nn.Module | None = None
        self.eval_batch = EVAL_BATCH  # prompts per generate() call when scoring
        # Fills a block parameter's page in the engine from the model's files (streamed).
        self.init_weights = None
        # On a GPU the engine's page pool lives in (pinned) host memory: half of what is free.
        self.host_budget: int | None = None

    def load(self, hooks: Hooks) -> torch.nn.Module:
        """Load (or, streamed, build) the model; the caller seeds torch first."""
        self.model = self._load(hooks)
        if self.cuda:
            self.host_budget = auto_budget_bytes(device=torch.device("cpu"))
        return self.model

    @abstractmethod
    def _load(self, hooks: Hooks) -> torch.nn.Module: ...

    def scoring(self) -> AbstractContextManager:
        """What the base model is scored in (before training, replay answers, a previous
        adapter): nothing for a model in memory."""
        return contextlib.nullcontext()

    @abstractmethod
    def start_from_model(self, folder: Path) -> None:
        """Put a previous full version's merged weights (a model folder) in place of the base
        model's, before the recipe is built."""

    def engine_options(self) -> EngineOptions:
        """Where the training state lives: the offload engine under the job's budget."""
        folder = Path(self.model_dir)
        return EngineOptions(
            budget_bytes=self.budget_bytes,
            swap_dir=self.swap_dir,
            # LoRA reads the frozen base weights straight from the model's files (read-only).
            weights_files=sorted(folder.glob("*.safetensors")) if folder.is_dir() else [],
            init_weights=self.init_weights,
            device=str(self.device) if self.cuda else None,
            host_budget_bytes=self.host_budget,
        )

    @abstractmethod
    def train(self, recipe: FineTuneRecipe) -> dict:
        """Run the recipe's training; returns its metrics. Afterwards `recipe.model` can be
        scored and exported."""

    def export_source(self, recipe: FineTuneRecipe) -> TensorSource | None:
        """What the exports read the trained model from (None: `recipe.model` in memory)."""
        return None

    def max_shard_bytes(self) -> int:
        """The largest safetensors shard of the merged export."""
        return MAX_SHARD_BYTES

    @abstractmethod
    def release(self, recipe: FineTuneRecipe) -> None:
        """Close the recipe's engine, whatever happened."""


class InMemoryBaseModel(BaseModelHandle):
    """A base model loaded whole on the job's device; trained, scored and exported there."""

    def _load(self, hooks: Hooks) -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).to(
            self.device
        )

    def start_from_model(self, folder: Path) -> None:
        n_loaded = load_model_weights(self.model, Path(folder))
        log.info("Starting from the previous version's model (%d tensors).", n_loaded)

    def train(self, recipe: FineTuneRecipe) -> dict:
        metrics = recipe.train()  # the engine closes, the model holds its trained weights
        recipe.cleanup()
        return metrics

    def release(self, recipe: FineTuneRecipe) -> None:
        recipe.cleanup(restore=True)


class StreamedBaseModel(BaseModelHandle):
    """A base model larger than memory: its blocks stay on the disk and every forward pages
    them through an offload engine, for scoring, training and export alike."""

    def __init__(self, *args, eval_cap: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eval_cap = eval_cap
        self.reader: WeightsReader | None = None
        self.scoring_budget = 0

    def _load(self, hooks: Hooks) -> torch.nn.Module:
        log.info("Streaming the base model's blocks from the disk: %s", describe(self.model_dir))
        hooks.on_phase("running", "Preparing the base model (larger than memory: streamed)")
        self.reader = WeightsReader(Path(self.model_dir))
        model = load_unloaded_model(Path(self.model_dir), self.reader)
        self.init_weights = self.reader.init_weights
        self.scoring_budget = self.budget_bytes or auto_budget_bytes(device=self.device)
        # Every forward reads the model whole: batches as large as memory allows.
        self.eval_batch = eval_batch_size(model.config, self.scoring_budget, self.eval_cap)
        return model

    def scoring(self) -> AbstractContextManager:
        return scoring_engine(
            self.model, self.reader, self.scoring_budget, self.swap_dir,
            self.device if self.cuda else None, self.host_budget,
        )  # fmt: skip

    def start_from_model(self, folder: Path) -> None:
        # Embeddings, norm and output layer now; the engine fills the blocks from its files.
        start_reader = WeightsReader(Path(folder))
        load_resident_weights(self.model, start_reader)
        self.init_weights = start_reader.init_weights

    def train(self, recipe: FineTuneRecipe) -> dict:
        return recipe.train(keep_engine=True)  # the engine stays open for scoring and export

    def export_source(self, recipe: FineTuneRecipe) -> TensorSource:
        return StreamedSource(recipe.model, recipe.engine.engine)

    def max_shard_bytes(self) -> int:
        # Shards that fit the activations' share of the budget (the page pool stays allocated).
        return self.scoring_budget // 8

    def release(self, recipe: FineTuneRecipe) -> None:
        recipe.cleanup(restore=False)


def open_base_model(
    model_dir: str,
    stream_base: str,
    device: torch.device,
    budget_bytes: int | None,
    swap_dir: Path,
    eval_cap: int,
) -> BaseModelHandle:
    """The handle for the base model in `model_dir` (not loaded yet): streamed when
    `stream_base` says so ("always", or "auto" and too large for memory), else in memory.
    `eval_cap`: most prompts per generate() call of a streamed model."""
    if Path(model_dir).is_dir() and should_stream(Path(model_dir), stream_base, device=device):
        return StreamedBaseModel(model_dir, device, budget_bytes, swap_dir, eval_cap=eval_cap)
    return InMemoryBaseModel(model_dir, device, budget_bytes, swap_dir)
