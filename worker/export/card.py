"""The model card (README.md) inside every download: base model, method and settings, the
source documents with their hashes, the whole score card with its verdict, and how to load
the file with transformers, peft, llama.cpp and Ollama.
"""

from __future__ import annotations

from collections.abc import Callable

from app.contract.scores import Scores, Side, headline_kind, parse_scores
from app.contract.verdict import verdict


def _fmt(value, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _of(n: int, hit: int) -> str:
    return f"{hit} of {n} ({100 * hit / n:.0f}%)" if n else "n/a (no probes)"


def _recall(side: Side) -> str:
    return _of(*side.completion_counts())


def _questions(side: Side) -> str:
    return _of(*side.question_counts())


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _cell(text, limit: int = 120) -> str:
    """Markdown table cell: one line, pipes escaped, shortened."""
    text = " ".join(str(text or "").split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _header(info: dict, scores: Scores, params: dict) -> list[str]:
    """The title, what was trained, and the verdict when the job was scored."""
    method = info.get("method", "lora")
    lines = [
        f"# {info.get('title') or 'Fine-tuned model'}",
        "",
        "Made with DocTune on the user's own workstation: "
        + ("LoRA adapter training" if method == "lora" else "full fine-tuning")
        + f" of **{info.get('base_model', 'unknown')}** on the documents listed below.",
    ]
    if scores.after is not None and scores.after.measured:
        v = verdict(scores.before, scores.after, params)
        lines += ["", f"**Verdict: {v.headline}**"]
        lines += [f"- {a}" for a in v.advice]
    return lines


def _settings(info: dict, params: dict) -> list[str]:
    """The settings table and the training data's figures."""
    lines = [
        "",
        "## Settings",
        "",
        "| setting | value |",
        "| --- | --- |",
        f"| base model | {info.get('base_model', 'unknown')} |",
        f"| method | {info.get('method', 'lora')} |",
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
    return lines


def _documents(documents: list[dict]) -> list[str]:
    lines = [
        "",
        "## Source documents",
        "",
        "Version: the document's version in its project (an edited file is a new version);",
        "sha256: its content hash (the same file gives the same hash).",
        "",
        "| document | version | sha256 |",
        "| --- | --- | --- |",
    ]
    for doc in documents:
        lines.append(f"| {_cell(doc['name'])} | {doc.get('version', 1)} | `{doc['sha256']}` |")
    return lines


_SCORES_INTRO = [
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


def _score_table(scores: Scores) -> list[str]:
    """One row per measure, a column per side (before, after, and for an incremental job
    the version it started from, on the same probes)."""
    before, after = scores.before, scores.after or Side()
    previous = scores.previous if scores.previous and scores.previous.measured else None
    sides = [before, after] + ([previous] if previous else [])
    head = "| score | before | after |" + (" previous version |" if previous else "")
    lines = [head, "| --- | --- | --- |" + (" --- |" if previous else "")]

    def row(label: str, fmt: Callable[[Side], str]) -> str:
        return f"| {label} | " + " | ".join(fmt(side) for side in sides) + " |"

    if headline_kind(after) == "questions":
        lines.append(row("knowledge recall (questions)", _questions))
    lines += [
        row("knowledge recall (sentence completions)", _recall),
        row("held-out perplexity", lambda side: _fmt(side.perplexity)),
    ]
    if after.general.perplexity is not None:
        lines.append(
            row(
                "forgetting check: general-text perplexity",
                lambda side: _fmt(side.general.perplexity),
            )
        )
    if before.qa.n or after.qa.n:
        n = after.qa.n or before.qa.n
        lines += [
            row(
                f"held-out questions: answer contains the reference ({n})",
                lambda side: _pct(side.qa.exact),
            ),
            row(f"held-out questions: token F1 ({n})", lambda side: _pct(side.qa.f1)),
        ]
    return lines


def _side_by_side(before: Side, after: Side) -> list[str]:
    """Five of the questions, answered by the base model and the tuned one."""
    items = after.questions.items
    if not items:
        return []
    base_by = {(i.question, i.answer): i for i in before.questions.items}
    ordered = sorted(items, key=lambda i: (not i.hit, i.question))
    lines = [
        "",
        "Side by side (five of the questions):",
        "",
        "| question | expected | base model | tuned model | source sentence |",
        "| --- | --- | --- | --- | --- |",
    ]
    for item in ordered[:5]:
        base_item = base_by.get((item.question, item.answer))
        base_output = base_item.output if base_item else ""
        lines.append(
            f"| {_cell(item.question)} | {_cell(item.answer, 60)} "
            f"| {_cell(base_output, 80)} | {_cell(item.output, 80)} "
            f"| {_cell(item.sentence)} ({_cell(item.source, 40)}) |"
        )
    return lines


def model_card(info: dict) -> str:
    """README.md for every download of a job: what was trained, on what, how well, and how
    to load each file.

    `info` keys: base_model (display name), base_model_id (what `from_pretrained` should load
    on the user's machine), method, params (dict), documents (list of {name, sha256}),
    scores (app.contract.scores: {"before", "after", optionally "previous": the version an
    incremental job started from}), optional title, dataset (stats), notes (list of str).
    """
    params = info.get("params") or {}
    scores = parse_scores(info.get("scores"))
    lines = _header(info, scores, params) + _settings(info, params)
    lines += _documents(info.get("documents") or [])
    lines += _SCORES_INTRO + _score_table(scores)
    lines += _side_by_side(scores.before, scores.after or Side())
    for note in info.get("notes") or []:
        lines += ["", note]
    base_id = info.get("base_model_id") or info.get("base_model", "unknown")
    lines += _usage(info.get("method", "lora"), base_id)
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
