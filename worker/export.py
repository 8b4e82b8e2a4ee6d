"""Downloads a finished job offers, each one zip carrying a README.md model card: the LoRA
adapter and the merged model (Hugging Face layout), and GGUF files for llama.cpp / Ollama
(float16 and Q8_0, each with an Ollama Modelfile).

The merged model and the GGUF files are written from a TensorSource (worker.tensor_source),
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

from worker.base_model import make_config_portable, make_tokenizer_portable
from worker.tensor_source import (
    ModelSource,
    TensorSource,
    TensorSpec,
    checked_tensors,
    model_source,
)

STORED_SUFFIXES = {".safetensors", ".bin", ".gguf", ".pt"}
# Hugging Face's own default shard size is larger (50 GB in transformers 5); 2 GiB shards keep
# the memory a streamed export holds small (a shard is built in memory before it is written).
MAX_SHARD_BYTES = 2 * 2**30
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _recall(scores: dict) -> str:
    n, hit = scores.get("n_probes"), scores.get("n_recalled")
    if n:
        return f"{hit} of {n} ({100 * hit / n:.0f}%)"
    return "n/a (no probes)"


def _questions(scores: dict) -> str:
    q = scores.get("questions") or {}
    n, hit = q.get("n"), q.get("n_recalled")
    if n:
        return f"{hit} of {n} ({100 * hit / n:.0f}%)"
    return "n/a (no probes)"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _cell(text, limit: int = 120) -> str:
    """Markdown table cell: one line, pipes escaped, shortened."""
    text = " ".join(str(text or "").split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def model_card(info: dict) -> str:
    """README.md for every download of a job: what was trained, on what, how well, and how
    to load each file.

    `info` keys: base_model (display name), base_model_id (what `from_pretrained` should load
    on the user's machine), method, params (dict), documents (list of {name, sha256}),
    scores ({"before": eval dict, "after": eval dict, optionally "previous": the version an
    incremental job started from}), optional title, dataset (stats),
    notes (list of str).
    """
    from app.services.verdict import verdict

    method = info.get("method", "lora")
    title = info.get("title") or "Fine-tuned model"
    base = info.get("base_model", "unknown")
    base_id = info.get("base_model_id") or base
    params = info.get("params") or {}
    scores = info.get("scores") or {}
    before, after = scores.get("before") or {}, scores.get("after") or {}
    lines = [
        f"# {title}",
        "",
        "Made with DocTune on the user's own workstation: "
        + ("LoRA adapter training" if method == "lora" else "full fine-tuning")
        + f" of **{base}** on the documents listed below.",
    ]
    if after:
        v = verdict(before, after, params)
        lines += ["", f"**Verdict: {v.headline}**"]
        lines += [f"- {a}" for a in v.advice]
    lines += [
        "",
        "## Settings",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| base model | {base} |",
        f"| method | {method} |",
    ]
    for key in sorted(params):
        if key != "method":
            lines.append(f"| {key} | {_fmt(params[key], 6)} |")
    if info.get("dataset"):
        lines += [
            "",
            "Training data: "
            + ", ".join(
                f"{k} = {_fmt(v)}"
                for k, v in info["dataset"].items()
                if isinstance(v, int | float | str)
            )
            + ".",
        ]
    lines += [
        "",
        "## Source documents",
        "",
        "Version: the document's version in its project (an edited file is a new version);",
        "sha256: its content hash (the same file gives the same hash).",
        "",
        "| document | version | sha256 |",
        "| --- | --- | --- |",
    ]
    for doc in info.get("documents") or []:
        lines.append(f"| {_cell(doc['name'])} | {doc.get('version', 1)} | `{doc['sha256']}` |")
    lines += [
        "",
        "## Scores",
        "",
        "Same probes and held-out text before and after training, greedy decoding. Knowledge",
        "recall: facts from the documents asked as questions in the chat format, worded",
        "differently from any training example (and, second, as sentence completions); a",
        "probe counts when the answer contains the fact. Perplexity: on document text kept",
        "out of training (lower is better). Forgetting check: perplexity on a general-English",
        "sample shipped with DocTune.",
        "",
    ]
    # An incremental job also shows the version it started from, on the same probes.
    previous = scores.get("previous") or None
    sides = [before, after] + ([previous] if previous else [])
    head = "| score | before | after |" + (" previous version |" if previous else "")
    lines += [head, "| --- | --- | --- |" + (" --- |" if previous else "")]

    def row(label: str, fmt) -> str:
        return f"| {label} | " + " | ".join(fmt(side) for side in sides) + " |"

    if (after.get("questions") or {}).get("n"):
        lines.append(row("knowledge recall (questions)", _questions))
    lines += [
        row("knowledge recall (sentence completions)", _recall),
        row("held-out perplexity", lambda side: _fmt(side.get("perplexity"))),
    ]
    if (after.get("general") or {}).get("perplexity") is not None:
        lines.append(
            row(
                "forgetting check: general-text perplexity",
                lambda side: _fmt((side.get("general") or {}).get("perplexity")),
            )
        )
    qa_after = after.get("qa") or {}
    if (before.get("qa") or {}).get("n") or qa_after.get("n"):
        n = qa_after.get("n") or (before.get("qa") or {}).get("n")
        lines += [
            row(
                f"held-out questions: answer contains the reference ({n})",
                lambda side: _pct((side.get("qa") or {}).get("exact")),
            ),
            row(
                f"held-out questions: token F1 ({n})",
                lambda side: _pct((side.get("qa") or {}).get("f1")),
            ),
        ]
    items = (after.get("questions") or {}).get("items") or []
    if items:
        base_by = {
            (i.get("question"), i.get("answer")): i
            for i in (before.get("questions") or {}).get("items") or []
        }
        ordered = sorted(items, key=lambda i: (not i.get("hit"), i.get("question") or ""))
        lines += [
            "",
            "Side by side (five of the questions):",
            "",
            "| question | expected | base model | tuned model | source sentence |",
            "| --- | --- | --- | --- | --- |",
        ]
        for item in ordered[:5]:
            base_item = base_by.get((item.get("question"), item.get("answer")), {})
            lines.append(
                f"| {_cell(item.get('question'))} | {_cell(item.get('answer'), 60)} "
                f"| {_cell(base_item.get('output'), 80)} | {_cell(item.get('output'), 80)} "
                f"| {_cell(item.get('sentence'))} ({_cell(item.get('source'), 40)}) |"
            )
    for note in info.get("notes") or []:
        lines += ["", note]
    lines += _usage(method, base_id)
    return "\n".join(lines) + "\n"


def _usage(method: str, base_id: str) -> list[str]:
    lines = [
        "",
        "## Use it",
        "",
        "### transformers (the merged-model download)",
        "",
        "Needs `pip install transformers torch`.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'folder = "path/to/unzipped/merged"',
        "tokenizer = AutoTokenizer.from_pretrained(folder)",
        "model = AutoModelForCausalLM.from_pretrained(folder)",
        "",
        'messages = [{"role": "user", "content": "Your question"}]',
        "inputs = tokenizer.apply_chat_template(",
        '    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True',
        ")",
        "out = model.generate(**inputs, max_new_tokens=100)",
        'print(tokenizer.decode(out[0][inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
        "```",
    ]
    if method == "lora":
        lines += [
            "",
            "### peft (the adapter download)",
            "",
            "A few MB; needs `pip install peft` as well, and the base model:",
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            'folder = "path/to/unzipped/adapter"',
            f'base = AutoModelForCausalLM.from_pretrained("{base_id}")',
            "model = PeftModel.from_pretrained(base, folder)",
            "tokenizer = AutoTokenizer.from_pretrained(folder)",
            "# optional: fold the adapter into the weights for faster inference",
            "model = model.merge_and_unload()",
            "```",
        ]
    lines += [
        "",
        "### llama.cpp (the GGUF downloads)",
        "",
        "`-f16.gguf` is the model at 16-bit precision; `-q8_0.gguf` is about half the size",
        "and scores almost the same. The chat template is inside the file:",
        "",
        "```sh",
        "llama-cli -m model-q8_0.gguf -cnv --temp 0",
        "llama-server -m model-q8_0.gguf   # an OpenAI-compatible server on port 8080",
        "```",
        "",
        "### Ollama (the GGUF downloads)",
        "",
        "Unzip, then in that folder (the Modelfile sets the chat format and stop tokens):",
        "",
        "```sh",
        "ollama create my-docs-model -f Modelfile",
        "ollama run my-docs-model",
        "```",
        "",
        "transformers can read the GGUF too:",
        '`AutoModelForCausalLM.from_pretrained(folder, gguf_file="model-f16.gguf")`.',
    ]
    return lines


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
        # ValueError: the model is a fine value, just one that has no adapter.
        raise ValueError(  # noqa: TRY004
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
    worker.gguf_export)."""
    from worker.gguf_export import modelfile, write_gguf

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


# Every download a job can offer, in the order they are made.
KINDS = ("adapter", "merged", "gguf-f16", "gguf-q8_0")


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
    if isinstance(exc, OSError) and getattr(exc, "errno", None) == 28:
        return f"{label} could not be saved: the disk is full."
    if isinstance(exc, MemoryError):
        return f"{label} could not be made: the computer ran out of memory."
    detail = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return f"{label} could not be made: {detail}"
