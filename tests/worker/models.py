"""The one factory of the tests' tiny Llama models (and the experiments' random ones).

A Llama-shaped model with random weights and a real tokenizer's vocabulary: trains and
generates in milliseconds, yet goes through the same code paths as the real model. Built in
memory (`tiny_llama`) or saved as an ordinary Hugging Face folder with its tokenizer
(`save_tiny_model`: the app tests' DOCTUNE_BASE_MODEL, the training tests' model folder).
Seeded without touching the caller's RNG stream.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

from worker.training.base_model import (
    make_config_portable,
    make_tokenizer_portable,
    save_embedded_tokenizer,
)

# The tiny shape: 2 blocks of 64 wide, grouped-query attention (4 heads, 2 KV heads).
TINY_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}


def tiny_config(tokenizer, **overrides) -> LlamaConfig:
    """TINY_SHAPE (with `overrides`) over `tokenizer`'s vocabulary and special tokens; the
    pad token falls back to EOS."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return LlamaConfig(
        **(
            TINY_SHAPE
            | {
                "vocab_size": len(tokenizer),
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "pad_token_id": pad,
            }
            | overrides
        )
    )


def tiny_llama(tokenizer, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A float32 tiny Llama in memory, weights drawn from `seed`, in eval mode."""
    config = tiny_config(tokenizer, **overrides)
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays untouched
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    return model.eval()


def save_tiny_model(
    out_dir: Path, tokenizer_dir: Path | None = None, seed: int = 0, **overrides
) -> Path:
    """A tiny Llama (`overrides` on TINY_SHAPE) with the tokenizer of `tokenizer_dir` (the
    embedded GGUF's, ~7 s, when None), saved to `out_dir` as a model folder that loads in
    transformers 4.x too."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        tokenizer_dir = save_embedded_tokenizer(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_llama(tokenizer, seed, **overrides)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    model.save_pretrained(out_dir)
    make_config_portable(out_dir)
    if Path(tokenizer_dir) != out_dir:
        tokenizer.save_pretrained(out_dir)
    make_tokenizer_portable(out_dir)
    return out_dir


def save_tiny_adapter(model_dir: Path, out_zip: Path, seed: int = 1, rank: int = 4) -> Path:
    """A LoRA adapter on the saved tiny model in `model_dir`, as a version's adapter.zip
    (worker/export export_adapter). Both LoRA matrices are drawn from `seed` (peft starts
    B at zero, which would change nothing), so the adapter visibly changes the outputs."""
    from peft import LoraConfig, get_peft_model

    from worker.export.writers import export_adapter

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                        lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5)
    return export_adapter(peft_model, tokenizer, out_zip, "A tiny test adapter.")
