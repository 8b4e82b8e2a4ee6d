"""Where a job computes and with how much: torch threads, the device (CPU, or CUDA when
asked for and present), and the offload engine's automatic memory budget.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from worker.errors import UserFacingError
from worker.hardware import meminfo_bytes


def configure_threads() -> int:
    """Use every core this process may run on for intra-op work, unless the user set
    OMP_NUM_THREADS. Returns the thread count in effect.

    On a 2-core box torch already picks 2; in containers and Celery children the default
    can be the host's core count, which oversubscribes and crawls.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        if torch.get_num_threads() != cores:
            torch.set_num_threads(max(1, cores))
    return torch.get_num_threads()


# -- the offload engine's memory budget ------------------------------------------------------

# Share of the free memory an automatic budget takes: the rest is for the OS, the tokenizer,
# evaluation and whatever else runs on the machine.
BUDGET_SHARE = 0.5


def available_memory_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable from the kernel's `meminfo` (what can be used without swapping), else
    None (no /proc/meminfo: another OS)."""
    return meminfo_bytes("MemAvailable", meminfo)


DEVICES = ("cpu", "cuda", "auto")


def job_device(setting: str = "cpu") -> torch.device:
    """Where a job computes: "cpu", "cuda" (refused in words without a usable GPU) or "auto"
    (the GPU when torch sees one)."""
    if setting not in DEVICES:
        raise UserFacingError(f"Unknown device {setting!r}; use one of {DEVICES}.")
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise UserFacingError(
            "DOCTUNE_DEVICE is cuda, but PyTorch sees no CUDA GPU on this machine (no driver, "
            "or a CPU-only build of torch). Set DOCTUNE_DEVICE=cpu, or auto."
        )
    return torch.device(setting)


def auto_budget_bytes(
    model: torch.nn.Module | None = None,
    share: float = BUDGET_SHARE,
    device: torch.device | None = None,
) -> int:
    """The engine's memory budget when none is configured: `share` of the free memory of
    `device`, else of the device the model is on (CUDA free memory, or the host's available
    RAM)."""
    if device is None and model is not None:
        device = next(iter(model.parameters())).device
    if device is not None and device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * share)
    free = available_memory_bytes()
    if free is None:  # no /proc: physical memory is the best guess left
        free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(free * share)
