"""Noisy embeddings while training (NEFTune: Jain et al. 2023, "NEFTune: Noisy Embeddings
Improve Instruction Finetuning"): uniform noise added to every input embedding of a
training step, scaled by alpha / sqrt(sequence length x embedding width), so that the
model cannot lean on the exact tokens of a practice question and has to lean on what it
means. The default LoRA job trains with it (app.contract.training NEFTUNE_ALPHA; README
"Noisy embeddings").

The noise is drawn from torch's generator, which the recipe seeds and its checkpoints
keep, only while the model trains (scoring in eval mode sees the clean embeddings), as
transformers' Trainer does with `neftune_noise_alpha`.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def noisy_embeddings(model, alpha: float):
    """`model`'s input embedding with NEFTune's noise of scale `alpha` on its output while
    the model is in training mode (nothing changes when `alpha` is 0)."""
    if not alpha:
        yield
        return
    import torch

    def add_noise(module, _inputs, output):
        if not module.training:
            return output
        scale = alpha / (output.size(1) * output.size(2)) ** 0.5
        return output + torch.empty_like(output).uniform_(-scale, scale)

    handle = model.get_input_embeddings().register_forward_hook(add_noise)
    try:
        yield
    finally:
        handle.remove()
