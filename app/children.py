"""Child processes that do not outlive the process that started them.

`doctune up` stops its Redis, workers, folder watcher and web server itself on Ctrl-C or
SIGTERM; a `kill -9` (or the OOM killer) gives it no chance to, and they would go on holding
their ports, so the next `doctune up` could not start. On Linux each child asks the kernel
for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG), their usual way to stop."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from functools import cache

_PR_SET_PDEATHSIG = 1


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)  # loaded in the parent, not the forked child


def _on_parent_death() -> Callable[[], None] | None:
    """What a child runs before exec (None where the kernel has no such request)."""
    if not sys.platform.startswith("linux"):
        return None
    libc, parent = _libc(), os.getpid()

    def request() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request was made
            os.kill(os.getpid(), signal.SIGTERM)

    return request


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(cmd, **kwargs), ended with SIGTERM if this process dies first.
    The launcher starts its children before any thread of its own (preexec_fn is not safe
    beside other threads)."""
    return subprocess.Popen(cmd, preexec_fn=_on_parent_death(), **kwargs)  # noqa: PLW1509
