"""Pipeline-parallel training (worker/training/pipelined.py) on two ranks started by torchrun
(gloo, this machine): each rank one stage of a tiny Llama, its blocks paged through its own
offload engine, torch.distributed.pipelining's GPipe schedule between them. The result is
one process's with the same micro-batches; checkpoints resume as one process's do."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from tests.offload._factories import assert_same_weights
from tests.worker.distributed import _pp_proc
from worker.distributed.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[3]
STEPS, ROWS = 4, 4
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")


def _stages(tmp_path: Path, mode: str, *extra: str, out: str = "out.pt", ranks: int = 2) -> dict:
    cmd = torchrun_command(mode, ranks, module="tests.worker.distributed._pp_proc",
                           extra=[str(tmp_path / "swap"), str(tmp_path / out), str(STEPS),
                                  str(ROWS), *extra])
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / out, weights_only=True)


def _one_process(tmp_path: Path, mode: str) -> dict:
    torch.set_num_threads(1)
    model = _pp_proc.build(mode)
    names = _pp_proc.trainable(model)
    data = _pp_proc.batches(STEPS, ROWS)
    with torch.no_grad():
        logits = model(input_ids=data[0]["input_ids"],
                       attention_mask=data[0]["attention_mask"]).logits
    eng = _pp_proc.engine(mode, model, str(tmp_path / "one"), STEPS, pipeline=False)
    assert eng.engine.streaming
    losses = [eng.step(b) for b in data]
    state = eng.model_state_dict()
    eng.close(restore_weights=False)
    return {"losses": losses, "logits": logits, "weights": {n: state[n] for n in names}}


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_two_stages_are_one_process(tmp_path, mode):
    """Full fine-tuning and LoRA, clipping on, two micro-batches: the pipeline's forward
    gives one process's logits, and its trained weights are one process's, bit for bit (the
    gradient norm is gathered from both stages in the model's order), and so are its
    losses. Its last stage runs the output layer only at the positions that predict a label,
    as one process does (worker/training/engines.lm_loss_sum)."""
    two = _stages(tmp_path, mode)
    one = _one_process(tmp_path, mode)
    assert torch.equal(two["logits"], one["logits"])
    assert two["losses"] == one["losses"]
    predicting = sum(int((b["labels"][:, 1:] != -100).sum()) for b in _pp_proc.batches(STEPS, ROWS))
    head_rows = torch.load(tmp_path / "out.pt.head", weights_only=True)["head_rows"]
    assert sum(head_rows) == predicting < STEPS * ROWS * 16, head_rows
    assert_same_weights(one["weights"], two["weights"])
    start = {n: p for n, p in _pp_proc.build(mode).named_parameters() if p.requires_grad}
    assert any(not torch.equal(start[k], v) for k, v in two["weights"].items())
    assert two["telemetry"]["world_size"] == 2 and two["telemetry"]["pipeline_parallel"]


def test_tied_embeddings_match_one_process_to_rounding(tmp_path):
    """Tied input and output embeddings: the first stage holds the weight as embeddings,
    the last as output layer; their gradients are summed between the two, so the weight's
    two halves are added in another order than autograd adds them in one process: equal
    within float32 rounding, not bitwise (largest tensor difference printed). The two
    stages' copies of the weight stay the same bits."""
    two = _stages(tmp_path, "tied")
    one = _one_process(tmp_path, "tied")
    assert two["tied_equal"] is True  # the first stage's and the last stage's copies
    assert torch.equal(two["logits"], one["logits"])
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-6)
    assert two["weights"].keys() == one["weights"].keys()
    worst = max(float((two["weights"][k] - w).norm() / w.norm())
                for k, w in one["weights"].items())
    print(f"tied embeddings, 2 stages vs 1 process: largest difference {worst:.2e} of norm")
    assert worst < 1e-5


def test_a_checkpoint_resumes_to_the_same_weights(tmp_path):
    """Stopped after step 2 (each stage writes its part of the checkpoint), started again
    in new processes from it: the same losses and weights as a run never stopped."""
    whole = _stages(tmp_path, "full", out="whole.pt")
    _stages(tmp_path, "full", "--save-at", "2", str(tmp_path / "ckpt"), out="first.pt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["stage0", "stage1"]
    resumed = _stages(tmp_path, "full", "--resume", str(tmp_path / "ckpt"), out="second.pt")
    assert resumed["losses"] == whole["losses"][2:]
    assert_same_weights(whole["weights"], resumed["weights"])


def test_a_stage_count_that_does_not_match_the_checkpoint_is_refused(tmp_path):
    _stages(tmp_path, "lora", "--save-at", "1", str(tmp_path / "ckpt"), out="first.pt")
    cmd = torchrun_command("lora", 3, module="tests.worker.distributed._pp_proc",
                           extra=[str(tmp_path / "swap3"), str(tmp_path / "x.pt"), str(STEPS),
                                  str(ROWS), "--resume", str(tmp_path / "ckpt")])
    run = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240,
                         check=False)
    assert run.returncode != 0
    assert "stage2" in run.stderr or "stages" in run.stderr
