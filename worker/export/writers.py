"""Downloads a finished job offers, each one zip carrying a README.md model card: the LoRA
adapter and the merged model (Hugging Face layout), and GGUF files for llama.cpp / Ollama
(float16 and Q8_0, each with an Ollama Modelfile).

The merged model and the GGUF files are written from a TensorSource (worker.export.tensor_source),
one tensor at a time, so a model larger than memory (trained through the offload engine) can
be exported too; a model in memory is merged on a copy and read through model_source.

Zips are streamed from files on disk (never built in memory) and appear atomically: written
as `<name>.tmp`, fsynced, renamed. Weights are stored uncompressed (they do not compress).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import tempfile
import zipfile
from pathlib import Path

import torch

from app.contract.artifacts import KINDS  # every download a job can offer, in the order made
from worker.errors import UserFacingError, ran_out_of
from worker.export.tensor_source import (
    ModelSource,
    TensorSource,
    TensorSpec,
    checked_tensors,
    model_source,
)
from worker.training.base_model import make_config_portable, make_tokenizer_portable

STORED_SUFFIXES = {".safetensors", ".bin", ".gguf", ".pt"}
# Hugging Face's own default shard size is larger (50 GB in transformers 5); 2 GiB shards keep
# the memory a streamed export holds small (a shard is built in memory before it is written).
MAX_SHARD_BYTES = 2 * 2**30
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def _write_zip(folder: Path, out_zip: Path) -> Path:
    """Zip the files of `folder` (flat layout) into `out_zip`, atomically."""
    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_zip.with_name(out_zip.name + ".tmp")
    try:
        with zipfile.ZipFile(tmp, "w", allowZip64=True) as zf:
            for path in sorted(folder.rglob("*")):
                if not path.is_file():
                    continue
                kind = (
                    zipfile.ZIP_STORED if path.suffix in STORED_SUFFIXES else zipfile.ZIP_DEFLATED
                )
                zf.write(path, arcname=path.relative_to(folder).as_posix(), compress_type=kind)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, out_zip)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out_zip


def _save_tokenizer_and_card(tokenizer, folder: Path, card: str) -> None:
    tokenizer.save_pretrained(folder)
    make_tokenizer_portable(folder)
    (folder / "README.md").write_text(card, encoding="utf-8")  # replaces peft's template card


def export_adapter(
    model, tokenizer, out_zip: Path, card: str, base_model_id: str | None = None
) -> Path:
    """The LoRA adapter as a zip: adapter_model.safetensors, adapter_config.json, tokenizer
    files, README.md. `base_model_id` (e.g. a hub id) is what adapter_config.json names as the
    base, instead of this machine's folder. Raises ValueError for a fully fine-tuned model."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        # A ValueError: the model is a fine value, just one that has no adapter.
        raise UserFacingError(
            "This model was fully fine-tuned, so there is no adapter to export; "
            "export the merged model instead."
        )
    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out_zip.parent) as tmp:
        folder = Path(tmp)
        # Embeddings are never adapted here; "auto" would look the base model up (on the hub).
        model.save_pretrained(folder, save_embedding_layers=False)
        if base_model_id:  # patched in the file: the model in memory keeps its own config
            path = folder / "adapter_config.json"
            config = json.loads(path.read_text())
            config["base_model_name_or_path"] = base_model_id
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _save_tokenizer_and_card(tokenizer, folder, card)
        return _write_zip(folder, out_zip)


def merged_copy(model):
    """The model with its LoRA adapter folded in, as a plain transformers model.

    A LoRA model is merged on a copy, so the model in memory keeps its adapter and its
    weights bit for bit (merging then unmerging in place would not: W + BA - BA != W in
    floating point). The copy costs one more model's worth of RAM. A fully fine-tuned model
    is returned as it is.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return copy.deepcopy(model).merge_and_unload()
    return model


def _shard_plan(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """`specs` cut into shards in order, each at most `max_shard_bytes` (a larger tensor gets
    a shard of its own), as Hugging Face's sharding does."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = _numel(spec.shape) * spec.dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count


