"""Frozen base (LoRA): base weights stream read-only, adapters stay resident."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from offload import AdamWConfig, OffloadConfig, OffloadEngine
from tests.offload._factories import (
    assert_same_weights,
    make_batch,
    reference_adamw,
    reference_step,
    tiny_llama,
)

# peft calls a transformers method that transformers 5 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")


def lora_model():
    base = tiny_llama(seed=0)
    torch.manual_seed(1)
    cfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    return get_peft_model(base, cfg)


def test_lora_bitwise_equal_to_plain_peft(tmp_path):
    ref, model = lora_model(), lora_model()
    ropt = reference_adamw(ref, 1e-2, 0.0)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0),
        OffloadConfig(1_500_000, str(tmp_path / "swap"), prefetch=1, activation_bytes=700_000),
    )
    assert eng.mode == "frozen_base" and eng.streaming
    written_at_start = eng.telemetry()["bytes_written"]

    torch.manual_seed(5)  # lora_dropout draws masks: both runs start from the same state
    ref_losses = [reference_step(ref, ropt, make_batch(s), clip=1.0) for s in range(20)]
    torch.manual_seed(5)
    eng_losses = [eng.step(make_batch(s)) for s in range(20)]

    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    t = eng.telemetry()
    assert t["bytes_written"] == written_at_start  # read-only: nothing written back
    # The pool holds fewer blocks than the model has, so blocks are read again every step
    # (the few pages left over act as a cache: ~2 of the 8 block visits per step miss).
    assert t["pages"] < 4
    assert t["bytes_read"] >= 20 * 2 * t["page_bytes"]
    assert t["peak_bytes"] <= 1_500_000

    # Checkpoints hold the adapters and their optimizer state, not the frozen base.
    eng.save_checkpoint(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "manifest.json",
        "resident.000001.bin",
    ]
    other = OffloadEngine(
        lora_model(),
        AdamWConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0),
        OffloadConfig(1_500_000, str(tmp_path / "swap2"), prefetch=1, activation_bytes=700_000),
    )
    other.load_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(9)
    a = [eng.step(make_batch(s)) for s in range(20, 23)]
    torch.manual_seed(9)
    b = [other.step(make_batch(s)) for s in range(20, 23)]
    assert a == b
    assert_same_weights(eng.model_state_dict(), other.model_state_dict())
    eng.close()
    other.close()


def test_frozen_base_streams_from_the_safetensors_file(tmp_path):
    """Base weights are read where they already are: no swap copy, no byte written. A
    block whose weights no longer match the file (changed after loading) uses the swap."""
    from transformers import LlamaForCausalLM

    tiny_llama(seed=0).save_pretrained(tmp_path / "base")  # model.safetensors, float32
    files = sorted((tmp_path / "base").glob("*.safetensors"))

    def load():
        base = LlamaForCausalLM.from_pretrained(tmp_path / "base")
        torch.manual_seed(1)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        return get_peft_model(base, cfg)

    ref, model = load(), load()
    ropt = reference_adamw(ref, 1e-2, 0.0)
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.0),
        OffloadConfig(1_500_000, str(tmp_path / "swap"), prefetch=1, activation_bytes=700_000),
        weights_files=files,
    )
    t = eng.telemetry()
    assert t["blocks_read_from_weights_files"] == 4
    assert t["swap_bytes"] == 0 and t["bytes_written"] == 0
    ref_losses = [reference_step(ref, ropt, make_batch(s)) for s in range(10)]
    eng_losses = [eng.step(make_batch(s)) for s in range(10)]
    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    t = eng.telemetry()
    assert t["bytes_written"] == 0 and t["bytes_read"] > 10 * t["page_bytes"]
    eng.close()

    changed = load()
    with torch.no_grad():
        changed.base_model.model.model.layers[2].mlp.up_proj.weight.add_(1.0)
    eng = OffloadEngine(
        changed,
        AdamWConfig(lr=1e-2),
        OffloadConfig(1_500_000, str(tmp_path / "swap2"), activation_bytes=700_000),
        weights_files=files,
    )
    assert eng.telemetry()["blocks_read_from_weights_files"] == 3
    eng.close()


def test_evaluate_is_the_eval_mode_loss_and_draws_no_dropout(tmp_path):
    """evaluate() runs without dropout and without touching the generators (it drew LoRA
    dropout masks before: two engines with the same weights evaluated differently), and
    leaves the model in the mode it found it."""
    ref, model = lora_model(), lora_model()
    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=1.0),
        OffloadConfig(1_500_000, str(tmp_path / "swap"), prefetch=1, activation_bytes=700_000),
    )
    batch = make_batch(3)
    ref.eval()
    with torch.no_grad():
        expected = ref(**batch).loss.item()
    rng = torch.get_rng_state()
    assert eng.evaluate(batch) == eng.evaluate(batch) == expected
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training
    eng.close()
