"""The chat on two machines: the model cut in two stages, the first on the chat worker's
machine (embeddings and the first blocks), the second on another machine's training worker
(the other blocks, the final norm and the output layer), each stage holding only its own
weights, its own adapters and its own SSD cache of its own blocks.

A reply runs as on one machine (worker/chat/generate.py); each forward's hidden states
cross to the second stage, and the next token's logits come back. Each stage's arithmetic is
the whole model's over its blocks, so the tokens are the one machine's.

This module is what both sides share: where the model is cut (`stage_blocks`), a stage's
model and adapter (`load_stage`, `stage_adapter`) and the pair's messages (`Link`: a gloo
process group of two, c10d's TCPStore as the rendezvous). The first stage's side is
worker/chat/head.py, the second's worker/chat/tail.py."""

from __future__ import annotations

import copy
import inspect
import json
import re
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from worker.training.pipelined import stage_range

STAGES = 2
# The second stage's last answer before the first stage gives it up (a forward of the whole
# prompt at most: seconds on a CPU); its model load gets LOAD_TIMEOUT.
REPLY_TIMEOUT = timedelta(minutes=3)
LOAD_TIMEOUT = timedelta(minutes=10)

# Messages: a header of HEADER int64s (an operation, then its numbers), maybe one payload.
HEADER = 8
# What a request may announce: more is refused before anything is allocated for it.
MAX_JSON_BYTES = 1 << 20
MAX_TOKENS = 1 << 20
PING, VERSION, LOAD, FORWARD, SAVE, FORGET, CLOSE, READY = range(1, 9)
ACK, ERR = 100, 101

_LAYER = re.compile(r"(\.layers\.)(\d+)(\.)")


class StageLost(Exception):
    """The other stage's machine or process is gone (or stopped answering)."""


class StageFailed(Exception):
    """The other stage answered with an error (its message is the text)."""


def stage_blocks(config, stage: int, stages: int = STAGES) -> tuple[int, int]:
    """Blocks [lo, hi) of `stage`: the stages' work made even, the output layer counted as
    the blocks it equals in parameters (as pipeline training cuts)."""
    hidden, vocab = config.hidden_size, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    block = (hidden * head_dim * (2 * heads + 2 * kv)
             + 3 * hidden * config.intermediate_size)
    return stage_range(config.num_hidden_layers, stage, stages, vocab * hidden / block)


def run_blocks(lm: torch.nn.Module, cache, **given) -> torch.Tensor:
    """The stage's blocks over `given` (input_ids or inputs_embeds), on top of `cache`
    (which grows by them): the last hidden states (the last stage's after its final norm)."""
    inner = lm.model
    params = inspect.signature(type(inner).forward).parameters
    name = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x renamed it
    return inner(**given, **{name: cache}, use_cache=True).last_hidden_state


def _cut_config(config, lo: int, hi: int):
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = hi - lo
    if getattr(cut, "layer_types", None):
        cut.layer_types = list(cut.layer_types)[lo:hi]
    return cut


def load_stage(folder: Path, stage: int, stages: int = STAGES) -> torch.nn.Module:
    """The causal LM in `folder` cut to `stage`: its blocks [lo, hi) read from the folder's
    safetensors files (no other block is ever in memory), numbered from 0 in the stage (the
    stage's cache holds its own blocks); the embeddings on the first stage, the final norm
    and output layer on the last (a tied output layer is the embeddings' weight, so the
    last stage's model keeps the embeddings too)."""
    from worker.training.streamed import WeightsReader, load_unloaded_model

    reader = WeightsReader(folder)
    try:
        model = load_unloaded_model(folder, reader)
        lo, hi = stage_blocks(model.config, stage, stages)
        inner = model.model
        with torch.no_grad():
            for i in range(lo, hi):
                for name, p in inner.layers[i].named_parameters():
                    p.data = reader.get(f"model.layers.{i}.{name}").to(torch.float32)
    finally:
        reader.close()
    layers = list(inner.layers)[lo:hi]
    for i, layer in enumerate(layers):
        layer.self_attn.layer_idx = i
    inner.layers = torch.nn.ModuleList(layers)
    model.config = inner.config = _cut_config(model.config, lo, hi)
    if stage and inner.embed_tokens.weight is not getattr(model.lm_head, "weight", None):
        # unused here; an empty one, as peft looks the input embeddings up
        inner.embed_tokens = torch.nn.Embedding(0, model.config.hidden_size)
    if stage < stages - 1:
        inner.norm = torch.nn.Identity()
        model.lm_head = None
    model.stage_blocks = (lo, hi)
    return model.eval()


