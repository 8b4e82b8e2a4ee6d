"""Checkpoints: atomic, resumable bit-exactly after SIGKILL, intact when the disk fills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload import AdamWConfig, OffloadConfig, OffloadDiskFullError, OffloadEngine, OffloadError
from tests.offload import _train_proc
from tests.offload._factories import (
    assert_same_weights,
    make_batch,
    reference_adamw,
    reference_step,
    tiny_llama,
)
from tests.offload._tmpfs import small_tmpfs

ROOT = Path(__file__).resolve().parents[2]


def _engine(model, swap, clip=1.0) -> OffloadEngine:
    return OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip),
        OffloadConfig(2_500_000, str(swap), prefetch=1, activation_bytes=900_000),
    )


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "tests.offload._train_proc", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_save_and_load_continue_bit_exactly(tmp_path):
    a = _engine(tiny_llama(), tmp_path / "swap-a")
    for s in range(4):
        a.step(make_batch(s))
    a.save_checkpoint(tmp_path / "ckpt", extra={"epoch": 1})
    a.step(make_batch(4))
    a.save_checkpoint(tmp_path / "ckpt")  # a second generation replaces the first
    for s in range(5, 8):
        a.step(make_batch(s))
    names = sorted(os.listdir(tmp_path / "ckpt"))
    assert names == [
        "exp_avg.000002.bin",
        "exp_avg_sq.000002.bin",
        "manifest.json",
        "resident.000002.bin",
        "weight.000002.bin",
    ]
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert manifest["step"] == 5 and manifest["generation"] == 2

    b = _engine(tiny_llama(seed=1), tmp_path / "swap-b")  # other initial weights: overwritten
    assert b.load_checkpoint(tmp_path / "ckpt") == {}
    assert b.step_count == 5
    for s in range(5, 8):
        b.step(make_batch(s))
    assert_same_weights(a.model_state_dict(), b.model_state_dict())
    a.close()
    b.close()


def test_checkpoint_of_another_model_is_refused(tmp_path):
    a = _engine(tiny_llama(), tmp_path / "swap-a")
    a.save_checkpoint(tmp_path / "ckpt")
    a.close()
    b = _engine(tiny_llama(num_hidden_layers=3), tmp_path / "swap-b")
    with pytest.raises(OffloadError, match="different model"):
        b.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(OffloadError, match="no checkpoint"):
        b.load_checkpoint(tmp_path / "nothing-here")
    b.close()


def test_sigkill_mid_step_then_resume_equals_uninterrupted(tmp_path):
    steps, every, kill_at = 12, 4, 9
    uninterrupted = _train_proc.train(
        str(tmp_path / "swap-u"), str(tmp_path / "ckpt-u"), steps, every
    )

    swap, ckpt, out = tmp_path / "swap", tmp_path / "ckpt", tmp_path / "out.pt"
    killed = _run(str(swap), str(ckpt), str(out), str(steps), str(every), "--kill-at", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists()
    assert json.loads((ckpt / "manifest.json").read_text())["step"] == 8

    resumed = _run(str(swap), str(ckpt), str(out), str(steps), str(every), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    result = torch.load(out)
    assert result["losses"] == {s: uninterrupted["losses"][s] for s in range(8, steps)}
    assert_same_weights(uninterrupted["weights"], result["weights"])


def test_disk_full_during_checkpoint_keeps_the_previous_one(tmp_path):
    ref = tiny_llama()
    ropt = reference_adamw(ref, 1e-2, 0.1)
    eng = _engine(tiny_llama(), tmp_path / "swap")
    # One checkpoint of this model is ~2.2 MB: one fits in 3 MB, two do not.
    with small_tmpfs(tmp_path / "small", "3m") as small:
        for s in range(2):
            reference_step(ref, ropt, make_batch(s), clip=1.0)
            eng.step(make_batch(s))
        eng.save_checkpoint(small / "ckpt", extra={"step": 2})
        at_2 = {k: v.clone() for k, v in ref.state_dict().items()}
        before = sorted(os.listdir(small / "ckpt"))

        for s in range(2, 4):
            reference_step(ref, ropt, make_batch(s), clip=1.0)
            eng.step(make_batch(s))
        with pytest.raises(OffloadDiskFullError, match="full.*previous checkpoint"):
            eng.save_checkpoint(small / "ckpt", extra={"step": 4})
        assert sorted(os.listdir(small / "ckpt")) == before  # no partial files left

        # The swap files were not harmed: training goes on, still equal to plain torch.
        for s in range(4, 6):
            assert eng.step(make_batch(s)) == reference_step(ref, ropt, make_batch(s), clip=1.0)
        assert_same_weights(ref.state_dict(), eng.model_state_dict())

        # And the old checkpoint loads, holding the state after step 2.
        other = _engine(tiny_llama(seed=3), tmp_path / "swap-2")
        assert other.load_checkpoint(small / "ckpt") == {"step": 2}
        assert_same_weights(at_2, other.model_state_dict())
        other.close()
    eng.close()


def test_swap_that_does_not_fit_is_refused_cleanly(tmp_path):
    with small_tmpfs(tmp_path / "small", "1m") as small:
        with pytest.raises(OffloadDiskFullError, match="is full"):
            _engine(tiny_llama(), small / "swap")  # needs ~2.4 MB of swap
        assert not list((small / "swap").glob("*.swap"))
