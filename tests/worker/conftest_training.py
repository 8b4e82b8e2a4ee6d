"""Helpers for the training-side tests (recipe, export, pipeline, base model).

Not a conftest pytest loads by itself: test modules import `tiny_model_dir` and wrap it in a
fixture. The tiny model is built once per test session (under pytest's base temp dir) from
the `smol_tokenizer` of tests/worker/conftest.py, so it costs well under a second.
"""

from __future__ import annotations

from pathlib import Path

from tests.worker.models import save_tiny_model

_BUILT: dict[str, Path] = {}

# Repetitive text with distinctive facts: a tiny model can learn it in a few epochs.
FACTS = (
    "The Zorblax invoice code for project Heron is ZX-4471. "
    "Payments to Heron are due on the 15th of each month. "
    "The Heron project manager is Ada Quist, reachable on extension 5512. "
)


def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A saved tiny random Llama (seed 0) with SmolLM2's tokenizer; built once a session."""
    if "tiny" not in _BUILT:
        root = tmp_path_factory.mktemp("training-models")
        tok_dir = root / "tokenizer"
        smol_tokenizer.save_pretrained(tok_dir)
        _BUILT["tiny"] = save_tiny_model(root / "tiny", tokenizer_dir=tok_dir, seed=0)
    return _BUILT["tiny"]


def text_examples(tokenizer, n: int = 9, text: str = FACTS * 8) -> list[dict]:
    """`n` causal-LM examples of varied length (12..28 tokens) cut from `text`."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    examples = []
    for i in range(n):
        start = (i * 11) % max(1, len(ids) - 28)
        chunk = ids[start : start + 12 + (i * 7) % 17]
        examples.append({"input_ids": chunk, "labels": list(chunk)})
    return examples
