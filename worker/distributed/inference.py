"""A causal LM answering on two (or more) ranks: tensor parallel (every block split, Megatron
style) or pipeline parallel (each rank a contiguous range of blocks), for the comparison of
issue 15 (`make bench-cluster`) and, later, the chat service on two machines.

Tensor parallel (`split_tensor_parallel`): in each block the query/key/value and the MLP's
gate/up projections keep their rank's share of output features (column parallel: its share
of the attention heads and of the MLP's width), the attention's output and the MLP's down
projections their share of input features (row parallel); the partial results of those two
are summed over the ranks (two all_reduces per block per forward). Embeddings, final norm and
the output layer stay whole on every rank, so every rank gets the same logits and picks the
same next token: no further message.

Pipeline parallel (`PipelineStage`): rank r holds blocks [r*L/n, (r+1)*L/n); the first also
the embeddings, the last the final norm and the output layer. A step's hidden states go from
stage to stage (one message per stage boundary), the next tokens from the last stage back to
the first. The batch is cut into micro-batches that follow each other through the stages
(GPipe's schedule, forward only), so while the last stage works on one micro-batch the
first works on the next; `bubble` is the share of a rank's time spent waiting.

Both run greedy decoding with each rank's own KV cache (transformers' DynamicCache) and are
checked against one process (tests/worker/distributed/test_inference.py)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers.cache_utils import DynamicCache

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")


def _shard(linear: torch.nn.Linear, dim: int, rank: int, world: int) -> None:
    """Keep rank's share of `linear`'s weight along `dim` (0: outputs, 1: inputs)."""
    size = linear.weight.shape[dim]
    if size % world:
        raise ValueError(f"{size} features do not split into {world} equal shares")
    part = size // world
    w = linear.weight.detach().narrow(dim, rank * part, part).clone()
    linear.weight = torch.nn.Parameter(w, requires_grad=False)
    if dim == 0:
        linear.out_features = part
        if linear.bias is not None:
            b = linear.bias.detach().narrow(0, rank * part, part).clone()
            linear.bias = torch.nn.Parameter(b, requires_grad=False)
    else:
        linear.in_features = part
        if linear.bias is not None and rank != 0:  # the bias is added once, after the sum
            linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias), requires_grad=False)


def _sum_over_ranks(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output, op=dist.ReduceOp.SUM)
    return output


def split_tensor_parallel(model: torch.nn.Module, rank: int, world: int) -> torch.nn.Module:
    """Megatron's split of every block of a Llama-shaped `model`, in place (see above)."""
    cfg = model.config
    if cfg.num_attention_heads % world or cfg.num_key_value_heads % world:
        raise ValueError(f"{cfg.num_attention_heads} query and {cfg.num_key_value_heads} "
                         f"key/value heads do not split into {world} equal shares")
    for layer in model.model.layers:
        for name, module in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
            if name in COLUMN:
                _shard(module, 0, rank, world)
            elif name in ROW:
                _shard(module, 1, rank, world)
                module.register_forward_hook(_sum_over_ranks)
    return model


@torch.no_grad()
def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float, float]:
    """Greedy decoding of `new_tokens` after the prompts `ids` (B, P), one process or
    tensor parallel: (tokens (B, new), seconds to the first token, seconds for the rest)."""
    cache = DynamicCache(config=model.config)
    started = time.perf_counter()
    logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
    tok = logits.argmax(-1, keepdim=True)
    first = time.perf_counter() - started
    out = [tok]
    started = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits = model(input_ids=tok, cache=cache, use_cache=True).logits[:, -1]
        tok = logits.argmax(-1, keepdim=True)
        out.append(tok)
    return torch.cat(out, 1), first, time.perf_counter() - started


@dataclass
class StageClock:
    """Where a stage's time went: computing, or waiting for the other stages."""

    compute_s: float = 0.0
    wait_s: float = 0.0
    sent_bytes: int = 0

    @property
    def bubble(self) -> float:
        total = self.compute_s + self.wait_s
        return self.wait_s / total if total else 0.0


