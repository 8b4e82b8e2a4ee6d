"""worker.errors: the user's words, and what ran out recognised by type and errno."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload import OffloadBudgetError, OffloadDiskFullError
from worker.errors import UserFacingError, ran_out_of

ROOT = Path(__file__).resolve().parents[2]


def test_a_user_facing_error_is_a_value_error():
    with pytest.raises(ValueError, match="in words"):
        raise UserFacingError("in words")


@pytest.mark.parametrize(
    ("exc", "what"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "disk"),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk"),
        (OffloadDiskFullError("/swap/block0.bin", 4096), "disk"),
        (MemoryError(), "memory"),
        (OSError(errno.ENOMEM, "Cannot allocate memory"), "memory"),
        (torch.OutOfMemoryError("CUDA out of memory"), "memory"),
        # By type and errno, never by the words of a message:
        (RuntimeError("out of memory"), None),
        (ValueError("the disk is full"), None),
        (OSError(errno.EACCES, "Permission denied"), None),
        (OffloadBudgetError("budget too small"), None),
    ],
)
def test_ran_out_of_recognises_disk_and_memory(exc, what):
    assert ran_out_of(exc) == what


def test_the_module_needs_neither_torch_nor_offload():
    """The stages that need no model import it: it must not pull torch or offload in."""
    code = (
        "import sys\n"
        "from worker.errors import ran_out_of\n"
        "assert ran_out_of(OSError(28, 'full')) == 'disk'\n"
        "assert ran_out_of(RuntimeError('x')) is None\n"
        "assert 'torch' not in sys.modules and 'offload' not in sys.modules, 'imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
