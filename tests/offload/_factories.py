"""Tiny Llama models, deterministic batches, and the plain-torch reference training loop."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 256


def tiny_config(**overrides) -> LlamaConfig:
    kw = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
    }
    kw.update(overrides)
    return LlamaConfig(**kw)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides))


def make_batch(step: int, batch: int = 2, seq: int = 16, vocab: int = VOCAB) -> dict:
    """Batch number `step`: random tokens, one padded row, prompt tokens masked in labels."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if batch > 1:
        mask[1, -3:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[:, :2] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def summed_loss(model, batch) -> torch.Tensor:
    """Summed next-token cross-entropy (the recipe's loss; divided by a token count)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    shift = logits[:, :-1, :].float()
    return F.cross_entropy(
        shift.reshape(-1, shift.size(-1)),
        batch["labels"][:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


def n_label_tokens(batch) -> int:
    return max(1, int((batch["labels"][:, 1:] != -100).sum()))


def reference_adamw(model, lr: float, weight_decay: float, no_decay_1d: bool = False):
    params = [p for p in model.parameters() if p.requires_grad]
    if not no_decay_1d:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def reference_step(model, opt, batch, clip=None, micro_batches=1, loss="hf") -> float:
    """One plain in-memory step: the arithmetic the engine must reproduce."""
    n = batch["input_ids"].shape[0]
    size = math.ceil(n / micro_batches)
    denom = n_label_tokens(batch)
    total = 0.0
    for s in range(0, n, size):
        micro = {k: v[s : s + size] for k, v in batch.items()}
        if loss == "hf":
            out = model(**micro, use_cache=False).loss
        else:
            out = summed_loss(model, micro) / denom
        out.backward()
        total += out.item()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def state_bytes(model) -> int:
    """Training state of a full fine-tune: weights, gradients, Adam m and v."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def assert_same_weights(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    unequal = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not unequal, f"{len(unequal)} tensors differ, e.g. {unequal[:3]}"
