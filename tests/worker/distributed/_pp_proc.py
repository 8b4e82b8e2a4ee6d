"""One stage of a pipeline-parallel run, started by torchrun (the tests launch it).

torchrun --standalone --nproc-per-node N -m tests.worker.distributed._pp_proc \\
    MODE SWAP OUT STEPS ROWS [--save-at K CKPT] [--resume CKPT]

MODE: full | tied | lora (a tiny Llama with 6 blocks; tied: its input and output embeddings
are one weight). Each rank trains its stage through PipelineTrainEngine on the same batches
(clipping on, two micro-batches); rank 0 writes the losses, the trained weights (gathered
from every stage) and the last stage's logits of the first batch before training to OUT
(torch.save), and the last stage the positions its output layer ran at in training to
OUT.head. --save-at K CKPT: a checkpoint after step K. --resume CKPT: start from it."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.offload._factories import make_batch, tiny_llama
from worker.training.engines import OffloadTrainEngine
from worker.training.pipelined import PipelineTrainEngine

LR, WD, CLIP = 1e-2, 0.1, 1.0
DEEP = {"num_hidden_layers": 6, "vocab_size": 128}
# Small enough that a stage's blocks stream (its whole training state does not fit).
STAGE_ACT = 800_000
BUDGET = {"full": (2_000_000, 700_000), "tied": (2_000_000, 700_000), "lora": (1_200_000, 700_000)}


def build(mode: str) -> torch.nn.Module:
    model = tiny_llama(seed=0, tie_word_embeddings=mode == "tied", **DEEP)
    if mode != "lora":
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, cfg)


def engine(mode: str, model, swap: str, steps: int, pipeline: bool):
    budget, act = BUDGET[mode]
    if pipeline:  # a stage holds every micro-batch's activations (GPipe): room for them
        budget, act = budget + STAGE_ACT, act + STAGE_ACT
    kind = PipelineTrainEngine if pipeline else OffloadTrainEngine
    return kind(model, learning_rate=LR, total_steps=steps, warmup_steps=1, weight_decay=WD,
                grad_clip=CLIP, grad_accum=2, budget_bytes=budget, swap_dir=swap,
                prefetch=1, activation_bytes=act)


def batches(steps: int, rows: int) -> list[dict]:
    return [make_batch(s, batch=rows, vocab=128) for s in range(steps)]


def trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def main(args: list[str]) -> None:
    mode, swap, out, steps, rows = args[0], args[1], args[2], int(args[3]), int(args[4])
    save_at = int(args[args.index("--save-at") + 1]) if "--save-at" in args else None
    ckpt = (args[args.index("--save-at") + 2] if save_at is not None
            else args[args.index("--resume") + 1] if "--resume" in args else None)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    try:
        eng = engine(mode, build(mode), f"{swap}/stage{rank}", steps, pipeline=True)
        assert eng.engine.streaming, "the stage's blocks should stream"
        data = batches(steps, rows)
        logits = eng.logits(data[0])
        start = 0
        if "--resume" in args:
            eng.load_checkpoint(Path(ckpt))
            start = eng.steps_done
        head_rows = []  # the positions the last stage's output layer runs at, per call
        if eng.last:
            eng.module.lm.lm_head.register_forward_hook(
                lambda _m, args, _out: head_rows.append(args[0].shape[:-1].numel()))
        losses = []
        for s in range(start, steps):
            losses.append(eng.step(data[s]))
            if save_at is not None and s + 1 == save_at:
                eng.save_checkpoint(Path(ckpt))
        weights = eng.trained_weights()
        tied_equal = None
        if mode == "tied":  # the two copies of the tied weight, after the last step
            world = dist.get_world_size()
            if eng.last:
                dist.send(eng.module.lm.lm_head.weight.detach().contiguous(), dst=0)
            if rank == 0:
                other = torch.empty_like(eng.module.lm.model.embed_tokens.weight)
                dist.recv(other, src=world - 1)
                tied_equal = torch.equal(other, eng.module.lm.model.embed_tokens.weight)
        if eng.last:
            torch.save({"head_rows": head_rows}, f"{out}.head")
        if eng.last and rank != 0:
            dist.send(logits.contiguous(), dst=0)
        if rank == 0:
            if logits is None:
                logits = torch.empty(rows, 16, 128)
                dist.recv(logits, src=dist.get_world_size() - 1)
            torch.save({"losses": losses, "weights": weights, "logits": logits,
                        "telemetry": eng.telemetry(), "tied_equal": tied_equal}, out)
        eng.close(restore_weights=False)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
