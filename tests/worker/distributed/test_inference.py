"""Tensor and pipeline parallel answers on two ranks (torchrun, gloo) are one process's: the
same greedy tokens, for one prompt and for a batch cut into uneven micro-batches."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from scripts import cluster_infer
from worker.distributed.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[3]
ARGS = ["--size", "tiny", "--batches", "1,3", "--new", "8"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "single.json"
    cluster_infer.main(["--mode", "single", *ARGS, "--out", str(out)])
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["tp", "pp"])
def test_two_ranks_answer_as_one_process(tmp_path, one_process, mode):
    out = tmp_path / f"{mode}.json"
    cmd = torchrun_command("--mode", 2, module="scripts.cluster_infer",
                           extra=[mode, *ARGS, "--out", str(out)])
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["world"] == 2 and two["params"] == one_process["params"]
    assert [r["tokens"] for r in two["rows"]] == [r["tokens"] for r in one_process["rows"]]
    assert all(len(t) == 8 for r in two["rows"] for t in r["tokens"])
    if mode == "pp":  # the micro-batches waited for each other some of the time
        assert all(0 <= r["bubble"] < 1 for r in two["rows"])
