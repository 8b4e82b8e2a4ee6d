"""The CUDA path's device-independent parts, on the CPU: where memory goes (the plan),
which slot holds which block, RNG replay, and the engine's whole CUDA control flow run
with CPU stand-ins for streams and events (tests/offload/test_cuda.py runs it on a GPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model

import offload._device as device_mod
import offload.engine as engine_mod
from offload import AdamWConfig, OffloadConfig, OffloadEngine, OffloadError
from offload._device import (
    DeviceCopies,
    SlotTable,
    plan_device_memory,
    replay_rng,
    resolve_device,
    rng_state,
)
from offload._layout import WEIGHT, BlockLayout
from tests.offload._factories import (
    assert_same_weights,
    make_batch,
    reference_adamw,
    reference_step,
    state_bytes,
    tiny_llama,
)

DEEP = {"num_hidden_layers": 12, "intermediate_size": 256, "vocab_size": 128}
LR, WD = 1e-2, 0.1
GPU_BUDGET = 3_000_000  # the "device" side: resident group, 2 slots, a block's grads, acts
HOST_BUDGET = 2_500_000  # the pool: ~8 of the 48 regions
ACT = 900_000


# -- the plan ---------------------------------------------------------------------------------


def test_device_plan_puts_the_pool_on_the_host_and_two_block_copies_on_the_gpu():
    model = tiny_llama(**DEEP)
    blocks = list(model.model.layers)
    named = dict(model.named_parameters())
    name_of = {id(p): n for n, p in named.items()}
    layouts = [
        BlockLayout(i, [(name_of[id(p)], p) for p in b.parameters()], [])
        for i, b in enumerate(blocks)
    ]
    slot = max(layout.region_bytes[WEIGHT] for layout in layouts)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    resident = sum(p.numel() * 4 for p in model.parameters() if id(p) not in in_blocks)
    block_grads = max(layout.weight_bytes() for layout in layouts)

    plan = plan_device_memory(
        GPU_BUDGET,
        HOST_BUDGET,
        resident_bytes=4 * resident,
        resident_trainable_bytes=resident,
        block_grad_bytes=block_grads,
        staging_bytes=slot,
        host_scratch_bytes=2 * 65536,
        slot_bytes=slot,
    )
    # The GPU holds two blocks' weights of twelve, not the pool: far under the state.
    assert plan.slots == 2
    assert plan.device_fixed == 4 * resident + 2 * slot + block_grads + 2 * resident
    assert plan.device_fixed < state_bytes(model) / 10
    assert plan.activations == GPU_BUDGET - plan.device_fixed >= ACT
    assert plan.host_fixed == slot + 2 * 65536
    assert plan.pool_room == HOST_BUDGET - plan.host_fixed
    assert plan.pool_room // slot < 4 * len(blocks)  # the pool cannot hold every region


# -- slots ------------------------------------------------------------------------------------


def test_slot_table_keeps_the_last_blocks_for_the_backward():
    t = SlotTable(2)
    n = 5
    s0 = t.assign(0)
    for i in range(n):  # forward: block i computes while block i+1 is copied
        s = t.find(i)
        t.use(s)
        t.done(s)
        if i + 1 < n:
            nxt = t.assign(i + 1)
            assert nxt != s  # never the slot just computed from
    assert s0 in (0, 1)
    # The turn: the last two blocks are still there, so the backward starts without a copy.
    assert t.find(n - 1) is not None and t.find(n - 2) is not None
    t.use(t.find(n - 1))
    with pytest.raises(ValueError):
        t.assign(n - 1)  # a block has one slot at most
    t.done(t.find(n - 1))
    t.invalidate(n - 1)  # stepped: its copy is stale
    assert t.find(n - 1) is None and t.find(n - 2) is not None
    t.use(t.find(n - 2))
    held = t.find(n - 2)
    assert t.assign(n - 3) != held  # takes the free slot, not the one in use
    t.use(t.find(n - 3))
    with pytest.raises(OffloadError):
        t.assign(n - 4)  # both slots in use: an engine bug, not a wait
    t.invalidate()
    assert t.block == [None, None]


# -- devices and RNG --------------------------------------------------------------------------


def test_resolve_device():
    cpu = [torch.zeros(1)]
    assert resolve_device(None, cpu) == torch.device("cpu")
    assert resolve_device(None, []) == torch.device("cpu")
    assert resolve_device("cpu", cpu) == torch.device("cpu")
    with pytest.raises(OffloadError, match="several devices"):
        resolve_device(None, [torch.zeros(1), torch.zeros(1, device="meta")])
    with pytest.raises(NotImplementedError):
        resolve_device("meta", cpu)
    if not torch.cuda.is_available():
        with pytest.raises(OffloadError, match="CUDA is not available"):
            resolve_device("cuda", cpu)


def test_replay_rng_draws_the_same_dropout_and_leaves_the_generator_alone():
    torch.manual_seed(3)
    state = rng_state(torch.device("cpu"))
    first = torch.nn.functional.dropout(torch.ones(64), 0.5)
    after = torch.get_rng_state()
    with replay_rng(state, torch.device("cpu")):
        again = torch.nn.functional.dropout(torch.ones(64), 0.5)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


def test_engine_device_option_on_a_cpu_machine(tmp_path):
    eng = OffloadEngine(
        tiny_llama(),
        AdamWConfig(),
        OffloadConfig(3_000_000, str(tmp_path / "a"), device="cpu", activation_bytes=ACT),
    )
    assert eng.telemetry()["device"] == "cpu" and "h2d_bytes" not in eng.telemetry()
    eng.close()
    cfg = OffloadConfig(3_000_000, str(tmp_path / "b"), device="cuda", host_budget_bytes=1 << 20)
    assert OffloadConfig.from_dict(cfg.to_dict()) == cfg
    if not torch.cuda.is_available():
        with pytest.raises(OffloadError, match="CUDA is not available"):
            OffloadEngine(tiny_llama(), AdamWConfig(), cfg)


# -- the CUDA control flow on the CPU ---------------------------------------------------------


class _Done:
    """A stream or event that has always finished (CPU copies are synchronous)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_event(self, event) -> None:
        assert isinstance(event, _Done)


