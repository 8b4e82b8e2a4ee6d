"""The reader box: every extraction runs in a child process with a memory limit
(`RLIMIT_AS`), a CPU limit (`RLIMIT_CPU`) and a wall-clock timeout, so a hostile file costs
at most those and the worker that asked survives whatever the reader does.

The child is `python -m worker.extract.sandbox PATH KIND MEMORY CPU`, started with
subprocess: a fresh interpreter that shares nothing with the Celery worker (its broker
sockets, database connections and threads stay in the parent). It sets its own limits
before it imports a reader or opens the file, and answers with one JSON object on a private
copy of its stdout: the `Extracted`, or the refusal in words. JSON, not pickle: the parent
never unpickles what a process that parsed hostile bytes wrote.

Why not multiprocessing (fork or forkserver, which measure 3-30 ms a file here against
about 90 ms for a fresh interpreter): a Celery prefork pool process is daemonic, and
multiprocessing refuses to start children from one ("daemonic processes are not allowed to
have children"); fork would also copy the worker's sockets and connections into the child,
and every multiprocessing start method but fork re-imports the caller's main module.

What a limit looks like from here: no answer, and the child killed by SIGXCPU (the CPU
limit) or by us (the wall clock); or the child's own report of a MemoryError (the memory
limit). Each becomes an ExtractionError saying which limit, in words. Any other death (a
crash in a C library) says that the reader stopped; the file is not retried.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from worker.extract.common import Extracted, ExtractionError, OutOfMemory

log = logging.getLogger(__name__)

# The folder that holds the `worker` package, for the child's import path.
_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class ReaderLimits:
    """What one file may cost: address space in bytes, CPU seconds, wall-clock seconds."""

    memory_bytes: int
    cpu_s: int
    timeout_s: float


def _duration(seconds: float) -> str:
    if seconds >= 120 and seconds % 60 == 0:
        return f"{seconds / 60:.0f} minutes"
    if seconds == 60:
        return "1 minute"
    return "1 second" if seconds == 1 else f"{seconds:g} seconds"


def _size(n_bytes: int) -> str:
    if n_bytes >= 2**30:
        return f"{n_bytes / 2**30:g} GB"
    return f"{n_bytes / 2**20:.0f} MB"


def too_slow(seconds: float) -> str:
    return (
        f"This file took longer than {_duration(seconds)} to read, so DocTune "
        "stopped reading it. If it is a genuine document, split it into smaller files, or "
        "save it again (or as PDF) and upload the copy."
    )


def too_big(limits: ReaderLimits) -> str:
    return (
        f"This file needed more than {_size(limits.memory_bytes)} of memory to read, so "
        "DocTune stopped reading it. If it is a genuine document, split it into smaller "
        "files, or save it again (or as PDF) and upload the copy."
    )


READER_CRASHED = (
    "The reader for this file stopped unexpectedly (something in the file broke it), so "
    "DocTune will not try it again. If the file opens on your computer, save it again (or as "
    "PDF) and upload the copy."
)


@dataclass(frozen=True)
class ReaderUsage:
    """What one reader child used: peak resident memory (the child's own VmHWM, which it
    reports in its answer; for a child killed before answering, the kernel's ru_maxrss, an
    upper bound: it also counts the parent's pages the child had between fork and exec),
    CPU seconds (user + system) and wall-clock seconds."""

    kind: str
    peak_rss_bytes: int
    cpu_s: float
    wall_s: float
    outcome: str  # "ok", "refused", "memory", "slow", "died"


def extract_boxed(
    path: Path, kind: str, limits: ReaderLimits, usage: list[ReaderUsage] | None = None
) -> Extracted:
    """`dispatch.extract(path, kind)` in a child process under `limits`. Raises
    ExtractionError (and nothing else) for a file that can't be used, a limit included. What
    the child used is logged (one "reader usage" line) and appended to `usage` if given."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "worker.extract.sandbox", str(path), kind,
               str(limits.memory_bytes), str(limits.cpu_s)]  # fmt: skip
    started = time.monotonic()
    child = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
        start_new_session=True,  # its own group: a kill reaches anything it started
    )  # fmt: skip
    try:
        answer, timed_out, rusage = _wait(child, started + limits.timeout_s)
    except BaseException:
        _kill(child)
        child.wait()
        raise
    elapsed, code = time.monotonic() - started, child.returncode
    slow = timed_out or code == -signal.SIGXCPU
    try:
        status, value = _parse(answer) if code == 0 and not slow else ("died", None)
    except (ValueError, TypeError, KeyError):
        status, value = "died", None
    outcome = "slow" if slow else status
    peak = _reported_peak(answer) if code == 0 else None
    if peak is None:
        peak = rusage.ru_maxrss * 1024 if rusage else 0
    _record(ReaderUsage(kind, peak,
                        rusage.ru_utime + rusage.ru_stime if rusage else 0.0, elapsed, outcome),
            path, usage)  # fmt: skip
    if slow:
        log.warning("reader of %s (%s) stopped after %.1f s (exit %s)", path, kind, elapsed, code)
        raise ExtractionError(too_slow(limits.timeout_s if timed_out else limits.cpu_s))
    if status == "ok":
        return value
    if status == "memory":
        log.warning("reader of %s (%s) ran out of memory after %.1f s", path, kind, elapsed)
        raise ExtractionError(too_big(limits))
    if status == "refused":
        raise ExtractionError(value)
    log.error("reader of %s (%s) died with exit code %s after %.1f s", path, kind, code, elapsed)
    raise ExtractionError(READER_CRASHED)


