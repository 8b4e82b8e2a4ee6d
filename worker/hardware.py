"""This machine's hardware as a worker registers it (app.contract.workers.Hardware): read from
the kernel's files and `nvidia-smi`, never through torch, because the registry runs in the
Celery parent process, whose pool children are forked from it (machine_profile.py's reason for
measuring in a child process)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

from app.contract.workers import Gpu, Hardware

NVIDIA_SMI_TIMEOUT_S = 10.0  # a hung driver must not hold up the worker's start


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name ("AMD EPYC 7763 64-Core Processor"); the platform's word for it
    where the kernel's file has none (another OS, some ARM boards)."""
    try:
        with open(cpuinfo) as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def meminfo_bytes(key: str, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The kernel's `meminfo` figure `key` ("MemTotal", "MemAvailable") in bytes, else None
    (no /proc/meminfo: another OS)."""
    try:
        with open(meminfo) as fh:
            for line in fh:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def ram_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    return meminfo_bytes("MemTotal", meminfo)


def parse_gpus(csv_text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits` lines, e.g.
    "NVIDIA H200, 143771" (MiB), as GPUs; a memory figure it cannot give ("[N/A]") is None."""
    found = []
    for line in csv_text.splitlines():
        name, _, memory = line.rpartition(",")
        if not name.strip():
            continue
        mib = memory.strip()
        memory_bytes = int(mib) * 2**20 if mib.isdigit() else None
        found.append(Gpu(name=name.strip(), memory_bytes=memory_bytes))
    return found


def gpus() -> list[Gpu]:
    """The NVIDIA GPUs the driver lists; none without nvidia-smi, or where it fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_gpus(out)


def detect() -> Hardware:
    return Hardware(cpu=cpu_model(), cores=os.cpu_count(), ram_bytes=ram_bytes(), gpus=gpus())
