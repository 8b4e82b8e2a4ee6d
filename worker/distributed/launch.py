"""Both sides of a run on several processes or machines (data parallel or a pipeline). The
job's side (`train_on_ranks`, `run_ranks`): start this machine's ranks with torchrun and ask
the free training workers of other machines to start theirs (TRAIN_RANKS_TASK on their node
queue: `join_ranks`), pass rank 0's progress on, ask the ranks to stop when the job is
cancelled, and when a rank or a machine is lost, say so and go on from the last checkpoint
with the machines that are left.

torchrun (torch.distributed.run, the elastic agent) starts the ranks, runs the c10d
rendezvous (hosted by the job's machine, at its address) and tears every rank down when one
of them dies (--max-restarts 0: the job decides what to do next, not the agent)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from app.contract.tasks import TRAIN_RANKS_TASK
from app.settings import settings
from worker.distributed.nodes import Peer, gloo_env, node_address
from worker.distributed.spec import RankSpec
from worker.errors import UserFacingError
from worker.training.recipe import Cancelled, FineTuneRecipe, Hooks
from worker.training.resources import auto_budget_bytes

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 1.0
STOP_GRACE_S = 30.0  # after SIGTERM, how long the agent gets to stop its ranks
# A lost rank or machine: the run starts again from the last checkpoint this many times.
RELAUNCHES = 2
# How long the rendezvous waits for every machine named to turn up.
JOIN_TIMEOUT_S = 300


def torchrun_command(spec_path: Path | str, nproc: int, *, nnodes: int = 1,
                     endpoint: str | None = None, run_id: str = "doctune",
                     local_addr: str | None = None, module: str = "worker.distributed.rank",
                     extra: list[str] | None = None) -> list[str]:
    """torchrun starting `nproc` ranks of `module` on this machine: standalone (a rendezvous
    of its own) for one machine; for `nnodes` machines, a c10d rendezvous at `endpoint`
    (host:port of the first node, which hosts it: that node passes its own address as
    `local_addr` and the others theirs, the address the ranks are reached at)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--max-restarts=0"]
    if nnodes == 1 and endpoint is None:
        cmd.append("--standalone")
    else:
        host = endpoint is not None and local_addr == endpoint.rsplit(":", 1)[0]
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={run_id}",
                f"--rdzv-conf=is_host={int(host)},join_timeout={JOIN_TIMEOUT_S}"]
        if local_addr:
            cmd.append(f"--local-addr={local_addr}")
    return [*cmd, "-m", module, str(spec_path), *(extra or [])]


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


def _env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": path, **(extra or {})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RanksFailed(Exception):
    """A rank (or a machine's ranks) stopped before the last step; the message says when."""


def _launch(spec: RankSpec, spec_path: Path, nproc: int, peers: list[Peer], run_id: str
            ) -> subprocess.Popen:
    """This machine's torchrun; with `peers`, the rendezvous at this machine's address and
    a TRAIN_RANKS_TASK to each peer's node queue."""
    out = open(spec.folder / "ranks.log", "ab")  # noqa: SIM115 - the child writes it
    try:
        if not peers:
            cmd, env = torchrun_command(spec_path, nproc), _env(spec.threads)
        else:
            from app.queue import celery_client

            addr = node_address()
            endpoint = f"{addr}:{_free_port()}"
            nnodes = 1 + len(peers)
            for peer in peers:
                celery_client.send_task(TRAIN_RANKS_TASK, queue=peer.queue,
                                        args=[str(spec_path), endpoint, run_id, nnodes])
            cmd = torchrun_command(spec_path, nproc, nnodes=nnodes, endpoint=endpoint,
                                   run_id=run_id, local_addr=addr)
            env = _env(spec.threads, gloo_env(addr))
        log.info("Training ranks: %s", " ".join(cmd))
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        out.close()


def _watch(spec: RankSpec, proc: subprocess.Popen, hooks: Hooks, last: dict | None
           ) -> tuple[dict | None, bool]:
    """Pass rank 0's progress on until the ranks exit; (the last progress, cancelled)."""
    pos, cancelled = spec.progress_path.stat().st_size if spec.progress_path.exists() else 0, False
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
    _, line = _forward(spec, pos, hooks)
    return line or last, cancelled


