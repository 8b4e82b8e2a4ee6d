"""How fast this machine trains: measured once by the training worker, read by the web app.

The web app must not import torch or offload, yet the Train button should say how long a job
will take. So the worker measures the machine (disk read/write with the offload engine's own
I/O path on the swap folder, CPU matmul speed), runs `offload.plan` for the configured base
model, LoRA and full fine-tuning, at a reference batch, and writes the result as JSON to
`settings.machine_profile_path` (temp file + rename). app/services/planner.py scales it to a
project's corpus.

`python -m worker.training.machine_profile` measures and writes the file; the worker starts it in a
child process when it comes up (`start_measuring`), so the measurement neither delays the
worker nor leaves torch threads in the Celery parent that later forks pool children.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from app.contract.machine_profile import FORMAT as PROFILE_FORMAT
from app.contract.machine_profile import checked_profile
from app.contract.machine_profile import is_current as profile_is_current
from app.contract.training import LORA_MODULES
from app.settings import settings
from worker.files import write_json_atomic

log = logging.getLogger(__name__)

DISK_MIB = 256  # enough to get past the disk's write cache; about a second on an SSD
# Real training runs at a fraction of the matmul rate (attention, norms, softmax over the
# vocabulary, the optimizer): SmolLM2-135M LoRA steps at 4 x 256 tokens through the engine
# ran at 0.49 of the rate measure_flops() gave in the same process (2-core CPU).
COMPUTE_EFFICIENCY = 0.5


def measure_disk(directory: Path, mib: int = DISK_MIB) -> dict:
    """Write then read `mib` MiB in `directory` the way the offload engine does."""
    from offload.bench import disk_bench

    probe = Path(directory) / f".probe-{os.getpid()}"
    try:
        return disk_bench(str(probe), mib, threads=4)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def measure_flops(size: int = 1024, repeats: int = 5) -> float:
    """Sustained fp32 matmul FLOP/s with the threads training uses (the median of a few)."""
    import torch

    from worker.training.resources import configure_threads

    configure_threads()
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up: thread pool, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * size**3 / sorted(times)[len(times) // 2]


def lora_params(config, rank: int, modules: str = "all") -> int:
    """Adapter parameters of rank `rank` on the projections `modules` names
    (app.contract.training.LORA_MODULES) of every block."""
    h, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * (h // heads)
    fan = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
           "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    per_block = sum(rank * sum(fan[n]) for n in LORA_MODULES[modules])
    return per_block * config.num_hidden_layers


# Forwards a streamed base model takes to be scored once (worker/scoring/evaluate.py: 24 + 48 + 24
# generated tokens, a prefill for each, a few perplexity batches) and for the replay
# answers (96 tokens): each forward reads every block from the disk.
SCORING_FORWARDS = 110
REPLAY_FORWARDS = 100


def streamed_base(model_dir: str, read_gbps: float, stream: str = "auto") -> dict:
    """Whether a job streams this base model (worker/training/streamed.py) and, if so, about how long
    scoring it before and after training (and the replay answers) takes from the disk."""
    from worker.training.base_model import fp32_load_bytes
    from worker.training.streamed import should_stream

    folder = Path(model_dir)
    if not folder.is_dir():
        return {"fp32_bytes": None, "streams": False, "scoring_s": 0.0}
    fp32 = fp32_load_bytes(folder)
    streams = should_stream(folder, stream)
    forwards = 2 * SCORING_FORWARDS + REPLAY_FORWARDS
    seconds = forwards * fp32 / (read_gbps * 1e9) if streams and read_gbps > 0 else 0.0
    return {"fp32_bytes": fp32, "streams": streams, "scoring_s": seconds}


def build_profile(
    model_dir: str,
    swap_dir: Path,
    budget_bytes: int,
    *,
    disk_mib: int = DISK_MIB,
    base_model: str = "",
    stream: str = "auto",
    time_model: bool = True,
    device: str = "cpu",
) -> dict:
    """Measure this machine and plan LoRA and full fine-tuning of `model_dir` on it; with
    `time_model`, time a few optimizer steps of the real model for each method too, and
    scoring's shapes, on `device` ("cpu" or "cuda": where jobs compute)."""
    import torch
    from transformers import AutoConfig

    from offload import plan
    from worker.training.recipe import TrainConfig
    from worker.training.step_timing import general_forwards, time_scoring, time_steps

    disk = measure_disk(swap_dir, disk_mib)
    flops = measure_flops()
    config = AutoConfig.from_pretrained(model_dir)
    ref = TrainConfig()
    read, write = disk["read_gbps"], disk["write_gbps"]
    effective = COMPUTE_EFFICIENCY * flops
    methods = {}
    for method in ("lora", "full"):
        # LoRA only reads (the frozen base); full fine-tuning reads and writes alike.
        gbps = read if method == "lora" else 2 / (1 / read + 1 / write)
        p = plan(
            config,
            budget_bytes,
            disk_gbps=gbps,
            flops=effective,
            batch_size=ref.batch_size,
            seq_len=ref.max_seq_len,
            mode=method,
            clip=bool(ref.grad_clip),
            lora_params=(
                lora_params(config, ref.lora_rank, ref.lora_modules) if method == "lora" else 0
            ),
        )
        methods[method] = {k: (v if v != float("inf") else None) for k, v in p.to_dict().items()}
    base = streamed_base(model_dir, read, stream)
    timed = time_model and not base["streams"]  # a streamed model: too slow to time here
    on = torch.device(device)
    steps = time_steps(model_dir, budget_bytes, Path(swap_dir), device=on) if timed else {}
    scoring = (
        time_scoring(model_dir, device=on) | {"general_forwards": general_forwards()}
        if timed
        else None
    )
    return checked_profile({  # the shape the web app reads (app.contract.machine_profile)
        "format": PROFILE_FORMAT,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "base_model": base_model,
        "device": device,
        "budget_bytes": int(budget_bytes),
        "disk": {
            "read_gbps": read,
            "write_gbps": write,
            "o_direct": disk["o_direct"],
            "bytes": disk["bytes"],
        },
        "cpu": {"matmul_flops": flops, "compute_efficiency": COMPUTE_EFFICIENCY},
        "reference": {"batch_size": ref.batch_size, "seq_len": ref.max_seq_len},
        "methods": methods,
        "base": base,
        "steps": steps,
        "scoring": scoring,
    })


