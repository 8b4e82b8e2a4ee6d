"""The CUDA path on a real GPU: blocks compute on the device from pinned host pages.

Compared with plain in-memory torch on the same GPU, within a tolerance rather than bit
for bit, because two things differ by design (the control flow itself is checked bit for
bit on the CPU by test_device.py):
- a block's AdamW step runs on the host (torch's single-tensor CPU kernels) over the fp32
  pages, while plain torch steps on the GPU with its foreach kernels; both compute the same
  formula, but the GPU contracts multiply-adds into FMAs, so results differ in the last
  bits, and those differences grow through later steps;
- with clipping, the blocks' gradient norms are reduced on the host.
(fp32 attention on the GPU may also use a backward that adds with atomics, so even plain
torch is not bitwise repeatable there.) The weights are compared by how far their update
differs: |w_engine - w_torch| / |w_torch - w_start| per tensor, under 5e-3 (a block
stepped from stale weights, or not stepped, gives ~1).

Set OFFLOAD_CUDA_REPORT=path to have each test append its measurements as JSON lines
(scripts/cuda_check.sh collects them)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model

from offload import AdamWConfig, OffloadConfig, OffloadEngine
from tests.offload._factories import (
    make_batch,
    reference_adamw,
    reference_step,
    state_bytes,
    tiny_llama,
)

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning"),  # peft
]

DEEP = {"num_hidden_layers": 12, "intermediate_size": 256, "vocab_size": 128}
LR, WD = 1e-3, 0.1
STEPS = 8
UPDATE_RTOL = 5e-3


def _report(test: str, **values) -> None:
    path = os.environ.get("OFFLOAD_CUDA_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


@pytest.fixture(autouse=True)
def _ieee_matmuls():
    """Full fp32 matmuls on both sides (no TF32), as on the CPU."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _cuda_batch(step: int, **kw) -> dict:
    return {k: v.cuda() for k, v in make_batch(step, **kw).items()}


def _compare(ref: dict, eng: dict, start: dict) -> dict:
    """Worst per-tensor update difference, bitwise equality, and whether training moved."""
    worst, bitwise, moved = 0.0, True, 0.0
    for k, r in ref.items():
        r, e, s = r.float().cpu(), eng[k].float().cpu(), start[k].float().cpu()
        bitwise &= torch.equal(r, e)
        step = (r - s).norm().item()
        moved = max(moved, step)
        if step > 0:
            worst = max(worst, (e - r).norm().item() / step)
        else:
            assert torch.equal(r, e), k
    return {"worst_update_rel_diff": worst, "bitwise": bitwise, "max_update_norm": moved}


@pytest.mark.parametrize(
    ("clip", "micro", "keep_graphs"),
    [(None, 1, True), (None, 1, False), (1.0, 2, False)],
    ids=["kept-graphs", "recompute", "clip-micro2"],
)
def test_full_finetune_on_cuda_matches_plain_torch_on_cuda(tmp_path, clip, micro, keep_graphs):
    ref = tiny_llama(**DEEP).cuda()
    start = {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
    ropt = reference_adamw(ref, LR, WD)
    model = tiny_llama(**DEEP).cuda()  # the engine's device: where its parameters are
    budget, act = (5_200_000, 4_000_000) if keep_graphs else (3_000_000, 900_000)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=LR, weight_decay=WD, max_grad_norm=clip),
        OffloadConfig(
            budget,
            str(tmp_path / "swap"),
            prefetch=1,
            activation_bytes=act,
            keep_graphs=keep_graphs,
            host_budget_bytes=2_500_000,
        ),
    )
    assert eng.device.type == "cuda" and eng.streaming
    assert state_bytes(model) >= 2 * budget
    batches = [_cuda_batch(s, batch=2 * micro, vocab=128) for s in range(STEPS)]
    ref_losses = [reference_step(ref, ropt, b, clip, micro_batches=micro) for b in batches]
    eng_losses = [eng.step(b, micro_batches=micro) for b in batches]

    torch.testing.assert_close(eng_losses, ref_losses, rtol=1e-4, atol=1e-6)
    cmp = _compare(ref.state_dict(), eng.model_state_dict(), start)
    t = eng.telemetry()
    _report(
        f"full-ft[{clip},{micro},{keep_graphs}]",
        losses_equal=eng_losses == ref_losses,
        **cmp,
        **{k: t[k] for k in ("h2d_bytes", "d2h_bytes", "h2d_copies", "transfer_wait_s")},
    )
    assert cmp["max_update_norm"] > 1e-3  # it trained
    assert cmp["worst_update_rel_diff"] < UPDATE_RTOL, cmp
    assert t["kept_graphs"] is keep_graphs
    n = len(eng._state.layouts)
    assert t["h2d_copies"] == STEPS * micro * (2 * n - 2)
    assert t["h2d_bytes"] == t["h2d_copies"] * t["device_slot_bytes"]
    assert t["d2h_bytes"] == STEPS * micro * sum(x.trainable_bytes() for x in eng._state.layouts)
    assert t["peak_bytes"] <= budget
    eng.close()


