"""When every block's graph fits the activation share, the backward uses the graphs kept
from the forward instead of recomputing blocks: same bits, less compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from offload import AdamWConfig, OffloadConfig, OffloadEngine, activation_bytes
from offload._plan import graph_bytes
from tests.offload._factories import (
    assert_same_weights,
    make_batch,
    n_label_tokens,
    reference_adamw,
    reference_step,
    summed_loss,
    tiny_config,
    tiny_llama,
)

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")
ROOT = Path(__file__).resolve().parents[2]
DEEP = {"num_hidden_layers": 8, "intermediate_size": 256, "attention_dropout": 0.2}
POOL = 2_500_000  # budget left for the pool and resident state: every block streams


def _keep_act(cfg, batch=2, seq=16) -> int:
    return activation_bytes(cfg, batch, seq) + graph_bytes(cfg, batch, seq) + 200_000


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "recomputed"])
def test_full_finetune_with_dropout_clip_and_micro_batches(tmp_path, keep):
    ref, model = tiny_llama(**DEEP), tiny_llama(**DEEP)
    ropt = reference_adamw(ref, 1e-2, 0.1, no_decay_1d=True)
    act = _keep_act(tiny_config(**DEEP))
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, no_decay_1d=True),
        OffloadConfig(POOL + act, str(tmp_path / "swap"), activation_bytes=act, keep_graphs=keep),
    )
    assert eng.streaming
    torch.manual_seed(3)  # dropout masks: drawn once (kept) or replayed (recomputed)
    ref_losses = []
    for s in range(6):
        b = make_batch(s, batch=4)
        ref_losses.append(reference_step(ref, ropt, b, clip=0.5, micro_batches=2, loss="sum"))
    ref_rng = torch.get_rng_state()
    torch.manual_seed(3)
    eng_losses = []
    for s in range(6):
        b = make_batch(s, batch=4)
        eng_losses.append(eng.step(b, loss_fn=_loss_over(n_label_tokens(b)), micro_batches=2))
        assert eng.telemetry()["kept_graphs"] is keep
    assert eng_losses == ref_losses
    assert torch.equal(torch.get_rng_state(), ref_rng)  # as many random numbers drawn
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    assert eng.telemetry()["peak_bytes"] <= POOL + act
    eng.close()


def _loss_over(denom: int):
    return lambda model, micro: summed_loss(model, micro) / denom


def test_lora_kept_graphs_bitwise_equal_to_plain_peft(tmp_path):
    def lora():
        base = tiny_llama(**DEEP)
        torch.manual_seed(1)
        cfg = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "down_proj"]
        )
        return get_peft_model(base, cfg)

    ref, model = lora(), lora()
    ropt = reference_adamw(ref, 1e-2, 0.0)
    act = _keep_act(tiny_config(**DEEP))
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0),
        OffloadConfig(POOL + act, str(tmp_path / "swap"), prefetch=1, activation_bytes=act),
    )
    assert eng.streaming and eng.mode == "frozen_base"
    torch.manual_seed(5)
    ref_losses = [reference_step(ref, ropt, make_batch(s), clip=1.0) for s in range(8)]
    ref_rng = torch.get_rng_state()
    torch.manual_seed(5)
    eng_losses = [eng.step(make_batch(s)) for s in range(8)]
    assert eng.telemetry()["kept_graphs"]
    assert eng_losses == ref_losses
    assert torch.equal(torch.get_rng_state(), ref_rng)
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def test_graphs_that_do_not_fit_are_recomputed(tmp_path):
    cfg = tiny_config(**DEEP)
    act = activation_bytes(cfg, 2, 16) + graph_bytes(cfg, 2, 16) // 2
    eng = OffloadEngine(
        tiny_llama(**DEEP),
        AdamWConfig(lr=1e-2),
        OffloadConfig(POOL + act, str(tmp_path / "swap"), activation_bytes=act),
    )
    eng.step(make_batch(0))
    assert not eng.telemetry()["kept_graphs"]
    eng.close()


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_rss_under_budget_with_kept_graphs(tmp_path):
    budget = 74_000_000
    env = dict(
        os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536"
    )
    args = [str(tmp_path / "swap"), str(budget), "3", str(44 << 20)]
    r = subprocess.run(
        [sys.executable, "-m", "tests.offload._rss_proc", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["streaming"] and m["kept_graphs"]
    assert m["accounted_peak"] <= budget
    assert m["used"] <= budget, m