def write_merged(
    source: TensorSource, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES
) -> Path:
    """Write the plain model `source` into `folder` (new or empty) in Hugging Face layout:
    config.json (portable, see make_config_portable), generation_config.json when there is
    one, and the weights as one model.safetensors, or when they are larger than
    `max_shard_bytes` as model-00001-of-0000N.safetensors ... with
    model.safetensors.index.json, as save_pretrained writes them.

    The shards are planned from `source.specs()`, then filled from `source.tensors()` one at
    a time: only the current shard's tensors are held. A tied lm_head.weight is not stored
    (from_pretrained ties it again). Raises ValueError when the source's tensors are not the
    ones it listed."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = source.specs()
    config = copy.deepcopy(source.config)  # the source's own config is left as it is
    tied = bool(getattr(config, "tie_word_embeddings", False))
    stored = [s for s in specs if not (tied and s.name == "lm_head.weight")]
    if not stored:
        raise ValueError("The model lists no weights to save.")
    # What save_pretrained records: the weights' dtype and the model class.
    dtype = next((s.dtype for s in stored if s.dtype.is_floating_point), None)
    if dtype is not None:
        config.dtype = str(dtype).removeprefix("torch.")
    if isinstance(source, ModelSource):
        config.architectures = [type(source.model).__name__.removeprefix("FSDP")]
    config.save_pretrained(folder)
    make_config_portable(folder)
    if source.generation_config is not None:
        source.generation_config.save_pretrained(folder)

    shards = _shard_plan(stored, max_shard_bytes)
    n = len(shards)
    files = (
        [WEIGHTS_NAME]
        if n == 1
        else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    )
    file_of = {spec.name: files[i] for i, shard in enumerate(shards) for spec in shard}
    current: dict[str, torch.Tensor] = {}
    index = 0
    for spec, tensor in checked_tensors(source, specs):
        if spec.name not in file_of:
            del tensor
            continue  # the tied head
        current[spec.name] = tensor.contiguous()
        del tensor
        if len(current) == len(shards[index]):
            save_file(current, str(folder / files[index]), metadata={"format": "pt"})
            current = {}
            index += 1
    if n > 1:
        index_json = {
            "metadata": {
                "total_parameters": sum(_numel(s.shape) for s in stored),
                "total_size": sum(_numel(s.shape) * s.dtype.itemsize for s in stored),
            },
            "weight_map": dict(sorted(file_of.items())),
        }
        (folder / WEIGHTS_INDEX_NAME).write_text(
            json.dumps(index_json, indent=2, sort_keys=True) + "\n", encoding="utf-8"
        )
    return folder


def export_merged(
    model,
    tokenizer,
    out_zip: Path,
    card: str,
    merged=None,
    source: TensorSource | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """The full model, adapter folded in, as a zip in Hugging Face layout (config.json,
    model.safetensors or its shards and index, generation_config.json, tokenizer files,
    README.md). Written from `source` when given (`model` is then not used), else from
    `merged` (the result of merged_copy(model) when the caller already has it), else from
    merged_copy(model)."""
    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        source = model_source(merged if merged is not None else merged_copy(model))
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out_zip.parent) as tmp:
        folder = Path(tmp)
        write_merged(source, folder, max_shard_bytes=max_shard_bytes)
        _save_tokenizer_and_card(tokenizer, folder, card)
        return _write_zip(folder, out_zip)


def export_gguf(
    model,
    tokenizer,
    out_zip: Path,
    card: str,
    ftype: str = "q8_0",
    name: str = "model",
    merged=None,
    source: TensorSource | None = None,
) -> Path:
    """A GGUF file (`ftype`: "f16" or "q8_0") with an Ollama Modelfile and the model card, as
    one zip: <name>-<ftype>.gguf, Modelfile, README.md. Written from `source` when given
    (`model` is then not used), else from `merged` / merged_copy(model) as export_merged.
    Raises ValueError for a model the GGUF writer does not support (see
    worker.export.gguf)."""
    from worker.export.gguf import modelfile, write_gguf

    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        source = model_source(merged if merged is not None else merged_copy(model))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "model"
    gguf_name = f"{stem}-{ftype}.gguf"
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out_zip.parent) as tmp:
        folder = Path(tmp)
        write_gguf(source, tokenizer, folder / gguf_name, ftype=ftype, name=name)
        (folder / "Modelfile").write_text(modelfile(gguf_name, tokenizer), encoding="utf-8")
        (folder / "README.md").write_text(card, encoding="utf-8")
        return _write_zip(folder, out_zip)


def export_all(
    model,
    tokenizer,
    folder: Path,
    card: str,
    *,
    base_model_id: str | None = None,
    name: str = "model",
    source: TensorSource | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> tuple[dict[str, str], dict[str, str]]:
    """Write every download of a finished job into `folder`: (artifacts, errors).

    artifacts: kind -> zip path. errors: kind -> why that download could not be made, in
    words; one failing export (an unsupported architecture for GGUF, a full disk) does not
    stop the others, and the job keeps its scores and the files that did work.

    `source`: the plain (merged) model as a TensorSource, e.g. a streamed model larger than
    memory; the merged and GGUF downloads are written from it and `model` serves only the
    adapter download (a PeftModel; anything else, None included, has no adapter). Without
    it they are written from merged_copy(model), made once after the adapter export.
    `max_shard_bytes`: the merged model's largest file, and so the most of it in memory at
    once while it is written.
    """
    from peft import PeftModel

    folder = Path(folder)
    artifacts: dict[str, str] = {}
    errors: dict[str, str] = {}
    for kind in KINDS:
        if kind == "adapter" and not isinstance(model, PeftModel):
            continue  # a full fine-tune has no adapter: not an error
        out = folder / f"{kind}.zip"
        try:
            if kind == "adapter":
                path = export_adapter(model, tokenizer, out, card, base_model_id=base_model_id)
            else:
                if source is None:
                    source = model_source(merged_copy(model))
                if kind == "merged":
                    path = export_merged(
                        model, tokenizer, out, card, source=source,
                        max_shard_bytes=max_shard_bytes,
                    )
                else:
                    ftype = kind.removeprefix("gguf-")
                    path = export_gguf(
                        model, tokenizer, out, card, ftype=ftype, name=name, source=source
                    )
            artifacts[kind] = str(path)
        except (ValueError, OSError, RuntimeError, MemoryError) as exc:
            logging.getLogger(__name__).exception("export %s failed", kind)
            errors[kind] = _export_error(kind, exc)
    return artifacts, errors


def _export_error(kind: str, exc: Exception) -> str:
    label = {"adapter": "The LoRA adapter", "merged": "The merged model"}.get(
        kind, f"The GGUF file ({kind.removeprefix('gguf-')})"
    )
    if ran_out_of(exc) == "disk":
        return f"{label} could not be saved: the disk is full."
    if ran_out_of(exc) == "memory":
        return f"{label} could not be made: the computer ran out of memory."
    if isinstance(exc, UserFacingError):
        return f"{label} could not be made: {exc}"
    # Anything else is ours, not the user's: the details are in the worker's log.
    return (f"{label} could not be made because of an internal error; the other downloads "
            "are not affected.")
