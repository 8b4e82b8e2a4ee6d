"""The worker registry's shapes: the hardware a worker reports when it starts
(worker/hardware.py writes it into `Worker.hardware`), and how often it says it is alive
against how long the admin's Workers page waits before calling it offline."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

# A worker refreshes its row's last_seen_at this often (worker/registry.py) ...
HEARTBEAT_EVERY_S = 30.0
# ... and counts as offline once three refreshes in a row have not arrived.
ONLINE_WITHIN_S = 3 * HEARTBEAT_EVERY_S


class Gpu(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    memory_bytes: int | None = None


class Hardware(BaseModel):
    """What a worker's machine has; None where it could not be read (another OS)."""

    model_config = ConfigDict(frozen=True)

    cpu: str | None = None
    cores: int | None = None
    ram_bytes: int | None = None
    gpus: list[Gpu] = []
