"""A tuned model moved part of the way back to its base model, in weight space.

Weight-space ensembling (Wortsman et al. 2022, "Robust fine-tuning of zero-shot models",
WiSE-FT): the weights base + s * (tuned - base) for 0 <= s <= 1 keep much of what tuning
taught at s near 1 and much of what the base model knew at s near 0. For a LoRA model that
is the adapter's scale (every LoRA layer's `scaling` times s, peft's `set_scale`); for a
fully tuned one, the weights interpolated against a copy of the base model's.
"""

from __future__ import annotations

import torch


class Blend:
    """Set a tuned model's weights to base + s * (tuned - base), for any s, as often as
    wanted. `base_state` (the base model's state dict) is needed for a fully tuned model
    and ignored for a LoRA one."""

    def __init__(self, model: torch.nn.Module, base_state: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.lora = [m for m in model.modules() if hasattr(m, "set_scale") and hasattr(m, "r")]
        self.base: dict[str, torch.Tensor] = {}
        self.tuned: dict[str, torch.Tensor] = {}
        if not self.lora:
            if base_state is None:
                raise ValueError("a fully tuned model blends only against its base weights")
            for name, p in model.named_parameters():
                base = base_state[name].to(p.device, p.dtype)
                if not torch.equal(base, p.detach()):
                    self.base[name] = base
                    self.tuned[name] = p.detach().clone()

    @torch.no_grad()
    def set(self, s: float) -> None:
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"blend {s} is outside 0..1")
        for layer in self.lora:
            for adapter in layer.scaling:
                layer.set_scale(adapter, s)
        params = dict(self.model.named_parameters())
        for name, base in self.base.items():
            params[name].copy_(torch.lerp(base, self.tuned[name], s))
