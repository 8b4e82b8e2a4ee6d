"""The worker registry (worker/registry.py) against the migrated test database, and the
hardware a worker reports (worker/hardware.py) from real files and a real nvidia-smi stand-in.
A real Celery worker registering itself is in tests/worker/cli/test_join.py."""

from __future__ import annotations

import os
import platform
import socket
import stat
import threading
import uuid

import pytest
from sqlalchemy import select

from app.contract.workers import Gpu, Hardware
from app.db import session_scope
from app.models import Worker
from tests.conftest import wait_for
from worker import hardware, registry


def _row(node: str) -> Worker | None:
    with session_scope() as session:
        return session.scalar(select(Worker).where(Worker.node == node))


@pytest.fixture
def node(migrated_db):
    name = f"train@test-{uuid.uuid4().hex[:8]}"
    yield name
    registry.stop(name)
    with session_scope() as session:
        session.query(Worker).filter(Worker.node == name).delete()


def test_a_worker_registers_this_machine_and_a_restart_rewrites_its_row(node):
    registry.register(node, ["train", "node.x"])
    first = _row(node)
    assert first.host == socket.gethostname() and first.queues == ["node.x", "train"]
    assert first.version == registry.doctune_version() != ""
    found = Hardware.model_validate(first.hardware)
    assert found.cores == os.cpu_count() and found == hardware.detect()
    assert first.stopped_at is None and first.started_at == first.last_seen_at

    registry.mark_stopped(node)
    assert _row(node).stopped_at is not None
    registry.register(node, ["train"])  # the same node started again
    again = _row(node)
    assert again.id == first.id and again.stopped_at is None and again.queues == ["train"]
    assert again.started_at >= first.started_at


def test_the_heartbeat_refreshes_the_row_until_the_worker_stops(node):
    registry.start(node, ["train"], every_s=0.05)
    started = _row(node).last_seen_at
    wait_for(lambda: _row(node).last_seen_at > started, 10, "a heartbeat")
    registry.stop(node)
    stopped = _row(node)
    assert stopped.stopped_at is not None and stopped.last_seen_at == stopped.stopped_at
    wait_for(lambda: not any(t.name == f"registry heartbeat {node}"
                             for t in threading.enumerate()), 5, "the heartbeat thread to end")
    registry.stop(node)  # a second stop (a signal sent twice) changes nothing
    assert _row(node).stopped_at == stopped.stopped_at


def test_cpu_and_memory_come_from_the_kernels_files(tmp_path):
    cpuinfo, meminfo = tmp_path / "cpuinfo", tmp_path / "meminfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                       "model name\t: AMD EPYC 7763 64-Core Processor\nprocessor\t: 1\n")
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree:         1000000 kB\n")
    assert hardware.cpu_model(cpuinfo) == "AMD EPYC 7763 64-Core Processor"
    assert hardware.ram_bytes(meminfo) == 24683584 * 1024
    assert hardware.ram_bytes(tmp_path / "missing") is None
    assert hardware.cpu_model(tmp_path / "missing") == (platform.processor() or None)


def _fake_nvidia_smi(folder, script: str) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)


def test_gpus_are_what_nvidia_smi_lists_and_none_without_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert hardware.gpus() == []  # no nvidia-smi at all

    _fake_nvidia_smi(tmp_path, 'printf "NVIDIA H200, 143771\\nNVIDIA A2, [N/A]\\n"\n')
    assert hardware.gpus() == [Gpu(name="NVIDIA H200", memory_bytes=143771 * 2**20),
                               Gpu(name="NVIDIA A2", memory_bytes=None)]

    _fake_nvidia_smi(tmp_path, 'echo "NVIDIA-SMI has failed: no driver" >&2; exit 9\n')
    assert hardware.gpus() == []  # installed, but no driver: no GPU
