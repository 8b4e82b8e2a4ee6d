"""A duration as a person reads it."""

from __future__ import annotations

import math


def human_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "—"
    if seconds < 60:
        return "less than a minute"
    minutes = round(seconds / 60)
    if minutes < 90:
        return f"about {minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"about {hours} h {minutes} min" if minutes else f"about {hours} h"
