"""Back-of-the-envelope planning: does a model train under a budget, and how fast.

Pure arithmetic from a Llama-shaped config (hidden_size, intermediate_size,
num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size,
tie_word_embeddings), a memory budget, a disk speed and a compute speed. It is an
estimate to show a user before a job starts, not a promise; the engine measures the
real figures (telemetry) while it runs.

Model of a full fine-tuning step with every block streamed (fp32 unless dtype_bytes
says otherwise; P_b = one block's parameter bytes):
  reads  per block: forward weights, backward weights, Adam m, Adam v      = 4 P_b
  writes per block: weights, m, v after the block's step                   = 3 P_b
  with clipping, gradients are spilled and read back, weights read again:
  reads 6 P_b, writes 4 P_b.
  compute: 2 flops per parameter per token forward, 4 backward, and 2 more for the
  per-block recompute of activation checkpointing: 8 N T flops.
  Disk and compute overlap (prefetch), so a step takes max(io, compute).
LoRA reads the frozen weights twice (forward, backward recompute) and writes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def _get(cfg: Any, name: str, default=None):
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


@dataclass
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @classmethod
    def of(cls, cfg: Any) -> ModelShape:
        heads = int(_get(cfg, "num_attention_heads"))
        return cls(
            hidden=int(_get(cfg, "hidden_size")),
            intermediate=int(_get(cfg, "intermediate_size")),
            layers=int(_get(cfg, "num_hidden_layers")),
            heads=heads,
            kv_heads=int(_get(cfg, "num_key_value_heads", None) or heads),
            vocab=int(_get(cfg, "vocab_size")),
            tied=bool(_get(cfg, "tie_word_embeddings", False)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> int:
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv
        mlp = 3 * h * self.intermediate
        return attn + mlp + 2 * h

    def resident_params(self) -> int:
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied else 2) + self.hidden


def activation_bytes(cfg: Any, batch: int, seq: int, dtype_bytes: int = 4) -> int:
    """Estimated activation memory of one step under per-block checkpointing.

    Block inputs kept for the backward: (L + 1) x B S H. One block recomputed with its
    autograd graph, and its gradients in flight: ~2 x (12 H + 3 KV + 4 I) per token
    plus attention scores (2 x heads x S per token). Logits, the loss's upcast and
    log-softmax, and their gradients: 5 x B S V."""
    m = ModelShape.of(cfg)
    tokens = batch * seq
    kv = m.kv_heads * m.head_dim
    kept = (m.layers + 1) * tokens * m.hidden
    block = 2 * tokens * (12 * m.hidden + 3 * kv + 4 * m.intermediate + 2 * m.heads * seq)
    logits = 5 * tokens * m.vocab
    return (kept + block + logits) * dtype_bytes


def graph_bytes(cfg: Any, batch: int, seq: int, dtype_bytes: int = 4) -> int:
    """Estimated memory of every block's autograd graph, kept from the forward to the
    backward (no recompute): per block and token 12 H + 3 KV + 4 I + 2 x heads x S values.
    Measured for Llama blocks (transformers 5, SDPA attention, peft LoRA or full): about
    9 H + 4 I + 2 KV saved values, so this errs high by about a third."""
    m = ModelShape.of(cfg)
    kv = m.kv_heads * m.head_dim
    per_token = 12 * m.hidden + 3 * kv + 4 * m.intermediate + 2 * m.heads * seq
    return m.layers * batch * seq * per_token * dtype_bytes


@dataclass
class Plan:
    """What plan() worked out; all sizes in bytes, times in seconds."""

    fits_in_memory: bool  # the whole training state fits the budget: nothing streams
    fits: bool  # the engine can train under the budget (streaming if needed)
    bytes_needed: int  # training state + activations held in memory without offload
    min_budget_bytes: int  # smallest budget the engine can train with
    swap_bytes: int  # disk space for the swap files
    io_bytes_per_step: int
    compute_s_per_step: float
    io_s_per_step: float
    est_s_per_step: float
    params: int

    def est_total_s(self, steps: int) -> float:
        return self.est_s_per_step * steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    model_config: Any,
    budget_bytes: int,
    disk_gbps: float,
    flops: float,
    *,
    batch_size: int = 1,
    seq_len: int = 512,
    mode: str = "full",
    clip: bool = False,
    dtype_bytes: int = 4,
    lora_params: int = 0,
) -> Plan:
    """Estimate whether and how fast a Llama-shaped model trains under `budget_bytes`.

    disk_gbps: the swap disk's sustained rate in GB/s (reads and writes alike).
    flops: sustained compute in FLOP/s of the device doing the math.
    mode: "full" (every parameter trains) or "lora" (`lora_params` adapter parameters
    train, base weights frozen)."""
    if mode not in ("full", "lora"):
        raise ValueError("mode must be 'full' or 'lora'")
    m = ModelShape.of(model_config)
    pb = m.block_params() * dtype_bytes
    resident = m.resident_params() * dtype_bytes
    n_params = m.block_params() * m.layers + m.resident_params()
    act = activation_bytes(model_config, batch_size, seq_len, dtype_bytes)
    tokens = batch_size * seq_len

    if mode == "full":
        state_per_param = 4  # weights, grads, Adam m, Adam v
        bytes_needed = n_params * dtype_bytes * state_per_param + act
        reads, writes = (6, 4) if clip else (4, 3)
        io_bytes = (reads + writes) * pb * m.layers
        pages = 4 if clip else 3
        min_budget = resident * 4 + pb + pages * pb + act  # + one block's gradients
        swap = pb * m.layers * (4 if clip else 3)
        compute = 8 * n_params * tokens / flops
    else:
        lora_bytes = lora_params * dtype_bytes * 4
        bytes_needed = n_params * dtype_bytes + lora_bytes + act
        io_bytes = 2 * pb * m.layers
        min_budget = resident + lora_bytes + pb + act
        swap = pb * m.layers
        # frozen base: no weight gradients, but the input gradients still cost ~2 N T
        compute = 6 * n_params * tokens / flops

    io_s = io_bytes / (disk_gbps * 1e9) if disk_gbps > 0 else float("inf")
    fits_in_memory = bytes_needed <= budget_bytes
    fits = fits_in_memory or min_budget <= budget_bytes
    est = compute if fits_in_memory else max(compute, io_s)
    return Plan(
        fits_in_memory=fits_in_memory,
        fits=fits,
        bytes_needed=int(bytes_needed),
        min_budget_bytes=int(min_budget),
        swap_bytes=int(swap),
        io_bytes_per_step=int(io_bytes) if not fits_in_memory else 0,
        compute_s_per_step=compute,
        io_s_per_step=io_s if not fits_in_memory else 0.0,
        est_s_per_step=est if fits else float("inf"),
        params=int(n_params),
    )
