"""A base model larger than memory, in a job: built without its block weights, which the
offload engine reads one transformer block at a time.

- `should_stream`: a model whose float32 weights take more than half of the memory free
  now is not loaded (the engine's budget and the scores need the rest).
- `WeightsReader` + `load_unloaded_model`: the model is built from its config with no
  values in its blocks (placeholders); embeddings, final norm and output layer are read
  from its safetensors files. `WeightsReader.init_weights` fills a block's page in the
  engine from the same files when a block cannot be read from them directly.
- `scoring_engine`: an engine with nothing to train, for scoring the base model (and a
  previous version's adapter) and for the replay answers: every forward streams the
  blocks, so evaluation batches all its prompts together (STREAMED_EVAL_BATCH).
- the trained model is read by the merged and GGUF exports one block at a time through
  worker.export.tensor_source's `StreamedSource`.

Everything here computes what the in-memory path computes (tests/worker/jobs/test_streamed.py
compares a streamed job with an in-memory one).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.errors import UserFacingError
from worker.training.base_model import fp32_load_bytes
from worker.training.resources import available_memory_bytes

# A model whose float32 weights exceed this share of the free memory is streamed.
STREAM_SHARE = 0.5
# Most prompts per generate() call when the blocks stream: each forward reads the whole
# model, so one batch for everything costs one read of the model per generated token.
STREAMED_EVAL_BATCH = 64
# Tokens a scored sequence may reach (prompt + answer), for sizing its KV cache: a probe's
# context or a question in the chat template, and up to 96 generated tokens.
EVAL_SEQ_TOKENS = 256
# Share of the budget the KV cache of one scoring batch may take: inside the quarter the
# engine keeps for activations (its page pool takes the rest).
KV_SHARE = 0.2

STREAM_SETTINGS = ("auto", "always", "never")


def should_stream(
    model_dir: Path,
    setting: str = "auto",
    meminfo: Path = Path("/proc/meminfo"),
    device: torch.device | None = None,
) -> bool:
    """Whether a job streams this base model instead of loading it: `setting` "always",
    "never" or "auto" (its float32 weights above STREAM_SHARE of the free memory, or of the
    free GPU memory when the job computes on `device` cuda)."""
    if setting not in STREAM_SETTINGS:
        raise UserFacingError(f"Unknown stream setting {setting!r}; use one of {STREAM_SETTINGS}.")
    if setting != "auto":
        return setting == "always"
    need = fp32_load_bytes(Path(model_dir))
    free = available_memory_bytes(meminfo)
    if free is not None and need > STREAM_SHARE * free:
        return True
    if device is not None and device.type == "cuda":
        gpu_free, _total = torch.cuda.mem_get_info(device)
        return need > STREAM_SHARE * gpu_free
    return False


def kv_bytes_per_token(config) -> int:
    """Float32 KV-cache bytes one token takes over all layers (keys and values)."""
    heads = int(getattr(config, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * 4


def eval_batch_size(config, budget_bytes: int, cap: int = STREAMED_EVAL_BATCH) -> int:
    """Prompts to generate for at once with a streamed model: as many as `cap`, as long as
    their KV cache stays within KV_SHARE of the budget."""
    per_seq = kv_bytes_per_token(config) * EVAL_SEQ_TOKENS
    return max(1, min(cap, int(budget_bytes * KV_SHARE) // max(1, per_seq)))


def _plain_name(name: str) -> str:
    """A parameter's name in the model's files: without peft's wrappers."""
    return name.replace(".base_layer.", ".").removeprefix("base_model.model.")


