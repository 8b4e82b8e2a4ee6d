"""Sign-in attempts, limited per name and per client address, in this process's memory
(one web process serves DocTune; a restart forgets the count, which is fine for a limit
meant to slow guessing down to a few tries a minute)."""

from __future__ import annotations

import threading
import time
from collections import deque

from app.settings import settings

_lock = threading.Lock()
_failures: dict[str, deque[float]] = {}


def _keys(name: str, address: str) -> list[str]:
    return [f"name:{name.strip().lower()}", f"addr:{address}"]


def _recent(key: str, now: float) -> deque[float]:
    seen = _failures.setdefault(key, deque())
    while seen and seen[0] <= now - settings.sign_in_window_s:
        seen.popleft()
    return seen


def wait_s(name: str, address: str) -> float:
    """0 when another attempt may be made now; else the seconds until one may."""
    now = time.monotonic()
    with _lock:
        waits = [
            seen[0] + settings.sign_in_window_s - now
            for key in _keys(name, address)
            if len(seen := _recent(key, now)) >= settings.sign_in_attempts
        ]
    return max(waits, default=0.0)


def failed(name: str, address: str) -> None:
    now = time.monotonic()
    with _lock:
        for key in _keys(name, address):
            _recent(key, now).append(now)


def forget() -> None:
    """Clear every count (tests)."""
    with _lock:
        _failures.clear()
