"""One rank of the inference comparison (`make bench-cluster`, and the tests): a Llama-shaped
model built from a config (the same random weights on every rank: one seed) answering a
batch of prompts greedily, in one process, tensor parallel or pipeline parallel
(worker/distributed/inference.py). Run by torchrun for tp and pp; rank 0 writes the results.

    python -m scripts.cluster_infer --mode single|tp|pp --size tiny|small|large \\
        [--batches 1,2,4,8,16] [--prompt 16] [--new 8] --out FILE
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from worker.distributed.inference import PipelineStage, greedy, split_tensor_parallel

# SmolLM2-135M's 9 query and 3 key/value heads do not split in two: Llama shapes that do.
SIZES = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
    "small": {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000},
    "large": {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000},
}


def build(size: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES[size], max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "tp", "pp"], required=True)
    ap.add_argument("--size", choices=list(SIZES), required=True)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--micro", type=int, default=0,
                    help="PP micro-batches per batch (0: one per stage, the fewest that overlap)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = 0, 1
    if args.mode != "single":
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
        rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args.size)
    n_params = params(model)
    stage = None
    if args.mode == "tp":
        split_tensor_parallel(model, rank, world)
    elif args.mode == "pp":
        stage = PipelineStage(model, rank, world)
    vocab = model.config.vocab_size
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        gen = torch.Generator().manual_seed(batch)
        ids = torch.randint(0, vocab, (batch, args.prompt), generator=gen)
        if stage is None:
            if world > 1:
                dist.barrier()
            tokens, first_s, rest_s = greedy(model, ids, args.new)
            bubble = None
        else:
            dist.barrier()
            stage.clock.compute_s = stage.clock.wait_s = 0.0
            tokens, first_s, rest_s = stage.greedy(ids, args.new, micro=min(batch, args.micro or world))
            bubble = stage.clock.bubble  # the first stage's share of time spent waiting
        if rank == 0:
            rows.append({"batch": batch, "ttft_s": round(first_s, 4),
                         "tokens_per_s": round(batch * (args.new - 1) / rest_s, 2) if rest_s else None,
                         "bubble": None if bubble is None else round(bubble, 3),
                         "tokens": tokens.tolist()})
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"mode": args.mode, "size": args.size, "params": n_params,
                       "world": world, "rows": rows}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