def _lora():
    base = tiny_llama(seed=0, **DEEP)
    torch.manual_seed(1)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, cfg)


def _lora_engine(model, swap, **cfg):
    return OffloadEngine(
        model,
        AdamWConfig(lr=LR, weight_decay=0.0, max_grad_norm=1.0),
        OffloadConfig(
            2_000_000,
            str(swap),
            prefetch=1,
            activation_bytes=700_000,
            host_budget_bytes=600_000,
            **cfg,
        ),
    )


def test_lora_on_cuda_matches_plain_peft_on_cuda_and_resumes(tmp_path):
    ref = _lora().cuda()
    start = {k: v.detach().cpu().clone() for k, v in ref.state_dict().items()}
    ropt = reference_adamw(ref, LR, 0.0)
    eng = _lora_engine(_lora(), tmp_path / "swap", device="cuda")  # model on the CPU
    assert eng.mode == "frozen_base" and eng.streaming
    written = eng.telemetry()["bytes_written"]
    torch.manual_seed(5)  # lora_dropout draws from the GPU's generator on both sides
    ref_losses = [
        reference_step(ref, ropt, _cuda_batch(s, vocab=128), clip=1.0) for s in range(STEPS)
    ]
    torch.manual_seed(5)
    eng_losses = [eng.step(_cuda_batch(s, vocab=128)) for s in range(STEPS)]

    torch.testing.assert_close(eng_losses, ref_losses, rtol=1e-4, atol=1e-6)
    cmp = _compare(ref.state_dict(), eng.model_state_dict(), start)
    t = eng.telemetry()
    _report("lora", losses_equal=eng_losses == ref_losses, **cmp, h2d_bytes=t["h2d_bytes"])
    assert cmp["worst_update_rel_diff"] < UPDATE_RTOL, cmp
    assert t["bytes_written"] == written and t["d2h_bytes"] == 0
    assert t["h2d_bytes"] >= STEPS * (2 * len(eng._state.layouts) - 2) * t["device_slot_bytes"]

    # A checkpoint on the CUDA path: adapters and Adam state come back to the GPU, and the
    # GPU's generator too (dropout), so a resumed engine continues as this one does.
    eng.save_checkpoint(tmp_path / "ckpt")
    other = _lora_engine(_lora(), tmp_path / "swap2", device="cuda")
    other.load_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(9)
    a = [eng.step(_cuda_batch(s, vocab=128)) for s in range(STEPS, STEPS + 3)]
    torch.manual_seed(9)
    b = [other.step(_cuda_batch(s, vocab=128)) for s in range(STEPS, STEPS + 3)]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    _report("lora-resume", losses_equal=a == b)
    eng.close()
    other.close()


def test_peak_gpu_memory_under_a_budget_the_training_state_exceeds(tmp_path):
    """GPU memory (torch's caching allocator, max_memory_allocated) above what the process
    held before the engine, with a training state over three times the GPU budget."""
    from tests.offload._rss_proc import BATCH, SEQ, SHAPE

    budget = 40_000_000
    # Warm-up in plain torch: cuBLAS workspaces (one per thread and stream: the forward's,
    # and the backward's on autograd's device thread) exist before the baseline.
    warm = tiny_llama(**SHAPE).cuda()
    warm(**_cuda_batch(0, batch=BATCH, seq=SEQ, vocab=512)).loss.backward()
    del warm
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()

    model = tiny_llama(**SHAPE)  # on the CPU: only the resident group goes to the GPU
    state = state_bytes(model)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-3, max_grad_norm=1.0),
        OffloadConfig(
            budget,
            str(tmp_path / "swap"),
            prefetch=1,
            activation_bytes=12 << 20,
            device="cuda",
            host_budget_bytes=40_000_000,
        ),
    )
    steps = 3
    for s in range(steps):
        eng.step(_cuda_batch(s, batch=BATCH, seq=SEQ, vocab=512))
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - baseline
    t = eng.telemetry()
    _report(
        "gpu-memory",
        used=used,
        budget=budget,
        state=state,
        accounted=t["peak_bytes"],
        device_peak_bytes=t["device_peak_bytes"],
        h2d_bytes=t["h2d_bytes"],
        d2h_bytes=t["d2h_bytes"],
        bytes_read=t["bytes_read"],
        transfer_wait_s=t["transfer_wait_s"],
        step_s=t["step_s"],
    )
    assert state >= 3 * budget
    assert t["streaming"] and t["peak_bytes"] <= budget
    assert used <= budget, (used, t)
    n = len(eng._state.layouts)
    assert t["h2d_bytes"] >= steps * (2 * n - 2) * t["device_slot_bytes"]
    assert t["d2h_bytes"] == steps * sum(x.trainable_bytes() for x in eng._state.layouts)
    assert t["bytes_read"] > 0 and t["bytes_written"] > 0
    assert t["pool_bytes"] <= 40_000_000
    eng.close()