def stage_adapter(folder: Path, lo: int, hi: int, dest: Path) -> Path:
    """The LoRA adapter in `folder` for blocks [lo, hi) only, its blocks numbered from 0 as
    the stage's are, written to `dest` (the other blocks' matrices left out)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((folder / "adapter_config.json").read_text())
    if config.get("layers_to_transform") is not None:  # numbered by the whole model's blocks
        config["layers_to_transform"] = [i - lo for i in config["layers_to_transform"]
                                         if lo <= i < hi]
    kept = {}
    for key, value in load_file(folder / "adapter_model.safetensors").items():
        m = _LAYER.search(key)
        if m is None:
            kept[key] = value
        elif lo <= int(m.group(2)) < hi:
            kept[key[: m.start(2)] + str(int(m.group(2)) - lo) + key[m.end(2):]] = value
    dest.mkdir(parents=True, exist_ok=True)
    save_file(kept, dest / "adapter_model.safetensors")
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def bounded(count: int, most: int) -> None:
    """A size the other side announced: out of bounds, the two sides cannot stay in step."""
    if not 0 < count <= most:
        raise StageLost(f"the other stage announced {count} items (at most {most})")


class Link:
    """One end of the two stages' connection: messages in order, each a header and maybe a
    payload whose size the header gives. Any failure of the transport is StageLost."""

    def __init__(self, store: dist.Store, rank: int, address: str, timeout: timedelta) -> None:
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = timeout
        self.store, self.other, self.timeout = store, 1 - rank, timeout  # store: kept alive
        try:
            self.pg = dist.ProcessGroupGloo(store, rank, 2, options)
        except RuntimeError as exc:
            raise StageLost(f"the other machine did not connect ({exc})") from exc

    def _wait(self, start, timeout: timedelta | None = None) -> None:
        """Start an operation (a gloo send or receive) and wait for it to complete."""
        try:
            start().wait(timeout or self.timeout)
        except RuntimeError as exc:  # gloo's errors: a closed connection, a timeout
            raise StageLost(str(exc)) from exc

    def send(self, op: int, *numbers: int, payload: torch.Tensor | None = None) -> None:
        header = torch.zeros(HEADER, dtype=torch.long)
        header[0] = op
        if numbers:
            header[1 : 1 + len(numbers)] = torch.tensor(numbers, dtype=torch.long)
        self._wait(lambda: self.pg.send([header], self.other, 0))
        if payload is not None:
            self._wait(lambda: self.pg.send([payload.contiguous()], self.other, 0))

    def send_json(self, op: int, value, *numbers: int) -> None:
        raw = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
        self.send(op, len(raw), *numbers, payload=raw)

    def header(self, timeout: timedelta | None = None) -> list[int]:
        header = torch.empty(HEADER, dtype=torch.long)
        self._wait(lambda: self.pg.recv([header], self.other, 0), timeout)
        return header.tolist()

    def recv(self, shape, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        self._wait(lambda: self.pg.recv([out], self.other, 0))
        return out

    def recv_json(self, size: int):
        bounded(size, MAX_JSON_BYTES)
        return json.loads(bytes(self.recv((size,), torch.uint8).numpy()).decode())

    def ids(self, count: int) -> list[int]:
        bounded(count, MAX_TOKENS)
        return self.recv((count,), torch.long).tolist()

    def reply(self, timeout: timedelta | None = None) -> list[int]:
        """The other stage's answer to a request: ACK's numbers, or StageFailed."""
        header = self.header(timeout)
        if header[0] == ERR:
            raise StageFailed(self.recv_json(header[1]))
        if header[0] != ACK:
            raise StageLost(f"the other stage answered {header[0]}, not an acknowledgement")
        return header[1:]

    def close(self) -> None:
        self.pg = None
