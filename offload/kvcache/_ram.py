"""The optional RAM tier: whole block files of recently used blocks, in front of the SSD.

It holds the files' bytes exactly as on disk (already checked when they came in), so a hit
skips the read and nothing else: the same parse and id checks run on it. Least recently
used first out; never more than its capacity (0 = off: the store keeps no tensors)."""

from __future__ import annotations

from collections import OrderedDict

import torch


class RamTier:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError("ram_bytes must be >= 0")
        self.capacity = int(capacity_bytes)
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        buf = self._blocks.get(key)
        if buf is not None:
            self._blocks.move_to_end(key)
        return buf

    def put(self, key: bytes, buf: torch.Tensor) -> None:
        """Keep `buf` (the caller no longer writes to it), evicting the least recently used."""
        size = buf.numel()
        if size > self.capacity:
            return
        self.drop(key)
        while self._blocks and self.nbytes + size > self.capacity:
            _, old = self._blocks.popitem(last=False)
            self.nbytes -= old.numel()
        self._blocks[key] = buf
        self.nbytes += size

    def drop(self, key: bytes) -> None:
        buf = self._blocks.pop(key, None)
        if buf is not None:
            self.nbytes -= buf.numel()

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks
