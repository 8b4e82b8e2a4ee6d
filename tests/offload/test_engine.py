"""The engine trains exactly like plain in-memory torch while every block streams."""

from __future__ import annotations

import pytest
import torch

from offload import (
    AdamWConfig,
    OffloadBudgetError,
    OffloadConfig,
    OffloadEngine,
    OffloadError,
    find_blocks,
    probe_o_direct,
)
from tests.offload._factories import (
    assert_same_weights,
    make_batch,
    n_label_tokens,
    reference_adamw,
    reference_step,
    state_bytes,
    summed_loss,
    tiny_llama,
)

STEPS = 20
LR, WD = 1e-2, 0.1
# 12 blocks of ~250 KB per tensor kind; the resident group (embeddings, lm_head) is small,
# so blocks hold most of the training state (~12 MB), and 3 MB is well under a third of it.
DEEP = {"num_hidden_layers": 12, "intermediate_size": 256, "vocab_size": 128}
BUDGET = 3_000_000
ACT = 900_000


def _engine(model, tmp_path, clip=None, budget=BUDGET, **cfg) -> OffloadEngine:
    opt = AdamWConfig(lr=LR, weight_decay=WD, max_grad_norm=clip)
    cfg.setdefault("prefetch", 1)
    cfg.setdefault("activation_bytes", ACT)
    return OffloadEngine(model, opt, OffloadConfig(budget, str(tmp_path / "swap"), **cfg))


@pytest.mark.parametrize(
    ("clip", "o_direct"),
    [(None, True), (None, False), (1.0, "auto")],
    ids=["noclip-odirect", "noclip-buffered", "clip-auto"],
)
def test_full_finetune_bitwise_equal_to_in_memory(tmp_path, clip, o_direct):
    ref = tiny_llama(**DEEP)
    ropt = reference_adamw(ref, LR, WD)
    model = tiny_llama(**DEEP)
    assert state_bytes(model) >= 3 * BUDGET
    eng = _engine(model, tmp_path, clip=clip, o_direct=o_direct)
    assert eng.streaming, "the budget must be too small to keep blocks resident"

    ref_losses = [reference_step(ref, ropt, make_batch(s, vocab=128), clip) for s in range(STEPS)]
    eng_losses = [eng.step(make_batch(s, vocab=128)) for s in range(STEPS)]

    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    t = eng.telemetry()
    n_blocks = len(find_blocks(model))
    region = t["page_bytes"]
    # Every block's weights are read in the forward and again in the backward, its Adam
    # m and v are read and all three written back: the pool is far too small to cache them.
    assert t["bytes_read"] >= STEPS * n_blocks * 3 * region
    assert t["bytes_written"] >= STEPS * n_blocks * 3 * region
    assert t["peak_bytes"] <= BUDGET
    assert t["o_direct"] is (probe_o_direct(tmp_path) if o_direct == "auto" else o_direct)
    if clip is not None:
        assert t["last_grad_norm"] > 0
    eng.close()


def test_micro_batches_custom_loss_schedule_and_clip(tmp_path):
    """The recipe's arithmetic (worker/training/engines.py's InMemoryEngine): summed loss over the
    batch's label tokens, gradient accumulation over micro-batches, clipping, 1-D
    parameters without weight decay, a learning rate set before each step; tied
    embeddings, as SmolLM2 has."""
    ref = tiny_llama(tie_word_embeddings=True)
    ropt = reference_adamw(ref, LR, WD, no_decay_1d=True)
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    opt = AdamWConfig(lr=LR, weight_decay=WD, max_grad_norm=0.5, no_decay_1d=True)
    eng = OffloadEngine(
        model,
        opt,
        OffloadConfig(4_000_000, str(tmp_path / "swap"), prefetch=2, activation_bytes=1_500_000),
    )
    assert eng.streaming

    def lr_at(step: int) -> float:
        return LR * min(1.0, (step + 1) / 4)

    ref_losses, eng_losses = [], []
    for s in range(STEPS):
        batch = make_batch(s, batch=5)
        for g in ropt.param_groups:
            g["lr"] = lr_at(s)
        ref_losses.append(reference_step(ref, ropt, batch, clip=0.5, micro_batches=3, loss="sum"))
        eng.set_lr(lr_at(s))
        eng_losses.append(
            eng.step(batch, loss_fn=_loss_over(n_label_tokens(batch)), micro_batches=3)
        )
    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def _loss_over(denom: int):
    return lambda model, micro: summed_loss(model, micro) / denom


def test_dropout_replays_the_same_masks(tmp_path):
    """The backward recomputes each block: with dropout on, the recompute must draw the
    masks the forward drew (the engine replays the CPU RNG state per block)."""
    ref, model = tiny_llama(attention_dropout=0.3), tiny_llama(attention_dropout=0.3)
    ropt = reference_adamw(ref, LR, WD)
    eng = _engine(model, tmp_path, budget=2_500_000)
    torch.manual_seed(7)
    ref_losses = [reference_step(ref, ropt, make_batch(s)) for s in range(5)]
    torch.manual_seed(7)
    eng_losses = [eng.step(make_batch(s)) for s in range(5)]
    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def test_inference_streams_and_training_outside_step_is_refused(tmp_path):
    ref, model = tiny_llama(), tiny_llama()
    ropt = reference_adamw(ref, LR, WD)
    eng = _engine(model, tmp_path, budget=2_500_000)
    for s in range(3):
        reference_step(ref, ropt, make_batch(s))
        eng.step(make_batch(s))
    batch = make_batch(99)
    with torch.no_grad():
        expected = ref(**batch).logits
        got = model(**batch).logits  # blocks page in and out under no_grad
    assert torch.equal(expected, got)
    assert eng.evaluate(batch) == ref(**batch).loss.item()
    with pytest.raises(OffloadError, match="engine.step"):
        model(**batch)
    eng.close(restore_weights=True)
    # After close the model is an ordinary in-memory model again.
    assert torch.equal(model(**batch).logits, ref(**batch).logits)


