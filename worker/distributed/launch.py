"""The parent job's side of a data-parallel run: start the ranks with torchrun, pass their
progress on, ask them to stop when the job is cancelled, and say in words why they failed.

torchrun (torch.distributed.run, the elastic agent) starts the ranks, sets up the c10d
rendezvous and tears every rank down when one of them dies; with --max-restarts 0 a lost
rank ends the run and the job resumes from its last checkpoint (the recipe's), on what is
left, when it runs again."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from worker.distributed.spec import RankSpec
from worker.errors import UserFacingError
from worker.training.recipe import Cancelled, FineTuneRecipe, Hooks
from worker.training.resources import auto_budget_bytes

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 1.0
STOP_GRACE_S = 30.0  # after SIGTERM, how long the agent gets to stop its ranks


def torchrun_command(spec_path: Path, nproc: int, *, nnodes: int = 1,
                     endpoint: str | None = None, run_id: str = "doctune") -> list[str]:
    """torchrun starting `nproc` ranks on this machine: standalone (a rendezvous of its own)
    for one machine; a c10d rendezvous at `endpoint` (host:port of the first node) shared by
    `nnodes` machines otherwise."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--max-restarts=0"]
    if nnodes == 1 and endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}"]
    return [*cmd, "-m", "worker.distributed.rank", str(spec_path)]


def _forward(spec: RankSpec, pos: int, hooks: Hooks) -> tuple[int, dict | None]:
    """Hand rank 0's new progress lines to `hooks`; (new position, the last line)."""
    last = None
    try:
        with open(spec.progress_path, encoding="utf-8") as f:
            f.seek(pos)
            for line in f:
                if not line.endswith("\n"):  # being written: read it next time
                    break
                last = json.loads(line)
                hooks.on_progress(last)
                pos += len(line.encode("utf-8"))
    except FileNotFoundError:
        pass
    return pos, last


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_ranks(spec: RankSpec, examples: list[dict], nproc: int, hooks: Hooks) -> None:
    """Train on `nproc` ranks on this machine until the recipe's last step (its checkpoint
    holds the result). Raises Cancelled when the job is cancelled (the ranks stop after a
    checkpoint), UserFacingError when a rank fails."""
    spec_path = spec.write(examples)
    log_path = spec.folder / "ranks.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(spec.threads),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = torchrun_command(spec_path, nproc)
    log.info("Training on %d processes: %s", nproc, " ".join(cmd))
    pos, last, cancelled = 0, None, False
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                pos, line = _forward(spec, pos, hooks)
                last = line or last
                if not cancelled and hooks.should_cancel():
                    spec.cancel_path.touch()
                    cancelled = True
                time.sleep(POLL_S)
        finally:
            _stop(proc)
    pos, line = _forward(spec, pos, hooks)
    last = line or last
    step = f"step {last['step']} of {last['total_steps']}" if last else "its first step"
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        log.error("The training processes failed (exit code %s):\n%s", proc.returncode, tail)
        raise UserFacingError(
            f"A training process stopped during {step} (exit code {proc.returncode}), so "
            f"all {nproc} of them were stopped. Run the job again: it continues from its last "
            "checkpoint. The worker's log has the details."
        )
    if cancelled:
        raise Cancelled(f"Cancelled at {step}.")


def train_on_ranks(base, recipe: FineTuneRecipe, nproc: int, hooks: Hooks, *,
                   start_adapter: Path | None = None, start_model: Path | None = None) -> None:
    """Run `recipe`'s training on `nproc` data-parallel ranks of this machine, before the
    job's own `recipe.setup()`, which then resumes from their last checkpoint. `base`: the
    job's in-memory base model handle (worker.jobs.model_handle.InMemoryBaseModel); the
    memory budget and the CPU threads are shared out between the ranks."""
    device = base.device
    budget = base.budget_bytes or auto_budget_bytes(base.model, device=device)
    spec = RankSpec(
        model_dir=str(base.model_dir),
        weights_files=[str(f) for f in base.engine_options().weights_files],
        device="cuda" if base.cuda else "cpu", config=recipe.config.to_dict(),
        pad_token_id=recipe.pad_token_id, workdir=str(recipe.workdir),
        swap_root=str(Path(base.swap_dir) / "ranks"), budget_bytes=max(1, budget // nproc),
        threads=max(1, torch.get_num_threads() // nproc),
        start_adapter=str(start_adapter) if start_adapter else None,
        start_model=str(start_model) if start_model else None,
        parent_pid=os.getpid(),
    )
    hooks.on_phase("running", f"Training on {nproc} processes")
    run_ranks(spec, recipe.examples, nproc, hooks)
