"""A whole job on the GPU (DOCTUNE_DEVICE=cuda), loaded and streamed, against the same job
on the CPU. Runs where torch sees a CUDA GPU (scripts/cuda_check.sh); skipped elsewhere.

Within tolerances, not bit for bit: the GPU's kernels round differently (see
tests/offload/test_cuda.py); the LoRA adapters start the same (drawn on the CPU)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from tests.worker.conftest_training import tiny_model_dir
from tests.worker.jobs.test_pipeline import DOCS, params
from worker.jobs.pipeline import run_pipeline

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


@pytest.mark.parametrize("stream", ["never", "always"])
@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_job_on_the_gpu_gives_what_the_cpu_job_gives(tiny_dir, tmp_path, method, stream):
    overrides = {"method": method, "max_steps": 4, "replay": 2}
    if method == "full":
        overrides["learning_rate"] = 1e-4
    runs = {
        device: run_pipeline(
            DOCS,
            params(**overrides),
            str(tiny_dir),
            tmp_path / device / "models",
            tmp_path / device,
            stream_base=stream,
            device=device,
        )
        for device in ("cpu", "cuda")
    }
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert gpu["export_errors"] == {} and set(gpu["artifacts"]) == set(cpu["artifacts"])
    assert gpu["metrics"]["steps"] == cpu["metrics"]["steps"] == 4
    assert gpu["metrics"]["final_loss"] == pytest.approx(cpu["metrics"]["final_loss"], rel=1e-3)
    for when in ("before", "after"):
        assert gpu["scores"][when]["perplexity"] == pytest.approx(
            cpu["scores"][when]["perplexity"], rel=1e-3
        )
    with zipfile.ZipFile(gpu["artifacts"]["merged"]) as zf:
        assert any(n.endswith(".safetensors") for n in zf.namelist())


def test_the_machine_profile_times_steps_and_scoring_on_the_gpu(tiny_dir, tmp_path):
    """With jobs on the GPU the Train panel's estimate must come from GPU steps: the profile
    times LoRA and full steps and scoring there (a CPU profile would be far too long)."""
    from worker.training.machine_profile import build_profile

    profile = build_profile(
        str(tiny_dir), tmp_path / "swap", 2 << 30, disk_mib=8, base_model="tiny", device="cuda"
    )
    assert profile["device"] == "cuda"
    for method in ("lora", "full"):
        fit = profile["steps"][method]
        assert len(fit["measured"]) >= 1 and all(s > 0 for _, _, s in fit["measured"])
    assert profile["scoring"]["decode_s"] > 0 and profile["scoring"]["forward_s"] > 0
