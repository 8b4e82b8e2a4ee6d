"""Incremental training: a job that starts from the project's previous tuned version.

A LoRA job continues the previous version's LoRA adapter: same rank and target modules, its
weights loaded into the fresh adapter before the training engine takes the model over (a
resumed job still resumes from its own checkpoint). Its adapter is still an adapter on the
base model, so every version downloads and loads the same way. A full fine-tune continues the
previous full version's merged model: its weights replace the base model's before training
(worker.pipeline, load_model_weights). Either way the job trains on the documents that are new
to that version (added or edited files) plus a replay sample of the ones it already knew, so
the earlier knowledge keeps being rehearsed instead of being overwritten.
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from worker.recipe import FineTuneRecipe

log = logging.getLogger(__name__)

# Old documents replayed next to the new ones: at least this share of them, and at least as
# many as there are new ones (when there are that many).
REPLAY_SHARE = 0.25
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What is taken from a merged model's zip to start from: its config and weights (shards too).
MODEL_CONFIG = "config.json"
WEIGHTS_SUFFIX = ".safetensors"


def replay_plan(sources: list[dict[str, Any]], seed: int) -> tuple[list[int], list[int]]:
    """(document ids to train on, the replayed ones among them) for a job's `sources`, each
    marked "new" or not (app.services.jobs.job_sources). Nothing new: everything is trained
    on again. The sample is drawn with `seed`, so a resumed job draws the same one."""
    new = [s["id"] for s in sources if s.get("new", True)]
    old = [s["id"] for s in sources if not s.get("new", True)]
    if not new:
        return [s["id"] for s in sources], []
    k = min(len(old), max(len(new), math.ceil(REPLAY_SHARE * len(old))))
    replay = sorted(random.Random(seed).sample(old, k))
    chosen = set(new) | set(replay)
    return [s["id"] for s in sources if s["id"] in chosen], replay


def unpack_adapter(zip_path: Path, dest: Path) -> Path:
    """The two adapter files of a version's adapter.zip, unpacked into `dest` (nothing else
    is taken from the zip, and no path from inside it is used)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(zip_path) as zf:
        by_base = {Path(info.filename).name: info for info in zf.infolist() if not info.is_dir()}
        for name in ADAPTER_FILES:
            if name not in by_base:
                raise ValueError(f"The previous version's adapter has no {name}.")
            (dest / name).write_bytes(zf.read(by_base[name]))
    return dest


def unpack_model(zip_path: Path, dest: Path) -> Path:
    """The config and *.safetensors weights of a version's merged-model zip (worker.export
    export_merged), unpacked into `dest`, emptied first. As with unpack_adapter, files are
    picked by their base name and written under that name only: no path from inside the zip
    is used. Raises ValueError when there are no weights or a name comes twice."""
    shutil.rmtree(dest, ignore_errors=True)  # ours alone: no stale shard from an earlier run
    dest.mkdir(parents=True)
    with zipfile.ZipFile(zip_path) as zf:
        wanted: dict[str, zipfile.ZipInfo] = {}
        for info in zf.infolist():
            name = Path(info.filename).name
            if info.is_dir() or not (name == MODEL_CONFIG or name.endswith(WEIGHTS_SUFFIX)):
                continue
            if name in wanted:
                raise ValueError(f"The previous version's model holds two files named {name}.")
            wanted[name] = info
        if not any(name.endswith(WEIGHTS_SUFFIX) for name in wanted):
            raise ValueError("The previous version's model has no weights (*.safetensors).")
        for name, info in wanted.items():
            with zf.open(info) as src, open(dest / name, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
    return dest


def load_model_weights(model: torch.nn.Module, folder: Path) -> int:
    """Copy the weights of the merged model in `folder` into `model` (the base model, same
    architecture); returns how many tensors were loaded. Every weight must be there with the
    same shape (a tied weight, e.g. the output layer sharing the embeddings, comes with its
    twin); otherwise ValueError in plain words, and `model` is left as it was."""
    files = sorted(Path(folder).glob(f"*{WEIGHTS_SUFFIX}"))
    if not files:
        raise ValueError("The previous version's model has no weights (*.safetensors).")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path)))
    own = model.state_dict()  # tensors sharing the parameters' storage
    unexpected = sorted(k for k in state if k not in own)
    reshaped = sorted(k for k in state if k in own and state[k].shape != own[k].shape)
    loaded = {own[k].data_ptr() for k in state if k in own}
    missing = sorted(k for k in own if k not in state and own[k].data_ptr() not in loaded)
    if unexpected or reshaped or missing:
        example = (reshaped or missing or unexpected)[0]
        raise ValueError(
            "The previous version's model does not fit the base model "
            f"({len(missing)} weights missing, {len(unexpected)} unexpected, {len(reshaped)} "
            f"of another shape, e.g. {example}). Was the base model changed? Start from the "
            "base model instead."
        )
    with torch.no_grad():
        for key, value in state.items():
            own[key].copy_(value)
    return len(state)


