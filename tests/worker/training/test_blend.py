"""A tuned model blended back towards its base (worker/training/blend.py): at 0 it answers as
the base model, at 1 as the tuned one, in between its weights lie on the line."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tests.worker.conftest_training import tiny_model_dir
from worker.training.blend import Blend

IDS = torch.tensor([[5, 17, 33, 80, 120, 7]])


@pytest.fixture(scope="module")
def base(tmp_path_factory, smol_tokenizer):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(tmp_path_factory, smol_tokenizer))


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _perturb(params) -> None:
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


def test_a_lora_model_blends_by_its_adapter_scale(base):
    model = get_peft_model(
        copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    _perturb(p for n, p in model.named_parameters() if "lora_" in n)
    tuned, plain = _logits(model), _logits(base)
    assert not torch.allclose(tuned, plain, atol=1e-4)
    blend = Blend(model)
    blend.set(0.0)
    torch.testing.assert_close(_logits(model), plain)
    blend.set(0.5)
    half = _logits(model)
    assert not torch.allclose(half, plain, atol=1e-4)
    assert not torch.allclose(half, tuned, atol=1e-4)
    blend.set(1.0)
    torch.testing.assert_close(_logits(model), tuned)


def test_a_fully_tuned_model_blends_against_the_base_weights(base):
    model = copy.deepcopy(base)
    _perturb(p for n, p in model.named_parameters() if "mlp" in n)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    tuned_state = {k: v.clone() for k, v in model.state_dict().items()}
    blend = Blend(model, base_state)
    assert blend.base and all("mlp" in n for n in blend.base)  # only what training changed
    blend.set(0.25)
    for name, p in model.named_parameters():
        expected = base_state[name] + 0.25 * (tuned_state[name] - base_state[name])
        torch.testing.assert_close(p.detach(), expected)
    blend.set(0.0)
    torch.testing.assert_close(_logits(model), _logits(base))
    blend.set(1.0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), tuned_state[name])


def test_a_blend_outside_the_line_or_without_a_base_is_refused(base):
    with pytest.raises(ValueError, match="base weights"):
        Blend(copy.deepcopy(base))
    blend = Blend(copy.deepcopy(base), base.state_dict())
    with pytest.raises(ValueError, match="outside"):
        blend.set(1.5)
