"""Where each tensor of a .safetensors file lies, read from its header (no dependency).

Format: 8 bytes little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": ...}, then the data; offsets count from
the end of the header. The frozen base weights of a LoRA run are read from here, so
they are never copied to a swap file and never written."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ._io import byte_view

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}  # torch dtype -> safetensors name
HEADER_LIMIT = 100_000_000  # bytes: the safetensors library refuses larger headers too


def dtype_of(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name (None: one this module does not know)."""
    return _DTYPES.get(name)


@dataclass
class TensorExtent:
    path: str
    dtype: torch.dtype | None
    shape: tuple[int, ...]
    offset: int  # in the file
    nbytes: int


def header_length(first8: bytes) -> int:
    """The header length a file's first 8 bytes announce (ValueError past HEADER_LIMIT)."""
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n > HEADER_LIMIT:
        raise ValueError(f"a safetensors header of {n} bytes")
    return n


def decode_header(raw: bytes | memoryview) -> tuple[dict, int]:
    """The JSON header of a .safetensors file from its first bytes (at least 8 + the header
    length), and the offset where its data begins. ValueError when it is not one."""
    if len(raw) < 8:
        raise ValueError("shorter than a safetensors header")
    n = header_length(raw)
    if len(raw) < 8 + n:
        raise ValueError("the header runs past the bytes given")
    header = json.loads(bytes(raw[8 : 8 + n]))
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")  # noqa: TRY004 (bad data)
    return header, 8 + n


def read_header(path: str) -> tuple[dict, int]:
    """A .safetensors file's JSON header and the file offset where its data begins."""
    with open(path, "rb") as f:
        first = f.read(8)
        return decode_header(first + f.read(header_length(first)))


def read_index(path: str) -> dict[str, TensorExtent]:
    header, base = read_header(path)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = TensorExtent(
            path, _DTYPES.get(info["dtype"]), tuple(info["shape"]), base + begin, end - begin
        )
    return out


def candidate_names(param_name: str) -> list[str]:
    """Names a parameter may have in the files it was loaded from: as is, and without
    the wrappers peft adds (`base_model.model.` prefix, `.base_layer` infix)."""
    names = [param_name]
    plain = param_name.replace(".base_layer.", ".")
    plain = plain.removeprefix("base_model.model.")
    if plain != param_name:
        names.append(plain)
    return names


class SafetensorsSource:
    """Open read-only handles on a model's .safetensors files and find tensors by name."""

    def __init__(self, paths: list[str]):
        self.index: dict[str, TensorExtent] = {}
        for p in paths:
            self.index.update(read_index(os.fspath(p)))
        self.fds = {p: os.open(p, os.O_RDONLY) for p in {e.path for e in self.index.values()}}

    def find(self, param_name: str, like: torch.Tensor) -> TensorExtent | None:
        for name in candidate_names(param_name):
            e = self.index.get(name)
            if e is not None and e.dtype == like.dtype and e.shape == tuple(like.shape):
                return e
        return None

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def map_to_files(
    src: SafetensorsSource, layouts: list, unloaded: set[int]
) -> dict[int, list[tuple[int, int, int, int]]]:
    """Blocks whose streamed weights all lie, byte for byte, in the weights files:
    block -> (fd, file offset, page offset, nbytes) extents, one per weight slot of its
    BlockLayout. Each candidate tensor is read once and compared, so a model changed since
    loading falls back to the swap; a parameter whose id is in `unloaded` (no values to
    compare) is taken from the file as it is."""
    out = {}
    for layout in layouts:
        extents = []
        for slot in layout.weight_slots:
            e = src.find(slot.name, slot.param)
            if e is None:
                break
            if id(slot.param) not in unloaded:  # a loaded one must match
                data = torch.empty(e.nbytes, dtype=torch.uint8)
                if os.preadv(src.fds[e.path], [byte_view(data)], e.offset) != e.nbytes:
                    break
                mine = slot.param.detach().cpu().contiguous().reshape(-1)
                if not torch.equal(data, mine.view(torch.uint8)):
                    break
            extents.append((src.fds[e.path], e.offset, slot.offset, slot.nbytes))
        else:
            out[layout.index] = extents
    return out
