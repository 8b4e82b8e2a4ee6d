"""The fine-tuning recipe and its engine: learning, exact resume, cancel, checkpoints."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker.conftest_training import text_examples, tiny_model_dir
from worker.dataset.corpus import IGNORE_INDEX
from worker.training.batches import pad_batch
from worker.training.engines import InMemoryEngine
from worker.training.recipe import (
    Cancelled,
    EngineOptions,
    FineTuneRecipe,
    Hooks,
    TrainConfig,
)

ROOT = Path(__file__).resolve().parents[3]
PAD = 2  # SmolLM2's <|im_end|>


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


@pytest.fixture(scope="module")
def examples(smol_tokenizer) -> list[dict]:
    return text_examples(smol_tokenizer, n=9)  # 3 optimizer steps an epoch at batch 3


_TEMPLATES: dict[Path, torch.nn.Module] = {}


def load(tiny_dir: Path):
    """A fresh copy of the tiny model (deepcopy of one load: from_pretrained costs ~0.5 s)."""
    if tiny_dir not in _TEMPLATES:
        _TEMPLATES[tiny_dir] = AutoModelForCausalLM.from_pretrained(tiny_dir)
    return copy.deepcopy(_TEMPLATES[tiny_dir])


def config(**overrides) -> TrainConfig:
    base = {
        "method": "lora",
        "epochs": 2,
        "learning_rate": 1e-2,
        "lora_rank": 4,
        "max_seq_len": 64,
        "batch_size": 3,
        "checkpoint_every": 4,
    }
    return TrainConfig(**(base | overrides))


def recipe(tiny_dir, examples, workdir, hooks=None, engine=None, **overrides) -> FineTuneRecipe:
    """Set up (the offload engine unless `engine` says otherwise), resuming if it can."""
    r = FineTuneRecipe(load(tiny_dir), examples, config(**overrides), workdir, hooks, PAD, engine)
    r.setup()
    return r


def resumed_at(tiny_dir, examples, workdir, **kw) -> int:
    """The step a new run in `workdir` would resume from (its engine closed again)."""
    r = recipe(tiny_dir, examples, workdir, **kw)
    r.cleanup()
    return r.progress.step


def trainable(r: FineTuneRecipe) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in r.model.named_parameters() if p.requires_grad}


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


# -- config and batching -------------------------------------------------------------------


def test_config_round_trips_and_validates():
    cfg = config(seed=7, lora_rank=8)
    assert cfg.lora_alpha == 16  # 2 * rank by default
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="method"):
        config(method="qlora")
    with pytest.raises(ValueError, match="learning_rate"):
        config(learning_rate=0.5)
    with pytest.raises(ValueError, match="Unknown"):
        TrainConfig.from_dict({"learning_rte": 1e-3})
    with pytest.raises(ValueError, match="lora_modules must be one of all, mlp, attention"):
        config(lora_modules="heads")
    with pytest.raises(ValueError, match="lora_modules must be one of"):
        config(lora_modules=["q_proj"])  # a stored job's settings are read back as JSON
    assert cfg.steps_per_epoch(13) == 5  # 3 + 3 + 3 + 3 + 1: the short batch is kept
    assert config(max_steps=5).total_steps(13) == 5


@pytest.mark.parametrize(
    ("modules", "adapted"),
    [
        ("mlp", {"gate_proj", "up_proj", "down_proj"}),
        ("attention", {"q_proj", "k_proj", "v_proj", "o_proj"}),
        ("all", {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
    ],
)
def test_lora_adapts_the_projections_the_config_names(
    modules, adapted, tiny_dir, examples, tmp_path
):
    run = FineTuneRecipe(
        load(tiny_dir), examples, config(lora_modules=modules), tmp_path,
        engine=EngineOptions(kind="memory"),
    )  # fmt: skip
    run.setup()
    try:
        names = [n for n, p in run.model.named_parameters() if p.requires_grad]
        assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in names} == adapted
        assert all(".lora_" in n for n in names)
    finally:
        run.cleanup(remove_checkpoint=True)


def test_pad_batch_masks_padding():
    batch = pad_batch(
        [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}],
        pad_token_id=PAD,
        max_len=64,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]


def test_each_epoch_sees_every_example_once(tiny_dir, examples, tmp_path):
    # 3 steps, last short; the plain shuffle (grouping by length: the next test)
    r = recipe(tiny_dir, examples, tmp_path, epochs=2, batch_size=4, group_by_length=False)
    for epoch in range(2):
        seen = []
        for step in range(epoch * 3, epoch * 3 + 3):
            ids = r.batch_for_step(step)["input_ids"]
            seen += [tuple(row[row != PAD].tolist()) for row in ids]
        assert sorted(seen) == sorted(tuple(e["input_ids"]) for e in examples)
    assert r.batch_for_step(0)["input_ids"].tolist() != r.batch_for_step(3)["input_ids"].tolist()
    r.cleanup()


def test_batches_group_examples_of_similar_length(tiny_dir, tmp_path):
    # 8 long chunks among 40 short practice questions, batches of 4 (12 steps an epoch).
    mixed = [{"input_ids": [7] * 60, "labels": [7] * 60} for _ in range(8)] + [
        {"input_ids": [9] * (5 + i % 4), "labels": [9] * (5 + i % 4)} for i in range(40)
    ]

    def widths(r) -> list[int]:
        return [r.batch_for_step(s)["input_ids"].shape[1] for s in range(r.steps_per_epoch)]

    grouped = recipe(tiny_dir, mixed, tmp_path / "g", batch_size=4, epochs=2)
    plain = recipe(tiny_dir, mixed, tmp_path / "p", batch_size=4, epochs=2,
                   group_by_length=False)
    # The long chunks share two batches instead of padding most of them.
    assert widths(grouped).count(60) == 2
    assert widths(plain).count(60) > 2
    assert sum(widths(grouped)) < sum(widths(plain))
    # Still every example once an epoch, a different order each epoch, same order each run.
    for epoch in range(2):
        order = grouped._permutation(epoch)
        assert sorted(order) == list(range(len(mixed)))
    assert grouped._permutation(0) != grouped._permutation(1)
    again = recipe(tiny_dir, mixed, tmp_path / "a", batch_size=4, epochs=2)
    assert again._permutation(1) == grouped._permutation(1)
    for r in (grouped, plain, again):
        r.cleanup()


def test_step_costs_follow_the_batches_the_run_takes(tiny_dir, tmp_path):
    """The ETA weighs each step by its padded shape (step_members, also the dataset plan's
    count) and its positions that predict a label (the output layer runs only there): the
    same as the batches batch_for_step builds, step by step."""
    lengths = [5, 40, 7, 33, 12, 60, 9, 21, 50, 6, 15, 28, 44]
    # Every other example a practice question: loss on its last 3 tokens only.
    examples = [{"input_ids": [3] * n,
                 "labels": [3] * n if i % 2 else [IGNORE_INDEX] * (n - 3) + [3] * 3}
                for i, n in enumerate(lengths)]
    r = FineTuneRecipe(load(tiny_dir), examples, config(epochs=3, max_seq_len=48), tmp_path,
                       pad_token_id=PAD)
    linear, attention = r._flops
    head = r._head_flops
    assert linear > head > 0 and attention > 0
    costs = r.step_costs()
    assert len(costs) == r.total_steps == 15
    for step, cost in enumerate(costs):
        batch = r.batch_for_step(step)
        rows, width = batch["input_ids"].shape
        predicting = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        assert predicting < rows * width
        assert cost == pytest.approx(rows * width * (linear + attention * width)
                                     - (rows * width - predicting) * head)


def test_grad_accum_matches_one_big_batch(tiny_dir, examples):
    batch = pad_batch(examples[:4], PAD, 64)
    results = []
    for accum in (1, 2):
        model = load(tiny_dir)
        engine = InMemoryEngine(model, learning_rate=1e-3, total_steps=1, grad_accum=accum)
        loss = engine.step(batch)
        results.append((loss, model.model.layers[0].mlp.up_proj.weight.detach().clone()))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=1e-6)


# -- learning ------------------------------------------------------------------------------


# A random 64-wide model learns slowly through rank-4 adapters; full fine-tuning moves fast.
@pytest.mark.parametrize(
    ("method", "epochs", "lr", "drop"), [("lora", 4, 1e-2, 0.25), ("full", 3, 3e-3, 0.8)]
)
def test_loss_falls(method, epochs, lr, drop, tiny_dir, examples, tmp_path):
    steps: list[dict] = []
    r = recipe(
        tiny_dir,
        examples,
        tmp_path,
        Hooks(on_progress=steps.append),
        method=method,
        epochs=epochs,
        learning_rate=lr,
        checkpoint_every=100,
    )
    base_before = load(tiny_dir).model.layers[0].self_attn.q_proj.weight
    metrics = r.train()

    losses = metrics["losses"]
    n = 3 * epochs  # 3 steps an epoch
    assert len(losses) == metrics["steps"] == n
    epoch_means = [sum(losses[i : i + 3]) / 3 for i in range(0, n, 3)]
    assert epoch_means == sorted(epoch_means, reverse=True), epoch_means
    assert epoch_means[-1] < epoch_means[0] - drop, epoch_means
    assert [s["step"] for s in steps] == list(range(1, n + 1))
    assert [s["epoch"] for s in steps] == [e for e in range(1, epochs + 1) for _ in range(3)]
    assert all(s["tokens_per_s"] > 0 and s["eta_s"] >= 0 for s in steps)
    assert steps[-1]["eta_s"] == 0
    inner = r.model.get_base_model() if method == "lora" else r.model
    q_proj = inner.model.layers[0].self_attn.q_proj
    if method == "lora":  # the base stays frozen, only adapters train
        assert torch.equal(q_proj.base_layer.weight, base_before)
        assert all("lora_" in n for n, p in r.model.named_parameters() if p.requires_grad)
    else:
        assert not torch.equal(q_proj.weight, base_before)


# -- checkpoints, resume, cancel -----------------------------------------------------------


# LoRA with dropout and NEFTune's noise: the RNG state must be restored too (without them it
# is not used).
@pytest.mark.parametrize(("method", "dropout"), [("lora", 0.1), ("full", 0.0)])
def test_cancel_then_resume_is_bit_exact(method, dropout, tiny_dir, examples, tmp_path):
    kw = {
        "method": method,
        "lora_dropout": dropout,
        "neftune_alpha": 5.0 if method == "lora" else 0.0,
        "learning_rate": 1e-2 if method == "lora" else 1e-3,
    }
    straight = recipe(tiny_dir, examples, tmp_path / "straight", **kw)
    straight.train()

    stop_at = 5  # mid-epoch (3 steps an epoch), one step after the checkpoint at 4; 6 in all
    first = recipe(
        tiny_dir,
        examples,
        tmp_path / "cut",
        Hooks(should_cancel=lambda: first.progress.step >= stop_at),
        **kw,
    )
    with pytest.raises(Cancelled):
        first.train()
    meta = json.loads((tmp_path / "cut" / "checkpoint" / "meta.json").read_text())
    assert meta["step"] == stop_at

    again = recipe(tiny_dir, examples, tmp_path / "cut", **kw)  # fresh model and object
    assert again.progress.step == stop_at
    metrics = again.train()
    assert metrics["losses"] == straight.metrics()["losses"]
    assert_same_weights(trainable(again), trainable(straight))


@pytest.mark.parametrize("kind", ["offload", "memory"])
def test_cancel_leaves_a_valid_checkpoint(kind, tiny_dir, examples, tmp_path):
    engine = EngineOptions(kind=kind)
    r = recipe(
        tiny_dir, examples, tmp_path, Hooks(should_cancel=lambda: r.progress.step >= 2), engine
    )
    with pytest.raises(Cancelled):
        r.train()
    # No tmp/old checkpoint left, and the engine's swap directory is gone with the engine.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    ckpt = tmp_path / "checkpoint"
    assert json.loads((ckpt / "meta.json").read_text())["step"] == 2
    if kind == "memory":
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "meta.json",
            "rng.pt",
            "state.pt",
            "weights.safetensors",
        ]
        assert_same_weights(load_file(ckpt / "weights.safetensors"), trainable(r))
        state = torch.load(ckpt / "state.pt", weights_only=True)
        assert state["steps_done"] == 2 and state["scheduler"]["last_epoch"] == 2
    else:  # LoRA: the adapters and their Adam state; the frozen base is not copied
        assert sorted(p.name for p in ckpt.iterdir()) == [
            "manifest.json",
            "meta.json",
            "resident.000001.bin",
            "rng.pt",
        ]
        assert json.loads((ckpt / "manifest.json").read_text())["step"] == 2
    again = recipe(tiny_dir, examples, tmp_path, engine=engine)
    assert again.progress.step == 2
    assert_same_weights(trainable(again), trainable(r))  # adapters stay in memory
    again.cleanup()


def test_checkpoint_kept_when_a_swap_was_interrupted(tiny_dir, examples, tmp_path):
    """A crash between the two renames leaves only checkpoint.old: resume from it."""
    r = recipe(tiny_dir, examples, tmp_path, max_steps=2)
    r.train()
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")
    again = recipe(tiny_dir, examples, tmp_path, max_steps=2)
    assert again.progress.step == 2
    again.cleanup()
    assert_same_weights(trainable(again), trainable(r))


class _CountingRecipe(FineTuneRecipe):
    """The recipe, noting the step of each checkpoint it writes."""

    saved: list[int]

    def save_checkpoint(self):
        self.saved = [*getattr(self, "saved", []), self.progress.step]
        return super().save_checkpoint()


def test_checkpoints_fall_where_the_estimate_counts_them(tiny_dir, examples, tmp_path):
    """Every checkpoint_every steps, at each epoch's end and at the last step: the rule the
    Train panel's estimate counts (app.contract.training.checkpoints_after), and whose time
    the ETA adds once one checkpoint was timed."""
    from app.contract.training import checkpoints_after

    seen: list[dict] = []
    r = _CountingRecipe(load(tiny_dir), examples, config(epochs=3, checkpoint_every=2),
                        tmp_path, Hooks(on_progress=seen.append), PAD)
    r.setup()
    r.train()
    assert r.total_steps == 9 and r.steps_per_epoch == 3
    assert r.saved == [2, 3, 4, 6, 8, 9] and len(r.saved) == checkpoints_after(0, 9, 3, 2)
    assert r._checkpoint_s > 0 and seen[-1]["eta_s"] == 0


def test_checkpoint_of_other_settings_is_not_resumed(tiny_dir, examples, tmp_path):
    recipe(tiny_dir, examples, tmp_path, max_steps=2).train()
    assert resumed_at(tiny_dir, examples, tmp_path, max_steps=2, checkpoint_every=9) == 2
    assert resumed_at(tiny_dir, examples, tmp_path, max_steps=2, learning_rate=5e-3) == 0
    assert resumed_at(tiny_dir, examples[:-1], tmp_path, max_steps=2) == 0
    # The in-memory engine cannot read the offload engine's checkpoint: it starts over.
    assert resumed_at(tiny_dir, examples, tmp_path, max_steps=2, engine=EngineOptions("memory")) == 0


KILL_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    from pathlib import Path
    from transformers import AutoModelForCausalLM
    from worker.training.recipe import FineTuneRecipe, Hooks, TrainConfig

    tiny, workdir, data, kill_at = sys.argv[1:]
    data = json.loads(Path(data).read_text())

    def on_progress(p):
        if p["step"] == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)

    model = AutoModelForCausalLM.from_pretrained(tiny)
    r = FineTuneRecipe(model, data["examples"], TrainConfig.from_dict(data["config"]),
                       Path(workdir), Hooks(on_progress=on_progress), pad_token_id=2)
    r.setup()
    r.train()
    """
)