class PipelineStage:
    """Rank `rank` of `world` stages of a Llama-shaped `model` (cut in place)."""

    def __init__(self, model: torch.nn.Module, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.first, self.last = rank == 0, rank == world - 1
        inner = model.model
        n = len(inner.layers)
        lo, hi = rank * n // world, (rank + 1) * n // world
        layers = list(inner.layers)[lo:hi]
        for i, layer in enumerate(layers):  # the stage's own cache counts from 0
            layer.self_attn.layer_idx = i
        cfg = copy.deepcopy(model.config)
        cfg.num_hidden_layers = hi - lo
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[lo:hi]
        inner.layers = torch.nn.ModuleList(layers)
        inner.config = cfg
        if not self.last:
            inner.norm = torch.nn.Identity()
        self.model, self.config, self.hidden = model, cfg, model.config.hidden_size
        self.clock = StageClock()
        self._pending: list = []

    def _run(self, cache: DynamicCache, ids: torch.Tensor | None, h: torch.Tensor | None):
        started = time.perf_counter()
        out = self.model.model(input_ids=ids if self.first else None,
                               inputs_embeds=None if self.first else h,
                               cache=cache, use_cache=True).last_hidden_state
        if self.last:
            out = self.model.lm_head(out[:, -1]).argmax(-1, keepdim=True)
        self.clock.compute_s += time.perf_counter() - started
        return out

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        started = time.perf_counter()
        dist.recv(t, src=src)
        self.clock.wait_s += time.perf_counter() - started
        return t

    def _send(self, t: torch.Tensor, dst: int) -> None:
        """Sent without waiting (the stage goes on to its next micro-batch); `_flush` waits."""
        t = t.contiguous()
        self._pending.append((dist.isend(t, dst=dst), t))
        self.clock.sent_bytes += t.numel() * t.element_size()

    def _flush(self) -> None:
        started = time.perf_counter()
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        self.clock.wait_s += time.perf_counter() - started

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, new_tokens: int, micro: int
               ) -> tuple[torch.Tensor | None, float, float]:
        """Greedy decoding as `greedy` does, the batch in `micro` micro-batches through the
        stages. The first stage holds the prompts and returns the tokens (B, new) with the
        seconds to the first token (of every prompt) and for the rest; the others None.

        The first stage feeds a micro-batch's next step as soon as its token is back, so
        the micro-batches follow each other through the stages without a pause at the
        steps' ends (the bubble is the pipeline's fill and drain, and the waits)."""
        sizes = [len(p) for p in torch.tensor_split(ids, micro)]
        parts = list(torch.tensor_split(ids, micro))
        caches = [DynamicCache(config=self.config) for _ in sizes]
        toks: list[list[torch.Tensor]] = [[] for _ in sizes]
        started = time.perf_counter()
        first_s = 0.0
        for t in range(new_tokens + (1 if self.first else 0)):
            for i, b in enumerate(sizes):
                if self.first:
                    if t > 0:  # the token step t-1 made for this micro-batch
                        toks[i].append(self._recv((b, 1), torch.long, self.world - 1))
                        if t == 1 and i == len(sizes) - 1:
                            first_s = time.perf_counter() - started
                    if t < new_tokens:
                        self._send(self._run(caches[i], parts[i] if t == 0 else toks[i][-1],
                                             None), self.rank + 1)
                else:
                    h = self._recv((b, ids.shape[1] if t == 0 else 1, self.hidden),
                                   torch.float32, self.rank - 1)
                    self._send(self._run(caches[i], None, h), 0 if self.last else self.rank + 1)
            self._flush()
        if not self.first:
            return None, 0.0, 0.0
        tokens = torch.cat([torch.cat(ts, 1) for ts in toks], 0)
        return tokens, first_s, time.perf_counter() - started - first_s
