"""What a train worker leaves behind when it stops: nothing that goes on using the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from tests.conftest import ROOT, WorkerProcess, wait_for


def _measuring_child(parent: int) -> int | None:
    """The pid of `parent`'s child running `python -m worker.training.machine_profile`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"worker.training.machine_profile" in cmdline:
            return int(entry.name)
    return None


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait a while for PID 1 to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _when(predicate, timeout_s: float):
    """`predicate()` once true, polled every 2 ms (a disk probe lives about a second)."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.002)
    return value


def test_a_stopping_worker_ends_its_machine_measurement(redis_url, tiny_base_model, tmp_path):
    """`doctune up` stopped while its first start still measures the machine: the measurement
    runs in its own session (a signal to the worker's group does not reach it), so unless the
    worker ends it, it goes on using the cores after DocTune is gone."""
    data = tmp_path / "data"  # no profile here yet: the worker starts measuring when ready
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DOCTUNE_DATA_DIR": str(data)}
    env.pop("DATABASE_URL", None)
    subprocess.run(  # a database of its own: its start-up reconciling touches no other test's rows
        [sys.executable, "-c", "from app.migrate import upgrade_to_head; upgrade_to_head()"],
        cwd=ROOT, env=env, check=True, capture_output=True,
    )
    broker = urlsplit(redis_url)._replace(path="/11").geturl()  # and a queue of its own
    worker = WorkerProcess("measure", queues="train",
                           env={"DOCTUNE_DATA_DIR": str(data), "REDIS_URL": broker})
    child = None
    try:
        worker.start()
        child = wait_for(lambda: _measuring_child(worker.proc.pid), 60, "the measurement")
        probe = _when(lambda: list((data / "swap").glob(".probe-*")), 60)
        # Held still while its disk probe is on the disk (256 MiB being written and read), so it
        # is measuring when the worker stops however fast this machine is.
        os.kill(child, signal.SIGSTOP)
        assert probe and all(p.exists() for p in probe)
        worker.stop()  # SIGTERM, as `doctune up` stops its workers
        assert worker.proc.returncode == 0
        wait_for(lambda: not _running(child), 20, "the measurement to end with the worker")
    finally:
        worker.stop()
        if child is not None and _running(child):
            os.kill(child, signal.SIGKILL)
    assert list((data / "swap").glob(".probe-*")) == []  # it removed its probe on the way out
    assert not (data / "machine_profile.json").exists()  # stopped, not finished
