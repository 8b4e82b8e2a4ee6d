"""The model card (README.md) inside every download: base model, method and settings, the
source documents with their hashes, the whole score card with its verdict, and how to load
the file with transformers, peft, llama.cpp and Ollama.
"""

from __future__ import annotations


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
