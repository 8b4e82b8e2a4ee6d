"""Training that continues a previous version instead of starting from the base model.

A LoRA job loads the previous version's adapter weights into its fresh adapter before the
training engine takes the model over (`adapter_start`, the recipe's start_weights; a resumed
job still resumes from its own checkpoint), so every version is still an adapter on the base
model and downloads and loads the same way. A full fine-tune loads the previous full
version's merged weights in place of the base model's (load_model_weights). Which version a
job continues is decided in worker.jobs.inputs.
"""

from __future__ import annotations

import json
import logging
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from app.contract.training import LORA_MODULES
from worker.errors import UserFacingError

log = logging.getLogger(__name__)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# What is taken from a merged model's zip to start from: its config and weights (shards too).
MODEL_CONFIG = "config.json"
WEIGHTS_SUFFIX = ".safetensors"


def unpack_adapter(zip_path: Path, dest: Path) -> Path:
    """The two adapter files of a version's adapter.zip, unpacked into `dest` (nothing else
    is taken from the zip, and no path from inside it is used)."""
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(zip_path) as zf:
        by_base = {Path(info.filename).name: info for info in zf.infolist() if not info.is_dir()}
        for name in ADAPTER_FILES:
            if name not in by_base:
                raise UserFacingError(f"The previous version's adapter has no {name}.")
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
                raise UserFacingError(f"The previous version's model holds two files named {name}.")
            wanted[name] = info
        if not any(name.endswith(WEIGHTS_SUFFIX) for name in wanted):
            raise UserFacingError("The previous version's model has no weights (*.safetensors).")
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
        raise UserFacingError("The previous version's model has no weights (*.safetensors).")
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
        raise UserFacingError(
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
    """The LoRA settings a continued adapter must keep: rank, alpha and the projections it
    adapts (a name of LORA_MODULES; UserFacingError for a set no job trains)."""
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    targets = config.get("target_modules") or []
    targets = {targets} if isinstance(targets, str) else set(targets)
    modules = next((name for name, names in LORA_MODULES.items() if set(names) == targets), None)
    if modules is None:
        raise UserFacingError(
            f"The previous version's adapter adapts {', '.join(sorted(targets)) or 'nothing'}, "
            "which no DocTune job trains. Start from the base model instead."
        )
    return {
        "lora_rank": int(config["r"]),
        "lora_alpha": float(config["lora_alpha"]),
        "lora_modules": modules,
    }


def load_adapter_weights(model: torch.nn.Module, folder: Path) -> int:
    """Copy the adapter in `folder` into `model` (a PeftModel with a matching adapter);
    returns how many tensors were loaded. Raises ValueError when they do not fit."""
    from peft import set_peft_model_state_dict

    state = load_file(str(folder / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise UserFacingError(
            "The previous version's adapter does not fit this model "
            f"({len(missing)} missing, {len(result.unexpected_keys)} unexpected tensors)."
        )
    return len(state)


def adapter_start(folder: Path) -> Callable[[torch.nn.Module], int]:
    """A recipe's `start_weights` (worker.training.recipe.StartWeights) that start its fresh
    LoRA adapter from the previous version's adapter in `folder`."""
    folder = Path(folder)

    def load(model: torch.nn.Module) -> int:
        n = load_adapter_weights(model, folder)
        log.info("Starting from the previous version's adapter (%d tensors).", n)
        return n

    return load
