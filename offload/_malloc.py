"""glibc malloc's mmap threshold, fixed so that freed tensors go back to the system.

glibc serves an allocation above M_MMAP_THRESHOLD (128 KiB at start) with its own mmap and
returns it with munmap when freed. But each time such a chunk is freed it raises the
threshold to that chunk's size (up to 32 MiB on 64-bit), so once the first large tensors
are gone, later ones come from the brk heap, where freed memory fragments and stays
resident. Measured: the 2.05B benchmark (4 GiB budget) peaked at 4.68 GiB of RSS with
glibc's default, 3.78 GiB with MALLOC_MMAP_THRESHOLD_=65536. Setting the threshold with
mallopt() fixes it and turns the dynamic adjustment off, as that environment variable does.

The engine sets it when it streams (before its pool), which covers what it allocates from
then on. Memory freed into the heap before (a model built in memory before the engine: its
block weights were allocated under the raised threshold, and the engine frees them when it
pages them out) stays in malloc's free lists; large requests are served from there first,
and pages touched there stay resident. A process that builds its model in memory should set
MALLOC_MMAP_THRESHOLD_ before it starts (or call this first); one that builds it on the meta
device (init_weights, as the 2B benchmark does) needs nothing else. Measured with
tests/offload/_rss_proc.py (124 MiB of training state, 38 MiB budget), growth over the
baseline: meta-built 39-44 MiB with glibc's defaults, 26 MiB with the engine's setting (the
same as with the environment variable); built in memory, 35-39 MiB with the engine's
setting, 26 MiB with the environment variable.

The price is speed: every allocation above 64 KiB is then a fresh mmap whose pages the
kernel faults in and zeroes, and glibc keeps none of them for reuse. Measured on the
2-core VM (one torch thread): that model's streamed engine step 0.31-0.34 s -> 0.46-0.48
s, and an in-memory step of a similar model 0.30 -> 0.43 s (a 1 MiB threshold: 0.30 s,
but 37-39 MiB of RSS; 4 MiB: no RSS gain). Larger models do more arithmetic per byte
allocated, so the share should shrink with size; not measured.

The setting is process-wide and is not undone when the engine closes (glibc offers no way
to read the current value back). Elsewhere (musl, macOS, Windows) this is a no-op.
"""

from __future__ import annotations

import ctypes
import sys

M_MMAP_THRESHOLD = -3  # glibc <malloc.h>


def fix_mmap_threshold(nbytes: int) -> bool:
    """mallopt(M_MMAP_THRESHOLD, nbytes) when the C library is glibc; True if it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc has it; musl has no such symbol)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1
