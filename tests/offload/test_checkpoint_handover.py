"""Checkpoints without copies: a save on the swap's filesystem renames the swap files into
the checkpoint, a load reads from the checkpoint's files; those are never written."""

from __future__ import annotations

import hashlib
import os

from offload import AdamWConfig, OffloadConfig, OffloadEngine
from tests.offload._factories import assert_same_weights, make_batch, tiny_llama
from tests.offload._tmpfs import small_tmpfs

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def _engine(model, swap) -> OffloadEngine:
    return OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0),
        OffloadConfig(2_500_000, str(swap), prefetch=1, activation_bytes=900_000),
    )


def _digests(ckpt) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(ckpt.iterdir())}


def test_save_renames_the_swap_files_and_never_writes_them_again(tmp_path):
    eng = _engine(tiny_llama(), tmp_path / "swap")
    for s in range(3):
        eng.step(make_batch(s))
    inodes = {k: os.stat(tmp_path / "swap" / f"{k}.swap").st_ino for k in KINDS}
    eng.save_checkpoint(tmp_path / "ckpt")
    for k in KINDS:  # the same file, now in the checkpoint: nothing was copied
        assert os.stat(tmp_path / "ckpt" / f"{k}.000001.bin").st_ino == inodes[k]
    swap_files = sorted(f"{k}.swap" for k in (*KINDS, "grad"))
    assert sorted(os.listdir(tmp_path / "swap")) == [".lock", *swap_files]  # no leftovers
    saved = _digests(tmp_path / "ckpt")
    after_save = eng.model_state_dict()
    for s in range(3, 6):
        eng.step(make_batch(s))
    assert _digests(tmp_path / "ckpt") == saved  # steps wrote the new swap files only

    other = _engine(tiny_llama(seed=1), tmp_path / "swap-b")
    other.load_checkpoint(tmp_path / "ckpt")
    assert_same_weights(after_save, other.model_state_dict())
    other.step(make_batch(3))
    assert _digests(tmp_path / "ckpt") == saved  # a load only reads them
    eng.close()
    other.close()


def _resume(ckpt, swap) -> tuple[dict, list[float]]:
    """Weights right after loading `ckpt`, and the losses of two steps from there."""
    eng = _engine(tiny_llama(seed=2), swap)
    eng.load_checkpoint(ckpt)
    weights = eng.model_state_dict()
    losses = [eng.step(make_batch(s)) for s in range(3, 5)]
    eng.close()
    return weights, losses


def test_load_then_save_at_once_gives_complete_checkpoints(tmp_path):
    """Right after a load every region still lives in the loaded checkpoint: a save must
    fill them in, by rename (same filesystem) or by copy (another one)."""
    a = _engine(tiny_llama(), tmp_path / "swap-a")
    for s in range(3):
        a.step(make_batch(s))
    a.save_checkpoint(tmp_path / "ckpt1")
    a.close()
    weights, losses = _resume(tmp_path / "ckpt1", tmp_path / "swap-r")

    b = _engine(tiny_llama(seed=1), tmp_path / "swap-b")
    b.load_checkpoint(tmp_path / "ckpt1")
    b.save_checkpoint(tmp_path / "ckpt2")  # same filesystem: filled in, then renamed
    with small_tmpfs(tmp_path / "other-fs", "16m") as other_fs:
        b.save_checkpoint(other_fs / "ckpt3")  # another filesystem: copied
        for ckpt in (tmp_path / "ckpt2", other_fs / "ckpt3"):
            w, got = _resume(ckpt, tmp_path / "swap-c")
            assert_same_weights(weights, w)
            assert got == losses
    b.close()