def test_budget_too_small_is_refused_with_a_breakdown(tmp_path):
    with pytest.raises(OffloadBudgetError, match="too small.*resident parameters"):
        _engine(tiny_llama(), tmp_path, budget=600_000, activation_bytes=100_000)
    assert not any((tmp_path / "swap").glob("*.swap"))


def test_batch_too_large_is_refused_before_anything_moves(tmp_path):
    ref, model = tiny_llama(), tiny_llama()
    ropt = reference_adamw(ref, LR, WD)
    eng = _engine(model, tmp_path, budget=2_500_000)
    with pytest.raises(OffloadBudgetError, match="activations"):
        eng.step(make_batch(0, batch=64, seq=64))
    # Nothing happened: the engine goes on and still matches the reference.
    for s in range(3):
        assert eng.step(make_batch(s)) == reference_step(ref, ropt, make_batch(s))
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def test_budget_large_enough_keeps_everything_cached(tmp_path):
    ref, model = tiny_llama(), tiny_llama()
    ropt = reference_adamw(ref, LR, WD)
    eng = _engine(model, tmp_path, budget=50_000_000)
    assert not eng.streaming
    start = eng.telemetry()
    for s in range(5):
        assert eng.step(make_batch(s)) == reference_step(ref, ropt, make_batch(s))
    t = eng.telemetry()
    # After the first touch nothing is read again, and nothing is written until a flush.
    n_regions = len(find_blocks(model)) * 4
    assert t["bytes_read"] - start["bytes_read"] <= n_regions * t["page_bytes"]
    assert t["bytes_written"] == start["bytes_written"]
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def test_failed_step_is_refused_until_a_checkpoint_is_loaded(tmp_path):
    ref, model = tiny_llama(), tiny_llama()
    ropt = reference_adamw(ref, LR, WD)
    eng = _engine(model, tmp_path, budget=2_500_000)
    for s in range(3):
        reference_step(ref, ropt, make_batch(s))
        eng.step(make_batch(s))
    eng.save_checkpoint(tmp_path / "ckpt")

    # Fail in the middle of a backward: blocks 3 and 2 are already stepped by then.
    def boom(module, args):
        if torch.is_grad_enabled():
            raise RuntimeError("boom")

    handle = find_blocks(model)[1].mlp.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        eng.step(make_batch(3))
    handle.remove()
    with pytest.raises(OffloadError, match="load a checkpoint"):
        eng.step(make_batch(3))
    eng.load_checkpoint(tmp_path / "ckpt")
    for s in range(3, 6):
        assert eng.step(make_batch(s)) == reference_step(ref, ropt, make_batch(s))
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def test_configs_round_trip_through_dicts(tmp_path):
    cfg = OffloadConfig(1 << 30, str(tmp_path), prefetch=3, o_direct=False)
    assert OffloadConfig.from_dict(cfg.to_dict()) == cfg
    opt = AdamWConfig(lr=3e-4, betas=(0.9, 0.95), max_grad_norm=1.0, no_decay=("norm",))
    assert AdamWConfig.from_dict(opt.to_dict()) == opt
    with pytest.raises(ValueError, match="unknown"):
        OffloadConfig.from_dict({"budget_bytes": 1, "swap_dir": "x", "nope": 1})
    with pytest.raises(ValueError, match="o_direct"):
        OffloadConfig(1, "x", o_direct="maybe")


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize(("clip", "micro"), [(None, 1), (1.0, 1), (None, 2), (1.0, 3)])
def test_smallest_pool_never_deadlocks_and_still_matches(tmp_path, prefetch, clip, micro):
    """A pool of exactly the pages one block's step pins (4): prefetch, write-behind,
    spills and accumulation all have to share them without waiting on each other."""
    probe = _engine(tiny_llama(), tmp_path / "probe", budget=50_000_000)
    t = probe.telemetry()
    probe.close()
    budget = (
        t["resident_bytes"] + t["block_grad_bytes"] + t["scratch_bytes"] + ACT + 4 * t["page_bytes"]
    )
    ref, model = tiny_llama(), tiny_llama()
    ropt = reference_adamw(ref, LR, WD)
    eng = _engine(model, tmp_path / "tight", clip=clip, budget=budget, prefetch=prefetch)
    assert eng.telemetry()["pages"] == 4
    for s in range(3):
        batch = make_batch(s, batch=3)
        expected = reference_step(ref, ropt, batch, clip=clip, micro_batches=micro)
        assert eng.step(batch, micro_batches=micro) == expected
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()
