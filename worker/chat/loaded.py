"""The models the chat worker keeps loaded: the base model once, every LoRA version as an
adapter on it (switched on for its conversations, off for the base model's), and the most
recently used full fine-tuned version as a model of its own. Each comes with its SSD cache
store, namespaced by the model's fingerprint (worker/chat/kv.py), so a cache made by one
version is never restored into another.

The base model's answers come from the very same wrapped model with the adapters disabled
(`disable_adapter()`): once peft has wrapped it, calling the inner model still runs the
active adapter, which is how a compare view elsewhere showed the tuned model twice.

A base model larger than memory (DOCTUNE_STREAM_BASE_MODEL, as jobs decide it) chats too:
it is built without its blocks' weights, and every forward reads them one block at a time
through the offload engine (worker/training/streamed.py), adapters and SSD caches as above.
Each generated token reads the whole model from the disk: slow, and the reply says so
(Loaded.streamed). A full version of such a model streams from its own files the same way."""

from __future__ import annotations

import contextlib
import functools
import logging
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offload.kvcache import KVStore
from worker.chat import kv
from worker.chat.stages import STAGES
from worker.errors import UserFacingError
from worker.training.continued import unpack_adapter, unpack_model
from worker.training.pipelined import causal_lm

log = logging.getLogger(__name__)

DTYPE = torch.float32  # as jobs train and score: the answers match the score card's


@dataclass(frozen=True)
class Version:
    """What a conversation talks to: None job_id is the base model."""

    job_id: int | None
    method: str = "lora"  # lora | full
    artifact: Path | None = None  # the adapter zip (lora) or merged-model zip (full)

    @property
    def name(self) -> str:
        return "base" if self.job_id is None else f"v{self.job_id}"


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    store: KVStore | None
    max_positions: int
    streamed: bool = False  # its blocks are read from the disk for every token
    fingerprint: str = ""  # the whole model's (kv.model_fingerprint), whatever runs where


class _Streamed:
    """A model whose blocks stay on the disk: the offload engine reads them one at a time
    for every forward (no-grad), within `budget_bytes` of memory."""

    def __init__(self, folder: Path, budget_bytes: int, swap_dir: Path) -> None:
        from worker.training.streamed import WeightsReader, load_unloaded_model, scoring_engine

        self.reader = WeightsReader(folder)
        try:
            self.model = load_unloaded_model(folder, self.reader)
            self._engine = scoring_engine(self.model, self.reader, budget_bytes, swap_dir)
            self.engine = self._engine.__enter__()
        except BaseException:
            self.reader.close()
            raise

    def close(self) -> None:
        try:
            self._engine.__exit__(None, None, None)
        finally:
            self.reader.close()


