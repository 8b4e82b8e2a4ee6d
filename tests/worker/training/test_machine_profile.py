"""The worker's measurement of this machine, which the Train button's estimate reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from app.contract.training import LORA_MODULES
from app.settings import settings
from tests.worker.conftest_training import tiny_model_dir
from worker.training import machine_profile as mp


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


def test_profile_has_sane_numbers(tiny_dir, tmp_path):
    profile = mp.build_profile(
        str(tiny_dir), tmp_path / "swap", 4 << 30, disk_mib=16, base_model="tiny"
    )
    json.loads(json.dumps(profile))  # plain JSON, no inf/NaN
    assert profile["format"] == mp.PROFILE_FORMAT and profile["base_model"] == "tiny"
    disk, cpu = profile["disk"], profile["cpu"]
    assert disk["bytes"] == 16 << 20
    assert 0.01 < disk["read_gbps"] < 200 and 0.01 < disk["write_gbps"] < 200
    assert 1e8 < cpu["matmul_flops"] < 1e15
    assert profile["reference"] == {"batch_size": 4, "seq_len": 256}
    lora, full = profile["methods"]["lora"], profile["methods"]["full"]
    for plan in (lora, full):  # 4 GiB holds the tiny model whole
        assert plan["fits_in_memory"] and plan["fits"]
        assert 0 < plan["compute_s_per_step"] < 600 and plan["io_s_per_step"] == 0
    assert lora["compute_s_per_step"] < full["compute_s_per_step"]  # no weight gradients
    assert lora["bytes_needed"] < full["bytes_needed"]
    assert not list((tmp_path / "swap").iterdir())  # the probe file is gone

    assert profile["base"]["streams"] is False and profile["base"]["scoring_s"] == 0
    assert profile["base"]["fp32_bytes"] > 0

    small = mp.build_profile(
        str(tiny_dir), tmp_path / "swap", 60 << 20, disk_mib=4, stream="always"
    )
    assert not small["methods"]["full"]["fits_in_memory"]  # 60 MiB: full must stream
    assert small["methods"]["full"]["io_s_per_step"] > 0
    # Streamed for scoring too: a read of the model per forward, from the measured disk.
    base = small["base"]
    assert base["streams"] is True
    forwards = 2 * mp.SCORING_FORWARDS + mp.REPLAY_FORWARDS
    expected = forwards * base["fp32_bytes"] / (small["disk"]["read_gbps"] * 1e9)
    assert base["scoring_s"] == pytest.approx(expected)


@pytest.mark.parametrize("modules", list(LORA_MODULES))
def test_lora_parameter_count_matches_peft(tiny_dir, modules):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    targets = list(LORA_MODULES[modules])
    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules=targets))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert mp.lora_params(model.config, 16, modules) == trainable


def test_measure_and_write_is_atomic_and_marks_the_profile_current(tiny_dir, tmp_path):
    path = tmp_path / "machine_profile.json"
    saved = (settings.base_model, settings.data_dir)
    settings.base_model, settings.data_dir = str(tiny_dir), tmp_path
    try:
        assert not mp.is_current(path)
        profile = mp.measure_and_write(path, disk_mib=8)
        assert json.loads(path.read_text()) == profile
        assert mp.is_current(path)
        assert [p.name for p in tmp_path.glob("*.tmp")] == []
        assert math.isfinite(profile["methods"]["lora"]["est_s_per_step"])
        # Timed where jobs compute (no GPU here, DOCTUNE_DEVICE auto: the CPU); a GPU
        # appearing, or DOCTUNE_DEVICE=cuda, makes it stale: a GPU's steps are not the CPU's.
        assert settings.device == "auto" and mp.profile_device() == "cpu"
        assert profile["device"] == "cpu"
        assert mp.is_current(path, device="cpu") and not mp.is_current(path, device="cuda")
        assert mp.start_measuring() is None  # current: no child (no NVIDIA device here)
        settings.base_model = "embedded"  # another model: measure again
        assert not mp.is_current(path)
    finally:
        settings.base_model, settings.data_dir = saved