def profile_device() -> str:
    """Where a job computes now, "cpu" or "cuda" (DOCTUNE_DEVICE; "auto" asks torch)."""
    from worker.training.resources import job_device

    return job_device(settings.device).type


def current_budget_bytes(device: str = "cpu") -> int:
    """The budget a job would get now (the setting, or half of the free memory of the
    job's device)."""
    if settings.offload_budget_mb:
        return settings.offload_budget_mb * 2**20
    import torch

    from worker.training.resources import auto_budget_bytes

    return auto_budget_bytes(device=torch.device(device))


def is_current(path: Path | None = None, device: str | None = None) -> bool:
    """A profile exists for this base model and format, timed on `device` (None: any; the
    budget may drift, fine)."""
    path = path or settings.machine_profile_path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not profile_is_current(data, settings.base_model):
        return False
    return device is None or data.get("device", "cpu") == device


def measure_and_write(path: Path | None = None, disk_mib: int = DISK_MIB) -> dict | None:
    """Measure and write the profile, unless another process is at it (then None)."""
    from worker.training.base_model import resolve_base_model

    path = path or settings.machine_profile_path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return None
        model_dir = resolve_base_model(settings.base_model, settings.models_dir)
        device = profile_device()
        profile = build_profile(
            model_dir,
            settings.swap_dir,
            current_budget_bytes(device),
            disk_mib=disk_mib,
            base_model=settings.base_model,
            stream=settings.stream_base_model,
            device=device,
        )
        write_json_atomic(path, profile)
    return profile


def start_measuring() -> subprocess.Popen | None:
    """Measure in a child process unless a current profile exists; returns the process.
    With DOCTUNE_DEVICE=auto and an NVIDIA device node, only torch can tell where jobs will
    compute: the child is started, and ends at once when the profile is current."""
    known = settings.device if settings.device in ("cpu", "cuda") else None
    if known is None and not any(Path("/dev").glob("nvidia[0-9]*")):
        known = "cpu"  # no NVIDIA GPU on this machine: "auto" is the CPU (torch not imported)
    if known is not None and is_current(device=known):
        return None
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, "-m", "worker.training.machine_profile"],
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop_measuring(child: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """End a measurement `start_measuring` started, when the worker stops: it would go on
    using the cores after `doctune up` is gone. SIGTERM first (its own session: the signal
    reaches its group), so it removes its probe file (see `main`); SIGCONT with it, so a
    stopped child gets it too; SIGKILL if it is not gone in `grace_s`."""
    if child is None or child.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGCONT):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _exit_on_sigterm(signum, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds: the probe file and temp file are removed


def main() -> None:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    os.nice(5)  # a training job on the same machine comes first
    started = time.perf_counter()
    if is_current(device=profile_device()):
        log.info("This machine's profile is current.")
        return
    profile = measure_and_write()
    if profile is None:
        log.info("Another process is measuring this machine.")
        return
    log.info(
        "Measured this machine in %.1f s: disk read %.2f GB/s, write %.2f GB/s, %.0f GFLOP/s.",
        time.perf_counter() - started,
        profile["disk"]["read_gbps"],
        profile["disk"]["write_gbps"],
        profile["cpu"]["matmul_flops"] / 1e9,
    )


if __name__ == "__main__":
    main()
