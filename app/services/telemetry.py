"""The offload engine's figures of a running job (Job.telemetry), said in plain words.

The worker writes the engine's counters to the job row while it trains (bytes read and
written, disk rate, time spent waiting on the disk, prefetch hits, peak memory against the
budget); the job page shows them as one sentence and a few details."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.contract.scores import finite_number as _num
from app.services.uploads import human_size


@dataclass
class MemoryDiskPanel:
    """What the "Memory and disk" panel of a job page says."""

    sentence: str
    details: list[tuple[str, str]] = field(default_factory=list)  # (label, value)
    streaming: bool = False


def _share(part: float | None, whole: float | None) -> str | None:
    if part is None or not whole:
        return None
    pct = 100 * part / whole
    if 0 < pct < 1:
        return "under 1%"
    return f"{min(100.0, pct):.0f}%"


def describe(telemetry: Mapping[str, Any] | None) -> MemoryDiskPanel | None:
    """The panel for a job's telemetry, or None when the job has none (yet)."""
    if not telemetry:
        return None
    t = telemetry
    blocks = int(_num(t.get("blocks")) or 0)
    read = int(_num(t.get("bytes_read")) or 0)
    written = int(_num(t.get("bytes_written")) or 0)
    budget = _num(t.get("budget_bytes"))
    peak = _num(t.get("peak_bytes"))
    memory = None
    if peak is not None and budget:
        memory = f"peak memory {human_size(int(peak))} of a {human_size(int(budget))} budget"
    waited = _share(_num(t.get("stall_s")), _num(t.get("step_s")))
    streaming = bool(t.get("streaming"))
    what = f"{blocks} blocks" if blocks else "the model"

    if streaming:
        io = [
            f"{human_size(read)} read",
            f"{human_size(written)} written" if written else "nothing written",
        ]
        rate = _num(t.get("read_gbps"))
        if read and rate:
            io.append(f"{rate:.1f} GB/s")
        parts = [f"Streams {what} from the SSD: " + ", ".join(io)]
        if waited is not None:
            parts.append(f"waited on the disk {waited} of the time")
    else:
        parts = [f"Fits in memory: all {what} stay in memory, nothing streams from the SSD"]
    if memory:
        parts.append(memory)
    sentence = "; ".join(parts) + "."

    details: list[tuple[str, str]] = []
    hit = _num(t.get("prefetch_hit_rate"))
    if streaming and hit is not None:
        details.append(("Blocks ready before they were needed", f"{100 * hit:.0f}%"))
    from_files = int(_num(t.get("blocks_read_from_weights_files")) or 0)
    if from_files:
        details.append(("Blocks read straight from the base model's file", str(from_files)))
    rss = _num(t.get("peak_rss_bytes"))
    if rss:
        details.append(("Peak memory of the whole training process", human_size(int(rss))))
    if streaming and not t.get("o_direct", True):
        details.append(("Disk access", "through the operating system's cache"))
    return MemoryDiskPanel(sentence=sentence, details=details, streaming=streaming)
