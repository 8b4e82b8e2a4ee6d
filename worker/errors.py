"""The worker's errors in words: what a job may tell its user, and what ran out.

`UserFacingError` is raised where the worker means to talk to the user (its message is
written for them); worker.jobs.run shows its text as it is and any other exception as
"something went wrong", with the details in the log. `ran_out_of` recognises a full disk
and exhausted memory by type and errno, for every stage that words its own failures.

Every stage may import this module, including those that need no model: it imports neither
torch nor offload, and recognises their errors only once they are loaded (an exception of a
module never imported cannot have been raised).
"""

from __future__ import annotations

import errno
import sys
from typing import Literal

__all__ = ["UserFacingError", "ran_out_of"]

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class UserFacingError(ValueError):
    """An error whose message is written for the user: unusable input or settings, a model
    folder that does not fit. A ValueError, so code that refuses bad input as ValueError
    keeps catching it."""


def ran_out_of(exc: BaseException) -> Literal["disk", "memory"] | None:
    """"disk" for a full disk (ENOSPC/EDQUOT, or the offload engine's OffloadDiskFullError),
    "memory" for exhausted memory (MemoryError, ENOMEM, torch's OutOfMemoryError), else
    None."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return "disk"
    offload = sys.modules.get("offload")
    disk_full = getattr(offload, "OffloadDiskFullError", None)
    if disk_full is not None and isinstance(exc, disk_full):
        return "disk"
    if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return "memory"
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    if oom is not None and isinstance(exc, oom):
        return "memory"
    return None
