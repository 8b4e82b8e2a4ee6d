"""A small Llama-shaped language model in plain torch, for the benchmark and for engine
tests that must not depend on transformers (offload/ imports torch only).

Same block structure as Llama (RMSNorm, grouped-query causal attention, SwiGLU MLP,
residuals; no rotary embedding), blocks in a ModuleList, a `config` with Llama's field
names (so plan() and the engine's activation estimate read it), and a forward that takes
input_ids / labels and returns an object with .loss and .logits."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class ToyBlock(nn.Module):
    def __init__(self, cfg: SimpleNamespace):
        super().__init__()
        h, self.heads, self.kv_heads = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        )
        self.head_dim = h // self.heads
        kv = self.kv_heads * self.head_dim
        self.norm1, self.norm2 = _RMSNorm(h), _RMSNorm(h)
        self.q, self.k, self.v = (
            nn.Linear(h, h, bias=False),
            nn.Linear(h, kv, bias=False),
            (nn.Linear(h, kv, bias=False)),
        )
        self.o = nn.Linear(h, h, bias=False)
        self.gate = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(y).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class ToyLM(nn.Module):
    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 512,
        intermediate_size: int = 1408,
        num_hidden_layers: int = 8,
        num_attention_heads: int = 8,
        num_key_value_heads: int = 4,
    ):
        super().__init__()
        self.config = SimpleNamespace(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            tie_word_embeddings=False,
        )
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(ToyBlock(self.config) for _ in range(num_hidden_layers))
        self.norm = _RMSNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, **_: object
    ) -> SimpleNamespace:
        x = self.embed(input_ids)
        for block in self.layers:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        return SimpleNamespace(loss=loss, logits=logits)