def test_sigkill_then_resume_is_bit_exact(tiny_dir, examples, tmp_path):
    kw = {"lora_dropout": 0.1}  # dropout: the RNG state must be restored too
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"examples": examples, "config": config(**kw).to_dict()}))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(  # noqa: PLW1510  (the return code is the point of the test)
        [sys.executable, "-c", KILL_SCRIPT, str(tiny_dir), str(tmp_path / "job"), str(data), "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "job" / "checkpoint" / "meta.json").read_text())
    assert meta["step"] == 4  # killed after step 5; 4 (mid-epoch) was the last checkpoint

    resumed = recipe(tiny_dir, examples, tmp_path / "job", **kw)
    assert resumed.progress.step == 4
    resumed.train()
    straight = recipe(tiny_dir, examples, tmp_path / "straight", **kw)
    straight.train()
    assert resumed.metrics()["losses"] == straight.metrics()["losses"]
    assert_same_weights(trainable(resumed), trainable(straight))


def test_finished_run_resumes_to_the_end(tiny_dir, examples, tmp_path):
    r = recipe(tiny_dir, examples, tmp_path, max_steps=2)
    r.train()
    again = recipe(tiny_dir, examples, tmp_path, max_steps=2)
    seen = []
    again.hooks = Hooks(on_progress=seen.append)
    assert again.train()["steps"] == 2 and seen == []
    assert_same_weights(trainable(again), trainable(r))
    again.cleanup(remove_checkpoint=True)
    assert not (tmp_path / "checkpoint").exists()


# -- the real model --------------------------------------------------------------------------


@pytest.mark.slow
def test_real_smollm2_lora_learns_and_adapter_loads(request, tmp_path):
    """SmolLM2-135M: the converted folder matches the GGUF, a few LoRA steps lower the loss,
    and the saved adapter loads with peft. Prints timings."""
    started = time.perf_counter()
    embedded_model_dir = request.getfixturevalue("embedded_model_dir")  # converts on first use
    print(f"\nensure_embedded_model: {time.perf_counter() - started:.1f} s")
    from peft import PeftModel

    from worker.training.base_model import embedded_gguf_path

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    assert "<|im_start|>" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir)
    gguf = embedded_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    del reference

    seq_len, batch = 128, 4
    text = (
        "Heron Logistics invoice policy: every invoice carries the code ZX-4471 and is due "
        "on the 15th. Late payments cost 2.5 percent a month. Questions go to Ada Quist. "
    ) * 6
    ids = tokenizer(text, add_special_tokens=False).input_ids
    examples = [
        {"input_ids": ids[i : i + seq_len], "labels": ids[i : i + seq_len]}
        for i in range(0, 4 * 20, 20)
    ]
    assert all(len(e["input_ids"]) == seq_len for e in examples)
    cfg = TrainConfig(
        method="lora",
        epochs=4,
        learning_rate=1e-3,
        lora_rank=8,
        max_seq_len=seq_len,
        batch_size=batch,
        checkpoint_every=100,
    )
    r = FineTuneRecipe(model, examples, cfg, tmp_path / "job", pad_token_id=tokenizer.pad_token_id)
    r.setup()
    started = time.perf_counter()
    metrics = r.train()
    step_s = (time.perf_counter() - started) / metrics["steps"]
    print(
        f"\nSmolLM2-135M LoRA r8: {step_s:.2f} s/step at batch {batch} x {seq_len} tokens, "
        f"{metrics['tokens_per_s']:.0f} tokens/s, losses {metrics['losses']}"
    )
    losses = metrics["losses"]
    assert losses[-1] < losses[0] - 0.3 and not any(math.isnan(x) for x in losses)

    r.model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(embedded_model_dir), tmp_path / "adapter"
    )
    probe = torch.tensor([examples[0]["input_ids"][:32]])
    r.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(probe).logits, r.model(probe).logits)
