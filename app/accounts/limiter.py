"""Sign-in attempts, limited per name and per client address: at most
DOCTUNE_SIGN_IN_ATTEMPTS failures in DOCTUNE_SIGN_IN_WINDOW_S, counted in a moving window by
the `limits` library in DocTune's Redis, so that every web process (and a restart) shares one
count. Should Redis be unreachable, the count falls back to this process's memory: sign-in
keeps working and guessing stays slow."""

from __future__ import annotations

import logging
import math
import threading
import time

from limits import RateLimitItemPerSecond
from limits.storage import MemoryStorage, Storage, storage_from_string
from limits.strategies import MovingWindowRateLimiter
from redis.exceptions import RedisError

from app.settings import settings

log = logging.getLogger(__name__)

NAMESPACE = "doctune-sign-in"

_lock = threading.Lock()
_limiters: dict[str, MovingWindowRateLimiter] = {}


def _limiter(kind: str) -> MovingWindowRateLimiter:
    """"redis" (shared) or "memory" (this process), made on first use."""
    with _lock:
        if kind not in _limiters:
            store: Storage = (storage_from_string(settings.broker_url) if kind == "redis"
                              else MemoryStorage())
            _limiters[kind] = MovingWindowRateLimiter(store)
        return _limiters[kind]


def _rule() -> RateLimitItemPerSecond:
    return RateLimitItemPerSecond(settings.sign_in_attempts,
                                  max(1, math.ceil(settings.sign_in_window_s)))


def _keys(name: str, address: str) -> list[tuple[str, str]]:
    return [("name", " ".join(name.split()).lower()), ("addr", address)]


def _with_fallback(action):
    try:
        return action(_limiter("redis"))
    except (RedisError, OSError) as exc:  # Redis down or refusing: count here instead
        log.warning("sign-in limit: Redis unreachable (%s); counting in memory", exc)
        return action(_limiter("memory"))


def wait_s(name: str, address: str) -> float:
    """0 when another attempt may be made now; else the seconds until one may."""
    rule = _rule()

    def waits(limiter: MovingWindowRateLimiter) -> float:
        longest = 0.0
        for key in _keys(name, address):
            if not limiter.test(rule, NAMESPACE, *key):
                reset = limiter.get_window_stats(rule, NAMESPACE, *key).reset_time
                longest = max(longest, reset - time.time(), 1.0)
        return longest

    return _with_fallback(waits)


def failed(name: str, address: str) -> None:
    """Count one failed attempt against the name and against the address."""
    rule = _rule()

    def count(limiter: MovingWindowRateLimiter) -> None:
        for key in _keys(name, address):
            limiter.hit(rule, NAMESPACE, *key)

    _with_fallback(count)


def forget() -> None:
    """Clear every count (tests)."""
    for kind in ("redis", "memory"):
        try:
            _limiter(kind).storage.reset()
        except (RedisError, OSError) as exc:
            log.warning("sign-in limit: could not clear the %s count: %s", kind, exc)
    with _lock:
        _limiters.clear()  # the next use connects to the Redis of the current settings