class CpuCopies(DeviceCopies):
    """DeviceCopies with its CUDA primitives replaced: slots in host memory."""

    def pin(self, t):
        pass

    def close(self):
        pass

    def _new_stream(self):
        return _Done()

    def _compute_stream(self):
        return _Done()

    def _on(self, stream):
        return contextlib.nullcontext()

    def _record(self, stream):
        return _Done()

    def _synchronize(self):
        pass

    def _peak_bytes(self):
        return 0


@pytest.fixture
def cuda_flow(monkeypatch):
    """Run the engine's CUDA path (slots, staging, host steps) with CPU stand-ins."""
    monkeypatch.setattr(engine_mod, "streams_to_device", lambda device: True)
    monkeypatch.setattr(device_mod, "DeviceCopies", CpuCopies)  # made by _device.open_copies


def _engine(model, tmp_path, clip=None, budget=GPU_BUDGET, **cfg):
    cfg.setdefault("activation_bytes", ACT)
    return OffloadEngine(
        model,
        AdamWConfig(lr=LR, weight_decay=WD, max_grad_norm=clip),
        OffloadConfig(
            budget, str(tmp_path / "swap"), prefetch=1, host_budget_bytes=HOST_BUDGET, **cfg
        ),
    )


@pytest.mark.parametrize(
    ("clip", "micro", "keep_graphs"),
    [(None, 1, True), (None, 1, False), (1.0, 2, False)],
    ids=["kept-graphs", "recompute", "clip-micro2"],
)
def test_cuda_control_flow_is_bitwise_equal_on_the_cpu(
    tmp_path, cuda_flow, clip, micro, keep_graphs
):
    ref = tiny_llama(**DEEP)
    ropt = reference_adamw(ref, LR, WD)
    model = tiny_llama(**DEEP)
    budget = {}
    if keep_graphs:  # room for every block's graph (~3.1 MB) on top of the activations
        budget = {"budget": 5_200_000, "activation_bytes": 4_000_000}
    eng = _engine(model, tmp_path, clip=clip, keep_graphs=keep_graphs, **budget)
    n = len(eng._state.layouts)
    assert eng.streaming and eng.telemetry()["pages"] < 4 * n
    assert state_bytes(model) >= 2 * eng.config.budget_bytes
    steps = 6
    batches = [make_batch(s, batch=2 * micro, vocab=128) for s in range(steps)]
    ref_losses = [reference_step(ref, ropt, b, clip, micro_batches=micro) for b in batches]
    eng_losses = [eng.step(b, micro_batches=micro) for b in batches]

    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    t = eng.telemetry()
    assert t["kept_graphs"] is keep_graphs
    # Per pass: every block copied for the forward; the backward starts from the two blocks
    # the forward left on the device, then copies the rest.
    passes = steps * micro
    assert t["h2d_copies"] == passes * (2 * n - 2)
    assert t["h2d_bytes"] == t["h2d_copies"] * t["device_slot_bytes"]
    grads = sum(layout.trainable_bytes() for layout in eng._state.layouts)
    assert t["d2h_bytes"] == passes * grads
    assert t["peak_bytes"] <= eng.config.budget_bytes
    assert t["pool_bytes"] + eng.device_plan.host_fixed <= HOST_BUDGET
    eng.close()


def _lora_engine(model, swap):
    return OffloadEngine(
        model,
        AdamWConfig(lr=LR, weight_decay=0.0, max_grad_norm=1.0),
        OffloadConfig(
            2_000_000, str(swap), prefetch=1, activation_bytes=700_000, host_budget_bytes=600_000
        ),
    )


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")  # peft's
def test_cuda_control_flow_lora_and_checkpoint_on_the_cpu(tmp_path, cuda_flow):
    def lora():
        base = tiny_llama(seed=0, **DEEP)
        torch.manual_seed(1)
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
        return get_peft_model(base, cfg)

    ref, model = lora(), lora()
    ropt = reference_adamw(ref, LR, 0.0)
    eng = _lora_engine(model, tmp_path / "swap")
    assert eng.mode == "frozen_base" and eng.streaming
    written_at_start = eng.telemetry()["bytes_written"]
    torch.manual_seed(5)  # lora_dropout: both runs draw the same masks
    ref_losses = [reference_step(ref, ropt, make_batch(s, vocab=128), clip=1.0) for s in range(5)]
    torch.manual_seed(5)
    eng_losses = [eng.step(make_batch(s, vocab=128)) for s in range(5)]
    assert eng_losses == ref_losses
    assert_same_weights(ref.state_dict(), eng.model_state_dict())
    t = eng.telemetry()
    assert t["bytes_written"] == written_at_start  # the frozen base is read-only
    assert t["d2h_bytes"] == 0  # adapters and their gradients stay "on the device"
    assert t["h2d_copies"] == 5 * (2 * len(eng._state.layouts) - 2)

    eng.save_checkpoint(tmp_path / "ckpt")
    other = _lora_engine(lora(), tmp_path / "swap2")
    other.load_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(9)
    a = [eng.step(make_batch(s, vocab=128)) for s in range(5, 7)]
    torch.manual_seed(9)
    b = [other.step(make_batch(s, vocab=128)) for s in range(5, 7)]
    assert a == b
    assert_same_weights(eng.model_state_dict(), other.model_state_dict())
    eng.close()
    other.close()
