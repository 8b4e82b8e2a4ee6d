"""A training run in its own process, for the kill-and-resume test.

python -m tests.offload._train_proc SWAP CKPT OUT STEPS EVERY [--resume] [--kill-at STEP]

Trains a tiny Llama through the engine (clipping on), checkpointing every EVERY steps.
--kill-at S: during step S's backward (block 1 is being recomputed: blocks above it are
already stepped and written) the process SIGKILLs itself. --resume: start from CKPT.
Writes the final weights and the losses to OUT (torch.save)."""

from __future__ import annotations

import os
import signal
import sys

import torch

from offload import AdamWConfig, OffloadConfig, OffloadEngine, find_blocks
from tests.offload._factories import make_batch, tiny_llama

LAYERS = 6


def train(
    swap: str, ckpt: str, steps: int, every: int, resume: bool = False, kill_at: int | None = None
) -> dict:
    torch.set_num_threads(1)
    model = tiny_llama(num_hidden_layers=LAYERS)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0),
        OffloadConfig(2_500_000, swap, prefetch=1, activation_bytes=900_000),
    )
    assert eng.streaming
    losses = {}
    if resume:
        extra = eng.load_checkpoint(ckpt)
        assert extra["step"] == eng.step_count
    for s in range(eng.step_count, steps):
        if s == kill_at:

            def die(module, args):
                if torch.is_grad_enabled():  # the backward's recompute of block 1
                    os.kill(os.getpid(), signal.SIGKILL)

            find_blocks(model)[1].mlp.register_forward_pre_hook(die)
        losses[s] = eng.step(make_batch(s))
        if (s + 1) % every == 0:
            eng.save_checkpoint(ckpt, extra={"step": s + 1})
    out = {"weights": eng.model_state_dict(), "losses": losses}
    eng.close()
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    kill = int(args[args.index("--kill-at") + 1]) if "--kill-at" in args else None
    result = train(args[0], args[1], int(args[3]), int(args[4]), "--resume" in args, kill)
    torch.save(result, args[2])
