"""One rank of a data-parallel run, started by torchrun (the test launches it).

torchrun --standalone --nproc-per-node N -m tests.offload._dp_proc MODE SWAP OUT STEPS ROWS
    [--other-seed-on-rank R]

MODE: full | lora. Each rank trains a tiny Llama through the engine with data_parallel on
its share of the same batches (clipping on) and rank 0 writes the losses and final weights
to OUT (torch.save). --other-seed-on-rank R: rank R builds its model from another seed."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from offload import AdamWConfig, OffloadConfig, OffloadEngine, batch_share
from tests.offload._factories import make_batch, tiny_llama

LR, WD, CLIP = 1e-2, 0.1, 1.0
DEEP = {"num_hidden_layers": 6, "vocab_size": 128}
# Small enough that the blocks stream (LoRA's frozen base is read-only and smaller).
BUDGET = {"full": (2_500_000, 900_000), "lora": (1_200_000, 700_000)}


def build(mode: str, seed: int = 0) -> torch.nn.Module:
    model = tiny_llama(seed=seed, **DEEP)
    if mode == "full":
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1 + seed)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, cfg)


def engine(mode: str, model, swap: str, parallel: bool) -> OffloadEngine:
    budget, act = BUDGET[mode]
    return OffloadEngine(
        model,
        AdamWConfig(lr=LR, weight_decay=WD, max_grad_norm=CLIP),
        OffloadConfig(budget, swap, prefetch=1, activation_bytes=act, data_parallel=parallel),
    )


def batches(steps: int, rows: int) -> list[dict]:
    return [make_batch(s, batch=rows, vocab=128) for s in range(steps)]


def main(args: list[str]) -> None:
    mode, swap, out, steps, rows = args[0], args[1], args[2], int(args[3]), int(args[4])
    other = int(args[args.index("--other-seed-on-rank") + 1]) if "--other-seed-on-rank" in args else -1
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        eng = engine(mode, build(mode, seed=1 if rank == other else 0), f"{swap}/rank{rank}", True)
        assert eng.streaming and eng.world_size == world
        losses = [eng.step(batch_share(b, rank, world)) for b in batches(steps, rows)]
        if rank == 0:
            torch.save({"losses": losses, "weights": eng.model_state_dict()}, out)
        eng.close()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
