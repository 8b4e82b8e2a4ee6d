"""One rank of a training job on several processes: `python -m worker.distributed.rank SPEC`,
started by torchrun (worker/distributed/launch.py), which sets RANK, WORLD_SIZE, LOCAL_RANK
and the rendezvous.

Every rank loads the base model (in memory) and builds the recipe exactly as the job would in one
process, with the engine in data-parallel mode (it trains its share of each batch and the
gradients are summed across the ranks, offload/_parallel.py; rank 0 writes the checkpoints)
or in pipeline mode (it trains its stage, a range of the blocks; every stage writes its part
of the checkpoints, worker/training/pipelined.py). Rank 0 writes the progress lines; a
cancel seen by rank 0 is broadcast, so all ranks stop at the same step, after the
checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from worker.distributed.spec import RankSpec
from worker.training.continued import adapter_start, load_model_weights
from worker.training.recipe import Cancelled, EngineOptions, FineTuneRecipe, Hooks, TrainConfig

# How long a rank waits in a collective for the others before it gives up: a lost rank
# ends the job in minutes, not at gloo's default of half an hour.
COLLECTIVE_TIMEOUT = timedelta(minutes=3)


def _hooks(spec: RankSpec, rank: int) -> Hooks:
    """Rank 0 reports each step on a line of the progress file; every rank asks rank 0
    whether the job was cancelled (a broadcast, so all of them agree)."""

    def on_progress(info: dict) -> None:
        with open(spec.progress_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(info) + "\n")

    def should_cancel() -> bool:
        flag = torch.tensor([int(rank == 0 and (spec.cancel_path.exists() or _orphaned(spec)))])
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    return Hooks(on_progress=on_progress if rank == 0 else Hooks().on_progress,
                 should_cancel=should_cancel)


def _orphaned(spec: RankSpec) -> bool:
    """The job's process that started the ranks is gone."""
    if spec.parent_pid is None or spec.parent_host != socket.gethostname():
        return False
    try:
        os.kill(spec.parent_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's (a reused pid would be too: rare)
        return False
    return False


def _device(spec: RankSpec) -> torch.device:
    if spec.device != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def run(spec: RankSpec) -> None:
    device = _device(spec)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=COLLECTIVE_TIMEOUT)
    rank = dist.get_rank()
    try:
        torch.set_num_threads(max(1, spec.threads))
        config = TrainConfig.from_dict(spec.config)
        torch.manual_seed(config.seed)  # as the job seeds before loading
        # As worker.jobs.model_handle.InMemoryBaseModel loads it (ranks train in-memory bases).
        model = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=torch.float32)
        model = model.to(device)
        if spec.start_model is not None:
            load_model_weights(model, Path(spec.start_model))
        options = EngineOptions(
            budget_bytes=spec.budget_bytes, swap_dir=Path(spec.swap_root) / f"rank{rank}",
            weights_files=[Path(f) for f in spec.weights_files],
            device=str(device) if device.type == "cuda" else None,
            data_parallel=spec.parallel == "data",
            pipeline_parallel=spec.parallel == "pipeline",
        )
        start = adapter_start(Path(spec.start_adapter)) if spec.start_adapter else None
        recipe = FineTuneRecipe(model, spec.examples(), config, Path(spec.workdir),
                                _hooks(spec, rank), spec.pad_token_id, options,
                                start_weights=start)
        recipe.setup()
        try:  # the parent reloads the trained weights from the checkpoint
            recipe.train(keep_engine=True)
        except Cancelled:  # checkpoint written; the parent knows it asked for this
            pass
        finally:
            recipe.cleanup(restore=False)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    """The spec, with what a joining machine sets for itself (worker/distributed/launch.py's
    join_ranks): its local swap folder, its threads and memory per rank."""
    parser = argparse.ArgumentParser(prog="python -m worker.distributed.rank")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--swap-root")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--budget-bytes", type=int)
    args = parser.parse_args(argv)
    spec = RankSpec.read(args.spec)
    spec.swap_root = args.swap_root or spec.swap_root
    spec.threads = args.threads or spec.threads
    spec.budget_bytes = args.budget_bytes or spec.budget_bytes
    run(spec)


if __name__ == "__main__":
    main()
