"""Noisy embeddings while training (NEFTune: Jain et al. 2023, "NEFTune: Noisy Embeddings
Improve Instruction Finetuning"): uniform noise added to every input embedding of a
training step, scaled by alpha / sqrt(sequence length x embedding width), so that the
model cannot lean on the exact tokens of a practice question and has to lean on what it
means. The default LoRA job trains with it (app.contract.training NEFTUNE_ALPHA; README
"Noisy embeddings while learning").

A row's noise is a function of the run's seed, the optimizer step and the row's own tokens
(its padding stripped), drawn on the CPU: the same whether the row is trained in one
process, on one rank of a data-parallel run (a share of the batch, padded to another
width), after a resume, or on a GPU. Its sequence length is the row's, not its batch's;
padding gets none. Only while the model trains: scoring in eval mode sees the clean
embeddings, as with transformers' Trainer `neftune_noise_alpha`.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable

import torch


def row_noise(ids: torch.Tensor, width: int, alpha: float, seed: int, step: int,
              pad_token_id: int | None) -> torch.Tensor:
    """The noise of one row of token ids, (len(ids), width) float32 on the CPU: uniform in
    +-alpha / sqrt(length x width) over the row's tokens up to its trailing padding, zero
    on the padding."""
    ids = ids.detach().to("cpu", torch.int64)
    length = len(ids)
    if pad_token_id is not None:
        while length and int(ids[length - 1]) == pad_token_id:
            length -= 1
    out = torch.zeros(len(ids), width)
    if not length:
        return out
    key = hashlib.blake2b(ids[:length].numpy().tobytes(), digest_size=8,
                          key=f"{seed}:{step}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    scale = alpha / (length * width) ** 0.5
    out[:length] = torch.empty(length, width).uniform_(-scale, scale, generator=gen)
    return out


@contextlib.contextmanager
def noisy_embeddings(model, alpha: float, seed: int = 0, step_of: Callable[[], int] = lambda: 0,
                     pad_token_id: int | None = None):
    """`model`'s input embedding with NEFTune's noise of scale `alpha` on its output while
    the model is in training mode, each row's drawn from (`seed`, `step_of()`, its tokens).
    Nothing changes when `alpha` is 0, nor on a pipeline stage without the embedding."""
    embedding = model.get_input_embeddings() if alpha else None
    if embedding is None:
        yield
        return

    def add_noise(module, inputs, output):
        if not module.training:
            return output
        ids = inputs[0].reshape(-1, output.size(-2))
        step = step_of()
        noise = torch.stack([row_noise(row, output.size(-1), alpha, seed, step, pad_token_id)
                             for row in ids]).reshape(output.shape)
        return output + noise.to(output.device, output.dtype)

    handle = embedding.register_forward_hook(add_noise)
    try:
        yield
    finally:
        handle.remove()
