"""A training step's matmul FLOPs, counted from the model's shape: the unit the timed run's
fit (worker/training/step_timing.py) and a job's ETA (worker/training/recipe.py) weigh steps
of different padded shapes by."""

from __future__ import annotations

import torch

from app.contract.machine_profile import step_flops

__all__ = ["head_flops", "matmul_flops", "step_flops"]


def matmul_flops(model: torch.nn.Module, method: str) -> tuple[float, float]:
    """(linear, attention): a step's matmul FLOPs per token are linear + attention * width."""
    config = model.config
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    params = {id(p): p.numel() for p in model.parameters()}
    weights = sum(params.values()) - embed.numel()  # a lookup, not a matmul
    weights += head.weight.numel() if head is not None else embed.numel()
    per_weight = 6.0 if method == "full" else 4.0
    attention = 12.0 * config.num_hidden_layers * config.hidden_size
    return per_weight * weights, attention


def head_flops(model: torch.nn.Module, method: str) -> float:
    """The output layer's share of matmul_flops' linear part, per position it runs at (only
    where the next token is a label: worker/training/engines.lm_loss_sum)."""
    head = model.get_output_embeddings()
    weight = head.weight if head is not None else model.get_input_embeddings().weight
    return (6.0 if method == "full" else 4.0) * weight.numel()