def _wait(child: subprocess.Popen, deadline: float) -> tuple[bytes, bool, object]:
    """The child's answer, whether the wall clock ran out (the child is then killed), and its
    resource usage: reaped with wait4 (which reports it) instead of Popen.wait (which drops
    it); its stdout is drained by a thread meanwhile so a long answer never blocks it."""
    chunks: list[bytes] = []
    drain = threading.Thread(target=lambda: chunks.append(child.stdout.read()), daemon=True)
    drain.start()
    timed_out, pause = False, 0.002
    while True:
        pid, status, rusage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() >= deadline:
            timed_out = True
            _kill(child)
            pid, status, rusage = os.wait4(child.pid, 0)
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    child.returncode = os.waitstatus_to_exitcode(status)
    drain.join(timeout=10)
    child.stdout.close()
    return b"".join(chunks), timed_out, rusage


def _record(used: ReaderUsage, path: Path, usage: list[ReaderUsage] | None) -> None:
    log.info("reader usage: kind=%s peak_rss_mb=%.1f cpu_s=%.2f wall_s=%.2f outcome=%s "
             "file=%s", used.kind, used.peak_rss_bytes / 2**20, used.cpu_s, used.wall_s,
             used.outcome, path.name)  # fmt: skip
    if usage is not None:
        usage.append(used)


def _kill(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reported_peak(answer: bytes) -> int | None:
    """The peak resident memory the child reported in its answer, if it did."""
    try:
        peak = json.loads(answer.decode("utf-8", "surrogatepass")).get("peak_rss_bytes")
    except (ValueError, AttributeError):
        return None
    return int(peak) if isinstance(peak, int) and peak >= 0 else None


def _own_peak_rss() -> int | None:
    """This process's peak resident memory since its exec (VmHWM of its own address space;
    getrusage's ru_maxrss would include the parent's pages from before the exec)."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _parse(answer: bytes) -> tuple[str, object]:
    """The child's JSON answer, checked for shape: ("ok", Extracted) or (status, message)."""
    data = json.loads(answer.decode("utf-8", "surrogatepass"))  # as the child encoded it
    status = data["status"]
    if status == "ok":
        pairs = [(str(q), str(a)) for q, a in data["qa_pairs"]]
        warnings = [str(w) for w in data["warnings"]]
        return status, Extracted(text=str(data["text"]), qa_pairs=pairs, warnings=warnings)
    if status in ("memory", "refused"):
        return status, str(data.get("message", ""))
    raise ValueError(f"unknown status {status!r}")


def _child(path: str, kind: str, memory_bytes: int, cpu_s: int) -> int:
    """The child: limits first, then the reader; one JSON answer on the saved stdout (the
    readers' own prints, if any, go to stderr)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # The soft limit sends SIGXCPU (which ends the process); the hard one is SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    try:
        from worker.extract.dispatch import extract

        try:
            result = extract(Path(path), kind)
            data = {"status": "ok", "text": result.text, "qa_pairs": result.qa_pairs,
                    "warnings": result.warnings}  # fmt: skip
        except OutOfMemory:
            data = {"status": "memory"}
        except ExtractionError as exc:
            data = {"status": "refused", "message": str(exc)}
        data["peak_rss_bytes"] = _own_peak_rss()
        answer = json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass")
    except MemoryError:  # tidying the text or encoding the answer: the same limit
        answer = b'{"status": "memory", "peak_rss_bytes": %d}' % (_own_peak_rss() or 0)
    with os.fdopen(answer_fd, "wb") as out:
        out.write(answer)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
