"""Offload tests: tiny Llama models, real files, real subprocesses.

Torch runs one intra-op thread here. Each comparison runs both sides in the same process
with the same setting, so this changes speed, not what is compared; on a shared 2-core
machine two OpenMP threads spin against each other and every step gets ~50x slower."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