class ChatModels:
    """Loaded lazily, kept for the worker's life (one reply at a time: no locking)."""

    def __init__(self, base_dir: Path, work_dir: Path, cache_dir: Path | None,
                 cache_bytes: int | None = None, stream: str = "never",
                 budget_bytes: int | None = None, stage: int | None = None, tail=None) -> None:
        """`stream` ("auto", "always", "never"): whether the base model streams from the
        disk (worker/training/streamed.py's should_stream); `budget_bytes`: the memory it
        may then use (default: a share of what is free, as a job's engine takes).

        `stage`: this process holds only that stage of the model (worker/chat/stages.py),
        its blocks in memory; `tail` (with stage 0): the second stage's machine
        (worker/chat/head.py), to which every forward and cache operation is passed on."""
        self.stage, self.tail = stage, tail
        self.base_dir = Path(base_dir)
        self.stream = stream
        self.budget_bytes = budget_bytes
        self._streamed: dict[str, _Streamed] = {}  # "base", or a full version's name
        self._streams: bool | None = None
        self.work_dir = Path(work_dir)  # unpacked versions: work_dir/<name>/
        self.cache_dir = cache_dir
        self.cache_bytes = cache_bytes
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir)
        self._base: torch.nn.Module | None = None
        self._wrapped = None  # the PeftModel around the base, once a LoRA version is used
        self._adapters: dict[str, Path] = {}
        self._full: tuple[str, torch.nn.Module, Path] | None = None
        self._stores: dict[str, KVStore] = {}

    def loaded(self, version: Version) -> bool:
        """Whether a reply from `version` can start without loading anything."""
        if version.job_id is None:
            return self._base is not None
        if version.method == "full":
            return self._full is not None and self._full[0] == version.name
        return version.name in self._adapters

    @property
    def streams(self) -> bool:
        """Whether the models here are read from the disk block by block."""
        if self.stage is not None:  # a stage's blocks are loaded: that is what it is for
            return False
        if self._streams is None:
            from worker.training.streamed import should_stream

            self._streams = should_stream(self.base_dir, self.stream)
        return self._streams

    def _open(self, name: str, folder: Path) -> torch.nn.Module:
        """The model in `folder`, in memory, or streamed from the disk (see the module); a
        stage's part of it only, with `stage`."""
        if self.stage is not None:
            from worker.chat.stages import load_stage

            log.info("chat: loading blocks %s of %s from %s", self.blocks, name, folder)
            return load_stage(folder, self.stage)
        if not self.streams:
            return AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE).eval()
        from worker.training.resources import auto_budget_bytes

        budget = self.budget_bytes or auto_budget_bytes(device=torch.device("cpu"))
        log.info("chat: %s is larger than memory: streaming its blocks from %s", name, folder)
        streamed = _Streamed(folder, budget, self.work_dir / "swap" / name)
        self._streamed[name] = streamed
        return streamed.model

    @property
    def blocks(self) -> tuple[int, int]:
        """The blocks [lo, hi) of this process's stage (of the base model's config)."""
        return self._blocks_of(self.stage)

    @functools.cache  # noqa: B019 - one ChatModels per worker process, kept for its life
    def _blocks_of(self, stage: int) -> tuple[int, int]:
        from transformers import AutoConfig

        from worker.chat.stages import stage_blocks

        return stage_blocks(AutoConfig.from_pretrained(self.base_dir), stage)

    def load_base(self) -> torch.nn.Module:
        """The base model (this stage of it, with `stage`), loaded once."""
        return self._load_base()

    def _load_base(self) -> torch.nn.Module:
        if self._base is None:
            log.info("chat: loading the base model from %s", self.base_dir)
            self._base = self._open("base", self.base_dir)
        return self._base

    def close(self) -> None:
        """Stop the engines of streamed models (their swap files go) and close the cache
        stores (their I/O threads; this process's index of the folder goes with the last)."""
        for streamed in self._streamed.values():
            streamed.close()
        self._streamed.clear()
        for store in self._stores.values():
            store.close()
        self._stores.clear()

    def _store(self, fingerprint: str) -> KVStore | None:
        if self.cache_dir is None:
            return None
        if fingerprint not in self._stores:
            self._stores[fingerprint] = KVStore(self.cache_dir, fingerprint,
                                                cap_bytes=self.cache_bytes)
        return self._stores[fingerprint]

    def _unpacked(self, version: Version) -> Path:
        if version.artifact is None or not version.artifact.is_file():
            raise UserFacingError(f"The files of version {version.name} are gone: it cannot "
                                  "chat. Train it again, or choose another version.")
        target = self.work_dir / version.name
        try:
            if version.method == "full":
                return unpack_model(version.artifact, target)
            return unpack_adapter(version.artifact, target)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise UserFacingError(f"The files of version {version.name} cannot be read "
                                  f"({exc}). Train it again, or choose another version.") from exc

    def _positions(self, model: torch.nn.Module) -> int:
        return int(getattr(model.config, "max_position_embeddings", 2048) or 2048)

    def _fingerprint(self, model_dir: Path, adapter_dir: Path | None,
                     stage: int | None | str = "mine") -> str:
        """The store namespace of a part of the model (default this process's): the whole
        model (None), or a stage (whose cache holds its own blocks only)."""
        stage = self.stage if stage == "mine" else stage
        part = None
        if stage is not None:
            part = f"stage {stage} of {STAGES}: blocks {self._blocks_of(stage)}"
        return kv.model_fingerprint(model_dir, adapter_dir, DTYPE, part=part)

    @contextlib.contextmanager
    def use(self, version: Version, greedy: bool = False) -> Iterator[Loaded]:
        """The model for `version`, its tokenizer and its cache store, for one reply.
        `greedy`: the reply takes the most likely token every time (temperature 0), so on
        two machines only that token's logit crosses the link."""
        with contextlib.ExitStack() as stack:
            adapter = None
            if version.job_id is not None and version.method == "full":
                model, folder = self._full_model(version)
            else:
                base, folder = self._load_base(), self.base_dir
                if version.job_id is None:
                    if self._wrapped is not None:  # the adapters off: the base model's answers
                        stack.enter_context(self._wrapped.disable_adapter())
                    model = self._wrapped if self._wrapped is not None else base
                else:
                    adapter = self._adapter(version)
                    self._wrapped.set_adapter(version.name)
                    model = self._wrapped
            whole = kv.model_fingerprint(folder, adapter, DTYPE)
            store = self._store(whole if self.stage is None
                                else self._fingerprint(folder, adapter))
            positions = self._positions(model)
            if self.tail is not None:  # the first of two stages, the second on another machine
                from worker.chat.head import PipelinedLM, StagedStore, StageVersion

                staged = StageVersion(version.job_id, version.method,
                                      str(version.artifact) if version.artifact else None, whole)
                self.tail.use(staged)
                model = PipelinedLM(causal_lm(model), self.tail, greedy)
                store = StagedStore(store, self.tail, staged) if store is not None else None
            yield Loaded(model, self.tokenizer, store, positions, self.streams, whole)

    def forget(self, version: Version, token_ids: list[int]) -> int:
        """Delete the cache of a deleted conversation with `version` (its files that no other
        conversation's history shares); 0 when that version never chatted here. Both the
        caches of the whole model and of the first of two stages (the chat may have run
        either way), and on two machines the second stage's files too."""
        if self.cache_dir is None:
            return 0
        folder = self.work_dir / version.name
        if version.job_id is None:
            model_dir, adapter = self.base_dir, None
        elif not folder.is_dir():
            return 0
        elif version.method == "full":
            model_dir, adapter = folder, None
        else:
            model_dir, adapter = self.base_dir, folder
        parts = {self.stage} if self.stage not in (None, 0) else {None, 0}
        removed = sum(self._store(self._fingerprint(model_dir, adapter, part)).forget(token_ids)
                      for part in parts)
        if self.tail is not None:
            from worker.chat.head import StageVersion

            whole = kv.model_fingerprint(model_dir, adapter, DTYPE)
            removed += self.tail.forget(StageVersion(version.job_id, version.method, None,
                                                     whole), token_ids)
        return removed

    def _adapter(self, version: Version) -> Path:
        if version.name in self._adapters:
            return self._adapters[version.name]
        from peft import PeftModel

        folder = self._unpacked(version)
        log.info("chat: loading the adapter of %s", version.name)
        mine = folder
        if self.stage is not None:  # its matrices for this stage's blocks only
            from worker.chat.stages import stage_adapter

            mine = stage_adapter(folder, *self.blocks, self.work_dir / f"{version.name}-stage")
        if self._wrapped is None:
            self._wrapped = PeftModel.from_pretrained(self._load_base(), mine,
                                                      adapter_name=version.name).eval()
        else:
            self._wrapped.load_adapter(mine, adapter_name=version.name)
        self._adapters[version.name] = folder
        return folder

    def _full_model(self, version: Version) -> tuple[torch.nn.Module, Path]:
        if self._full is not None and self._full[0] == version.name:
            return self._full[1], self._full[2]
        if self._full is not None and self._full[0] in self._streamed:
            self._streamed.pop(self._full[0]).close()
        self._full = None  # one full version at a time: free the last one first
        folder = self._unpacked(version)
        log.info("chat: loading full version %s", version.name)
        model = self._open(version.name, folder)
        self._full = (version.name, model, folder)
        return model, folder
