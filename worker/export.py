"""Downloads a finished job offers: the LoRA adapter and the merged model, each one zip in
Hugging Face layout with a README.md model card.

Zips are streamed from files on disk (never built in memory) and appear atomically: written
as `<name>.tmp`, fsynced, renamed. Weights are stored uncompressed (they do not compress).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import zipfile
from pathlib import Path

import torch

from worker.base_model import make_config_portable, make_tokenizer_portable

STORED_SUFFIXES = {".safetensors", ".bin", ".gguf", ".pt"}


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


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def model_card(info: dict) -> str:
    """README.md for an export.

    `info` keys: base_model (display name), base_model_id (what `from_pretrained` should load
    on the user's machine), method, params (dict), documents (list of {name, sha256}),
    scores ({"before": eval dict, "after": eval dict}), optional title, dataset (stats),
    notes (list of str).
    """
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
    lines += ["", "## Source documents", "", "| document | sha256 |", "| --- | --- |"]
    for doc in info.get("documents") or []:
        lines.append(f"| {doc['name']} | `{doc['sha256']}` |")
    lines += [
        "",
        "## Scores",
        "",
        "Same probes and held-out text before and after training. Knowledge recall: share of",
        "facts from the documents the model completes correctly (greedy decoding). Perplexity:",
        "on document text kept out of training (lower is better).",
        "",
        "| score | before | after |",
        "| --- | --- | --- |",
        f"| knowledge recall | {_recall(before)} | {_recall(after)} |",
        (
            f"| held-out perplexity | {_fmt(before.get('perplexity'))} "
            f"| {_fmt(after.get('perplexity'))} |"
        ),
    ]
    qa_before, qa_after = before.get("qa") or {}, after.get("qa") or {}
    if qa_before.get("n") or qa_after.get("n"):
        n = qa_after.get("n") or qa_before.get("n")
        lines += [
            (
                f"| held-out questions: answer contains the reference ({n}) "
                f"| {_pct(qa_before.get('exact'))} | {_pct(qa_after.get('exact'))} |"
            ),
            (
                f"| held-out questions: token F1 ({n}) "
                f"| {_pct(qa_before.get('f1'))} | {_pct(qa_after.get('f1'))} |"
            ),
        ]
    for note in info.get("notes") or []:
        lines += ["", note]
    lines += [
        "",
        "## Use it",
        "",
        "Merged model (the merged-model download; needs `pip install transformers torch`):",
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
            "LoRA adapter (the adapter download, a few MB; needs `pip install peft`",
            "as well, and the base model):",
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
    return "\n".join(lines) + "\n"


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


def export_merged(model, tokenizer, out_zip: Path, card: str) -> Path:
    """The full model, adapter folded in, as a zip in Hugging Face layout (config.json,
    model.safetensors, generation_config.json, tokenizer files, README.md).

    A LoRA model is merged on a copy, so the model in memory keeps its adapter and its
    weights bit for bit (merging then unmerging in place would not: W + BA - BA != W in
    floating point). The copy costs one more model's worth of RAM.
    """
    from peft import PeftModel

    out_zip = Path(out_zip)
    out_zip.parent.mkdir(parents=True, exist_ok=True)
    merged = model
    if isinstance(model, PeftModel):
        merged = copy.deepcopy(model).merge_and_unload()
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out_zip.parent) as tmp:
        folder = Path(tmp)
        with torch.no_grad():
            merged.save_pretrained(folder)
        make_config_portable(folder)
        _save_tokenizer_and_card(tokenizer, folder, card)
        return _write_zip(folder, out_zip)