# safetensors dtype names (the format's header is JSON: name -> dtype, shape, offsets).
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class _Stored:
    fd: int
    dtype: torch.dtype | None  # None: a dtype torch cannot hold
    shape: tuple[int, ...]
    offset: int  # in the file
    nbytes: int


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class WeightsReader:
    """The tensors of a model folder's *.safetensors files, read one at a time by name with
    pread (no memory map: pages of a file larger than memory are never mapped in)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = Path(model_dir)
        self.files = sorted(self.model_dir.glob("*.safetensors"))
        if not self.files:
            raise UserFacingError(f"The model in {self.model_dir} has no *.safetensors weights.")
        self._index: dict[str, _Stored] = {}
        fds: list[int] = []
        self._closer = weakref.finalize(self, _close_all, fds)
        for path in self.files:
            try:
                with open(path, "rb") as fh:
                    (n,) = struct.unpack("<Q", fh.read(8))
                    if n > path.stat().st_size - 8:
                        raise ValueError("header longer than the file")
                    header = json.loads(fh.read(n))
            except (OSError, struct.error, ValueError) as exc:
                raise UserFacingError(f"{path.name} is not a readable safetensors file.") from exc
            fds.append(os.open(path, os.O_RDONLY))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self._index[key] = _Stored(
                    fds[-1],
                    _DTYPES.get(info["dtype"]),
                    tuple(info["shape"]),
                    8 + n + begin,
                    end - begin,
                )

    def close(self) -> None:
        self._closer()

    def _stored(self, name: str) -> tuple[str, _Stored]:
        key = name if name in self._index else _plain_name(name)
        entry = self._index.get(key)
        if entry is None:
            raise UserFacingError(
                f"The model's files in {self.model_dir} have no tensor {key!r}: the model "
                "folder is incomplete or of another architecture than its config.json says."
            )
        if entry.dtype is None:
            raise UserFacingError(
                f"Tensor {key!r} is stored in a number format DocTune cannot read."
            )
        return key, entry

    @staticmethod
    def _read(entry: _Stored, dest: torch.Tensor) -> None:
        """Read the entry's bytes into `dest` (a contiguous CPU tensor of that many bytes)."""
        view = memoryview(dest.view(-1).view(torch.uint8).numpy())
        done = 0
        while done < entry.nbytes:
            n = os.preadv(entry.fd, [view[done:]], entry.offset + done)
            if n <= 0:
                raise UserFacingError(
                    "A model file ended early: it is damaged or still being copied."
                )
            done += n

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored for parameter `name` (peft's wrappers ignored), as stored."""
        _key, entry = self._stored(name)
        out = torch.empty(entry.shape, dtype=entry.dtype)
        self._read(entry, out)
        return out

    def init_weights(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (a page view in the engine) with parameter `name`'s stored values:
        read straight into it when the file holds that dtype, else converted."""
        key, entry = self._stored(name)
        if entry.shape != tuple(out.shape):
            raise UserFacingError(
                f"Tensor {key!r} has shape {entry.shape} in the model's files, but the "
                f"model's config makes it {tuple(out.shape)}."
            )
        if entry.dtype == out.dtype and out.is_contiguous() and out.device.type == "cpu":
            self._read(entry, out)
        else:
            out.copy_(self.get(name))


def load_unloaded_model(model_dir: Path, reader: WeightsReader | None = None):
    """The model in `model_dir` with placeholders for its transformer blocks' parameters
    and real float32 values for everything else (read from `reader`, default its own
    files). Buffers (rotary frequencies) are computed as from_pretrained computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from offload import find_blocks, release_parameters

    reader = reader or WeightsReader(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # under init_empty_weights the tie is not made
    release_parameters(model)
    in_blocks = {id(p) for b in find_blocks(model) for p in b.parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied weight is listed once
            if id(p) not in in_blocks:
                p.data = reader.get(name).to(torch.float32)
    with contextlib.suppress(OSError):  # no generation_config.json: the model's defaults
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.eval()
    return model


def load_resident_weights(model: torch.nn.Module, reader: WeightsReader) -> None:
    """Replace the parameters outside the blocks by those in `reader` (a previous full
    version's folder: its embeddings, norm and output layer)."""
    from offload import find_blocks

    in_blocks = {id(p) for b in find_blocks(model) for p in b.parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) not in in_blocks:
                value = reader.get(name)
                if tuple(value.shape) != tuple(p.shape):
                    raise UserFacingError(
                        "The previous version's model does not fit the base model "
                        f"({_plain_name(name)} has another shape). Start from the base model "
                        "instead."
                    )
                p.data = value.to(device=p.device, dtype=torch.float32)


@contextlib.contextmanager
def scoring_engine(
    model: torch.nn.Module,
    reader: WeightsReader,
    budget_bytes: int,
    swap_dir: Path,
    device: torch.device | None = None,
    host_budget_bytes: int | None = None,
) -> Iterator:
    """An offload engine over `model` with nothing to train, for as long as the `with`
    lasts: blocks read straight from the model's files where they are stored in float32,
    else copied into the swap once. The model's requires_grad flags are put back after.
    On a CUDA `device` the blocks compute on the GPU (budget_bytes: GPU memory) from a page
    pool of host_budget_bytes."""
    from offload import OffloadConfig, OffloadEngine

    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        engine = OffloadEngine(
            model,
            None,
            OffloadConfig(
                budget_bytes=int(budget_bytes),
                swap_dir=os.fspath(swap_dir),
                device=str(device) if device is not None else None,
                host_budget_bytes=host_budget_bytes,
            ),
            weights_files=[os.fspath(f) for f in reader.files],
            init_weights=reader.init_weights,
        )
        try:
            yield engine
        finally:
            engine.close()
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def describe(model_dir: Path) -> str:
    """A line for the log: how big the model is and what is free."""
    need = fp32_load_bytes(Path(model_dir))
    free = available_memory_bytes()
    info = {"fp32_gb": round(need / 1e9, 2), "free_gb": round(free / 1e9, 2) if free else None}
    return json.dumps(info)
