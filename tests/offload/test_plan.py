"""plan(): the arithmetic behind "fits or not, and how long"."""

from __future__ import annotations

from offload import Plan, activation_bytes, plan
from tests.offload._factories import tiny_config, tiny_llama

GB = 10**9
# Big enough that parameters, not a tiny model's activations, dominate the state.
MID = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 12,
    "vocab_size": 4096,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
SEQ = 128


def test_parameter_count_matches_a_real_model():
    for kw in ({}, {"tie_word_embeddings": True}, {"num_key_value_heads": 4}):
        cfg = tiny_config(**kw)
        model = tiny_llama(**kw)
        p = plan(cfg, budget_bytes=GB, disk_gbps=1.0, flops=1e11)
        assert p.params == sum(q.numel() for q in model.parameters())


def test_fits_in_memory_needs_the_whole_state():
    cfg = tiny_config(**MID).to_dict()  # a plain dict works too
    big = plan(cfg, budget_bytes=GB, disk_gbps=2.0, flops=1e11, seq_len=SEQ)
    assert isinstance(big, Plan) and big.fits_in_memory and big.fits
    assert big.io_bytes_per_step == 0
    assert big.est_s_per_step == big.compute_s_per_step

    small = plan(cfg, budget_bytes=big.bytes_needed // 3, disk_gbps=2.0, flops=1e11, seq_len=SEQ)
    assert not small.fits_in_memory and small.fits  # streams
    assert small.min_budget_bytes <= big.bytes_needed // 3
    assert small.est_s_per_step >= small.compute_s_per_step
    assert small.est_total_s(100) == 100 * small.est_s_per_step

    none = plan(
        cfg, budget_bytes=small.min_budget_bytes - 1, disk_gbps=2.0, flops=1e11, seq_len=SEQ
    )
    assert not none.fits and none.est_s_per_step == float("inf")


def test_disk_bound_when_the_disk_is_slow():
    cfg = tiny_config(**MID)
    kw = {"disk_gbps": 0.001, "flops": 1e15, "seq_len": SEQ}
    p = plan(cfg, budget_bytes=1, **kw)
    streaming = plan(cfg, budget_bytes=p.min_budget_bytes, **kw)
    assert not streaming.fits_in_memory and streaming.fits
    assert streaming.est_s_per_step == streaming.io_s_per_step > streaming.compute_s_per_step
    clipped = plan(cfg, budget_bytes=p.min_budget_bytes * 2, clip=True, **kw)
    assert clipped.io_bytes_per_step > streaming.io_bytes_per_step  # gradients spill


def test_lora_moves_less_than_full():
    cfg = tiny_config(**MID)
    full = plan(cfg, budget_bytes=1, disk_gbps=1.0, flops=1e12, seq_len=SEQ)
    lora = plan(
        cfg, budget_bytes=1, disk_gbps=1.0, flops=1e12, seq_len=SEQ, mode="lora", lora_params=10_000
    )
    assert lora.bytes_needed < full.bytes_needed
    assert lora.min_budget_bytes < full.min_budget_bytes


def test_activation_estimate_grows_with_tokens():
    cfg = tiny_config()
    assert activation_bytes(cfg, 2, 64) > activation_bytes(cfg, 1, 64) > activation_bytes(cfg, 1, 8)