def run_ranks(spec: RankSpec, examples: list[dict], nproc: int, hooks: Hooks,
              peers: Callable[[], list[Peer]] | None = None, run_id: str = "doctune") -> None:
    """Train on `nproc` ranks here, and on the ranks of the machines `peers()` finds free,
    until the recipe's last step (its checkpoint holds the result). A lost rank or machine
    ends that run: the job says so and starts again from the last checkpoint with the
    machines free then, RELAUNCHES times at most. Raises Cancelled when the job is cancelled
    (the ranks stop after a checkpoint), UserFacingError when the ranks keep failing.

    A pipeline keeps its number of stages (its checkpoint has one part per stage): when
    fewer machines are free after a loss, this machine runs the missing stages."""
    try:
        _run_attempts(spec, examples, nproc, hooks, peers, run_id)
    finally:
        release = getattr(peers, "release", None)
        if release is not None:  # the other machines are free for other jobs again
            release()


def _run_attempts(spec: RankSpec, examples: list[dict], nproc: int, hooks: Hooks,
                  peers: Callable[[], list[Peer]] | None, run_id: str) -> None:
    if spec.parallel == "pipeline":  # every machine that joins runs as many ranks as this
        spec.node_ranks = spec.node_ranks or nproc
    spec_path = spec.write(examples)
    last, stages = None, None
    for attempt in range(RELAUNCHES + 1):
        found = peers() if peers is not None else []
        here = nproc
        if spec.parallel == "pipeline":
            if stages is None:
                stages = nproc + spec.node_ranks * len(found)
            found = found[: max(0, (stages - 1) // spec.node_ranks)]
            here = stages - spec.node_ranks * len(found)
        if attempt:
            hooks.on_phase("running", f"{_lost(last)}: continuing from the last checkpoint "
                           + (f"on {1 + len(found)} machines" if found else "on this machine"))
        else:
            hooks.on_phase("running", _training_on(here, 1 + len(found), spec.parallel,
                                                   stages))
        proc = _launch(spec, spec_path, here, found, f"{run_id}-{attempt}")
        last, cancelled = _watch(spec, proc, hooks, last)
        if proc.returncode == 0:
            if cancelled:
                raise Cancelled(f"Cancelled at {_step(last)}.")
            return
        tail = (spec.folder / "ranks.log").read_text(errors="replace")[-4000:]
        log.error("The training ranks failed (exit code %s):\n%s", proc.returncode, tail)
        if cancelled:
            raise Cancelled(f"Cancelled at {_step(last)}.")
    raise UserFacingError(
        f"{_lost(last)} {RELAUNCHES + 1} times, so the job stopped. Run it again: it continues "
        "from its last checkpoint. The worker's log has the details."
    )


def _training_on(nproc: int, machines: int, parallel: str = "data",
                 stages: int | None = None) -> str:
    if machines == 1:
        said = f"Training on {nproc} processes"
    elif nproc == 1:
        said = f"Training on {machines} machines"
    else:
        said = f"Training on {machines} machines, {nproc} processes on this one"
    return said + (f", a pipeline of {stages} stages" if parallel == "pipeline" else "")


def _step(last: dict | None) -> str:
    return f"step {last['step']} of {last['total_steps']}" if last else "its first step"


def _lost(last: dict | None) -> str:
    return f"A training process or machine was lost during {_step(last)}"


def choose_parallel(parallel: str, model, method: str, rank_budget: int, ranks: int,
                    batch_rows: int, seq_len: int) -> str:
    """"data" or "pipeline" for DOCTUNE_TRAIN_PARALLEL's `parallel`. "auto": a pipeline
    when the model's training state does not fit one rank's memory budget (each stage then
    pages only its own blocks instead of every rank paging the whole model) and the model
    can be cut into `ranks` stages; data parallel otherwise."""
    from offload import plan

    layers = getattr(getattr(model, "config", None), "num_hidden_layers", 0) or 0
    if parallel == "pipeline" and not 1 < ranks <= layers:
        raise UserFacingError(f"A pipeline of {ranks} stages needs at least {ranks} blocks; "
                              f"this model has {layers}. Set DOCTUNE_TRAIN_PARALLEL=data.")
    if parallel != "auto":
        return parallel
    if not 1 < ranks <= layers:
        return "data"
    try:
        fits = plan(model.config, rank_budget, 1.0, 1.0, batch_size=batch_rows, seq_len=seq_len,
                    mode="lora" if method == "lora" else "full").fits_in_memory
    except (AttributeError, TypeError, ValueError):  # not a shape the planner reads
        return "data"
    return "data" if fits else "pipeline"


def train_on_ranks(base, recipe: FineTuneRecipe, nproc: int, hooks: Hooks, *,
                   peers: Callable[[], list[Peer]] | None = None, run_id: str = "doctune",
                   start_adapter: Path | None = None, start_model: Path | None = None,
                   parallel: str = "auto") -> None:
    """Run `recipe`'s training on `nproc` ranks of this machine (and on the machines
    `peers()` finds), data parallel or as a pipeline (`parallel`, choose_parallel), before
    the job's own `recipe.setup()`, which then takes their last checkpoint. `base`: the
    job's in-memory base model handle (worker.jobs.model_handle.InMemoryBaseModel); this
    machine's memory budget and CPU threads are shared out between its ranks."""
    device = base.device
    budget = base.budget_bytes or auto_budget_bytes(base.model, device=device)
    cfg = recipe.config
    ranks = nproc * (1 + (len(peers()) if peers is not None else 0))
    parallel = choose_parallel(parallel, base.model, cfg.method, budget // nproc, ranks,
                               cfg.batch_size, cfg.max_seq_len)
    spec = RankSpec(
        model_dir=str(base.model_dir),
        weights_files=[str(f) for f in base.engine_options().weights_files],
        device="cuda" if base.cuda else "cpu", config=recipe.config.to_dict(),
        pad_token_id=recipe.pad_token_id, workdir=str(recipe.workdir),
        swap_root=str(Path(base.swap_dir) / "ranks"), budget_bytes=max(1, budget // nproc),
        threads=max(1, torch.get_num_threads() // nproc),
        start_adapter=str(start_adapter) if start_adapter else None,
        start_model=str(start_model) if start_model else None,
        parent_host=socket.gethostname(), parent_pid=os.getpid(), parallel=parallel,
    )
    run_ranks(spec, recipe.examples, nproc, hooks, peers, run_id)


def join_ranks(spec_path: str, endpoint: str, run_id: str, nnodes: int) -> int:
    """A machine's part of a job that trains on several (TRAIN_RANKS_TASK): its own ranks,
    with its own memory, threads and local swap folder, in the job's rendezvous; returns
    torchrun's exit code once the run ends (the job's machine handles what comes next)."""
    spec = RankSpec.read(Path(spec_path))
    nproc = spec.node_ranks or settings.train_processes  # a pipeline: as many as it was given
    addr = node_address()
    budget = (settings.offload_budget_mb << 20 if settings.offload_budget_mb
              else auto_budget_bytes(device=torch.device("cpu")))
    threads = max(1, (os.cpu_count() or 1) // nproc)
    swap = settings.swap_dir / f"ranks-{run_id}"
    extra = ["--swap-root", str(swap), "--threads", str(threads),
             "--budget-bytes", str(max(1, budget // nproc))]
    cmd = torchrun_command(spec_path, nproc, nnodes=nnodes, endpoint=endpoint, run_id=run_id,
                           local_addr=addr, extra=extra)
    log.info("Joining %s: %s", run_id, " ".join(cmd))
    try:
        with open(spec.folder / f"ranks-{socket.gethostname()}-{addr}.log", "ab") as out:
            return subprocess.run(cmd, cwd=ROOT, env=_env(threads, gloo_env(addr)), stdout=out,
                                  stderr=subprocess.STDOUT, check=False).returncode
    finally:
        shutil.rmtree(swap, ignore_errors=True)