def adapter_settings(folder: Path) -> dict[str, Any]:
    """The LoRA settings a continued adapter must keep: rank and alpha."""
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    return {"lora_rank": int(config["r"]), "lora_alpha": float(config["lora_alpha"])}


def load_adapter_weights(model: torch.nn.Module, folder: Path) -> int:
    """Copy the adapter in `folder` into `model` (a PeftModel with a matching adapter);
    returns how many tensors were loaded. Raises ValueError when they do not fit."""
    from peft import set_peft_model_state_dict

    state = load_file(str(folder / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            "The previous version's adapter does not fit this model "
            f"({len(missing)} missing, {len(result.unexpected_keys)} unexpected tensors)."
        )
    return len(state)


class ContinuedRecipe(FineTuneRecipe):
    """FineTuneRecipe whose LoRA adapter starts from a previous version's weights."""

    def __init__(self, start_adapter: Path, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_adapter = Path(start_adapter)
        self.loaded_tensors = 0

    def _build_engine(self):
        # setup() has wrapped the model in its adapter and builds the engine next: the start
        # weights go in now, before the engine takes the parameters over. A checkpoint, if
        # any, is loaded after this and wins (the job resumes where it stopped).
        self.loaded_tensors = load_adapter_weights(self.model, self.start_adapter)
        log.info("Starting from the previous version's adapter (%d tensors).", self.loaded_tensors)
        return super()._build_engine()


def score_previous(model, tokenizer, split, folder: Path, evaluate) -> dict:
    """The previous version's scores on this job's probes and held-out text: its adapter is
    put on `model` for the measurement and taken off again (the base weights untouched)."""
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    try:
        return evaluate(peft_model, tokenizer, split)
    finally:
        peft_model.unload()


@dataclass
class JobInputs:
    """What run_job trains on: document ids, the adapter to start from (None: a fresh one)
    and the settings that must follow that adapter, or for a full fine-tune the merged model
    folder to start from (None: the base model)."""

    doc_ids: list[int]
    start_adapter: Path | None = None
    params: dict[str, Any] = field(default_factory=dict)
    start_model: Path | None = None


def plan_inputs(session, job, workdir: Path) -> JobInputs:
    """Decide how job `job` (a row, in `session`) starts. A LoRA job whose parent is a done
    LoRA version continues that version's adapter, a full job whose parent is a done full
    version that version's merged model, on the new documents plus a replay sample; each
    source is marked with its role ("new", "replay", or "known": learned before, not
    replayed). Anything else, or a parent whose adapter or merged model is gone, trains on
    every document from the base model."""
    from app.models import Job, JobState
    from app.settings import settings

    sources = [dict(s) for s in job.sources or []]
    everything = JobInputs([s["id"] for s in sources])
    parent = session.get(Job, job.parent_job_id) if job.parent_job_id else None
    if parent is None or job.method not in ("lora", "full"):
        return everything
    kind = "adapter" if job.method == "lora" else "merged"
    raw = (parent.artifacts or {}).get(kind)
    if parent.state != JobState.done or parent.method != job.method or not raw:
        log.warning(
            "job %s: job %s has no %s to continue; starting from the base model",
            job.id,
            parent.id,
            "adapter" if kind == "adapter" else "merged model",
        )
        return everything
    path = Path(raw) if Path(raw).is_absolute() else settings.data_dir / raw
    try:
        if kind == "adapter":
            folder = unpack_adapter(path, Path(workdir) / "start_adapter")
            params = adapter_settings(folder)
        else:
            folder, params = unpack_model(path, Path(workdir) / "start_model"), {}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning(
            "job %s: cannot continue job %s's %s (%s); starting from the base model",
            job.id,
            parent.id,
            kind,
            exc,
        )
        return everything
    seed = int((job.params or {}).get("seed", 0)) + job.id
    doc_ids, replay = replay_plan(sources, seed)
    chosen, replayed = set(doc_ids), set(replay)
    for s in sources:
        s["role"] = "replay" if s["id"] in replayed else "new" if s["id"] in chosen else "known"
    job.sources = sources
    if kind == "merged":
        return JobInputs(doc_ids, start_model=folder)
    return JobInputs(doc_ids, folder, params)
