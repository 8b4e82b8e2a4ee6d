"""Training through the SSD offload engine equals training in memory, bit for bit, even when
the budget is so small that every block streams from the disk."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from offload import activation_bytes
from tests.worker.conftest_training import text_examples, tiny_model_dir
from worker.training.batches import pad_batch
from worker.training.engines import TELEMETRY_KEYS, OffloadTrainEngine
from worker.training.recipe import (
    Cancelled,
    EngineOptions,
    FineTuneRecipe,
    Hooks,
    TrainConfig,
)
from worker.training.resources import auto_budget_bytes, available_memory_bytes

PAD = 2
BATCH, SEQ = 3, 64

# peft calls a transformers method that transformers 5 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


@pytest.fixture(scope="module")
def base(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def examples(smol_tokenizer) -> list[dict]:
    return text_examples(smol_tokenizer, n=9)


def config(method: str, **kw) -> TrainConfig:
    base = {
        "method": method,
        "epochs": 2,
        "learning_rate": 1e-2 if method == "lora" else 1e-3,
        "lora_rank": 4,
        "max_seq_len": SEQ,
        "batch_size": BATCH,
        "checkpoint_every": 4,
        "weight_decay": 0.1,  # 1-D parameters are not decayed: the engine must agree
    }
    return TrainConfig(**(base | kw))


def run(base, examples, workdir: Path, cfg: TrainConfig, engine: EngineOptions) -> tuple:
    seen: list[dict] = []
    r = FineTuneRecipe(
        copy.deepcopy(base), examples, cfg, workdir, Hooks(on_progress=seen.append), PAD, engine
    )
    r.setup()
    metrics = r.train()
    weights = {n: p.detach().clone() for n, p in r.model.named_parameters() if p.requires_grad}
    return metrics["losses"], weights, seen


def tight_budget(base, examples, tmp_path: Path, cfg: TrainConfig, files) -> tuple[int, int]:
    """(budget, activation bytes): room for the smallest pool the engine accepts, so every
    block is paged in for each use (measured on an engine with room to spare)."""
    act = activation_bytes(base.config, BATCH, SEQ)
    probe = FineTuneRecipe(
        copy.deepcopy(base), examples, cfg, tmp_path / "probe", None, PAD,
        EngineOptions(weights_files=files, activation_bytes=act),
    )  # fmt: skip
    probe.setup()
    t = probe.engine.engine.telemetry()
    probe.cleanup()
    reserve = 1 if cfg.method == "lora" else 4  # pages one block's use pins at once
    fixed = t["resident_bytes"] + t["block_grad_bytes"] + t["scratch_bytes"] + act
    return fixed + reserve * t["page_bytes"] + 4096, act


@pytest.mark.parametrize(
    ("method", "extra"),
    [("lora", {"lora_dropout": 0.1, "neftune_alpha": 5.0}),
     ("full", {"grad_accum": 2, "batch_size": 2})],
    ids=["lora-dropout-neftune", "full-accum"],
)
def test_every_block_streaming_equals_training_in_memory(
    method, extra, base, examples, tiny_dir, tmp_path
):
    cfg = config(method, **extra)
    files = sorted(tiny_dir.glob("*.safetensors"))
    budget, act = tight_budget(base, examples, tmp_path, cfg, files)

    ref_losses, ref_weights, _ = run(
        base, examples, tmp_path / "memory", cfg, EngineOptions(kind="memory")
    )
    engine = EngineOptions(budget_bytes=budget, weights_files=files, activation_bytes=act)
    losses, weights, seen = run(base, examples, tmp_path / "offload", cfg, engine)

    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for name, tensor in ref_weights.items():
        assert torch.equal(weights[name], tensor), name

    t = seen[-1]["telemetry"]
    assert set(t) == set(TELEMETRY_KEYS) | {"blocks"}
    assert t["streaming"] and t["blocks"] == 2 and t["budget_bytes"] == budget
    assert t["peak_bytes"] <= budget
    steps = len(losses)
    if method == "lora":  # the frozen base comes from the model's own file, read-only
        assert t["mode"] == "frozen_base" and t["blocks_read_from_weights_files"] == 2
        assert t["bytes_written"] == 0 and t["swap_bytes"] == 0
        # A one-page pool: both blocks (~148 KB of weights each) are read again every step.
        assert t["bytes_read"] >= steps * 2 * 140_000
    else:  # weights, Adam m and v go back to the swap every step
        assert t["mode"] == "full"
        assert t["bytes_written"] >= steps * 2 * 3 * 100_000
    assert [p["step"] for p in seen] == list(range(1, steps + 1))
    assert not (tmp_path / "offload" / "swap").exists()  # the engine cleaned up after itself


def test_resume_in_a_new_process_state_through_the_engine(base, examples, tmp_path):
    """A run cut after a checkpoint and resumed by a fresh recipe ends bit-equal to the
    in-memory reference (the full fine-tune's swap files travel in the checkpoint)."""
    cfg = config("full", max_steps=5)
    ref_losses, ref_weights, _ = run(
        base, examples, tmp_path / "memory", cfg, EngineOptions(kind="memory")
    )
    first = FineTuneRecipe(
        copy.deepcopy(base), examples, cfg, tmp_path / "job",
        Hooks(should_cancel=lambda: first.progress.step >= 4), PAD,
    )  # fmt: skip
    first.setup()
    with pytest.raises(Cancelled):
        first.train()
    names = sorted(p.name for p in (tmp_path / "job" / "checkpoint").iterdir())
    assert names == [
        "exp_avg.000001.bin", "exp_avg_sq.000001.bin", "manifest.json", "meta.json",
        "resident.000001.bin", "rng.pt", "weight.000001.bin",
    ]  # fmt: skip
    losses, weights, seen = run(base, examples, tmp_path / "job", cfg, EngineOptions())
    assert [p["step"] for p in seen] == [5]
    assert losses == ref_losses
    for name, tensor in ref_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_engine_keeps_in_memory_engines_contract(base, examples, tmp_path):
    model = copy.deepcopy(base)
    for p in model.parameters():
        p.requires_grad_(True)
    engine = OffloadTrainEngine(
        model, learning_rate=1e-3, total_steps=4, warmup_steps=1,
        budget_bytes=1 << 30, swap_dir=tmp_path / "swap",
    )  # fmt: skip
    assert engine.learning_rate == pytest.approx(1e-3 / 2)  # warmup: step 0 at half
    loss = engine.step(pad_batch(examples[:3], PAD, SEQ))
    assert isinstance(loss, float) and loss > 0 and engine.steps_done == 1
    assert engine.learning_rate == pytest.approx(1e-3)
    state = engine.model_state_dict()
    assert not torch.isnan(state["model.layers.0.mlp.up_proj.weight"]).any()
    engine.close(restore_weights=True)
    assert list((tmp_path / "swap").glob("*.swap")) == []
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.get_parameter(name), state[name])  # back in memory

    frozen = copy.deepcopy(base)
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        OffloadTrainEngine(
            frozen, learning_rate=1e-3, total_steps=1, budget_bytes=1 << 30,
            swap_dir=tmp_path / "swap2",
        )  # fmt: skip


def test_automatic_budget_is_half_the_free_memory():
    free = available_memory_bytes()
    assert free is not None and free > 0
    budget = auto_budget_bytes()
    assert 0.4 * free < budget <= 0.6 * free
    assert auto_budget_bytes(torch.nn.Linear(2, 2), share=0.25) < budget


def test_the_job_device_is_the_gpu_only_where_there_is_one():
    from worker.training.resources import job_device

    assert job_device("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert job_device("auto").type == job_device("cuda").type == "cuda"
    else:
        assert job_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="PyTorch sees no CUDA GPU"):
            job_device("cuda")
    with pytest.raises(ValueError, match="Unknown device"):
        job_device("tpu")
