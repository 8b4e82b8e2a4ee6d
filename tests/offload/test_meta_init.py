"""A model built on the meta device is created block by block in the swap (init_weights)."""

from __future__ import annotations

import zlib

import pytest
import torch
from transformers import LlamaForCausalLM

from offload import AdamWConfig, OffloadConfig, OffloadEngine
from tests.offload._factories import (
    assert_same_weights,
    make_batch,
    reference_adamw,
    reference_step,
    tiny_config,
)

SHAPE = {"num_hidden_layers": 6}


def init(name: str, t: torch.Tensor) -> None:
    """Deterministic per-name values: the same whether the tensor is a page view or not."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if t.ndim >= 2:
        t.normal_(0.0, 0.02, generator=g)
    else:
        t.fill_(1.0)


def test_meta_model_trains_like_one_built_in_memory(tmp_path):
    cfg = tiny_config(**SHAPE)
    ref = LlamaForCausalLM(cfg)
    for n, p in ref.model.layers.named_parameters(prefix="model.layers"):
        init(n, p.data)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.model.rotary_emb = type(ref.model.rotary_emb)(cfg)  # buffers: real, not meta
    model.model.embed_tokens.weight = torch.nn.Parameter(ref.model.embed_tokens.weight.clone())
    model.model.norm.weight = torch.nn.Parameter(ref.model.norm.weight.clone())
    model.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.clone())
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())

    seen = []

    def record(name, t):
        seen.append(name)
        init(name, t)

    eng = OffloadEngine(
        model,
        AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0),
        OffloadConfig(2_500_000, str(tmp_path / "swap"), prefetch=1, activation_bytes=600_000),
        init_weights=record,
    )
    assert eng.streaming
    assert sorted(seen) == sorted(n for n, _ in ref.model.layers.named_parameters("model.layers"))
    assert not any(p.device.type == "meta" for p in model.parameters())

    ropt = reference_adamw(ref, 1e-2, 0.1)
    ref_losses = [reference_step(ref, ropt, make_batch(s), clip=1.0) for s in range(4)]
    eng_losses = [eng.step(make_batch(s)) for s in range(4)]
    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    eng.close()


def test_meta_parameters_need_init_weights(tmp_path):
    with torch.device("meta"):
        model = LlamaForCausalLM(tiny_config(**SHAPE))
    with pytest.raises(NotImplementedError):
        OffloadEngine(model, AdamWConfig(), OffloadConfig(2_000_000, str(tmp_path / "swap")))
