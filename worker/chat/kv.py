"""The bridge between transformers' KV cache and the SSD store (offload/kvcache).

A turn starts with `prefill`: the longest stored prefix of the conversation's ids is read
into a DynamicCache and only the rest runs through the model; it ends with `save`, which
stores the cache for exactly the ids it covers. Anything wrong on the store's side (a miss,
a bad file, a layout the cache cannot take) costs a longer prefill, never a turn: the same
tokens come out, only slower.

Only caches whose every layer is a plain full-attention `DynamicLayer` ([batch, kv heads,
tokens, head dim], what transformers 5 builds for Llama-shaped models such as SmolLM2) are
restored and saved; others (sliding windows, linear attention) are prefilled every turn.
Their layers become `GrowingLayer`s: the keys and values sit in a buffer with room to grow,
so a new token is written in place instead of concatenated (DynamicLayer copies the whole
cache for every token: 189 MB per generated token after 4k tokens of SmolLM2-135M), and a
restored cache is read straight into such a buffer.

Attention runs on the key-value heads (`KV_HEADS_SWITCH`, set by
`attend_on_kv_heads`) instead of transformers copying every key and value to each of the
query heads that share it (repeat_kv: three copies of the cache per layer per forward for
SmolLM2); cold and restored turns alike, so they still give the same tokens. The switch is
process-wide and only for processes that answer chats: with it, a padded batch's attention
on a CPU depends on the thread count (an Intel Xeon, 2026-12-05: one training job at 1 and
at 2 threads came out 1.5e-6 apart in perplexity; without it, the same bits), so a process
that trains on several ranks (which inherit the environment) would stop matching one.
The namespace (`model_fingerprint`) covers the base weights, the adapter, the dtype and the
library versions, so a cache is only ever restored into the model that made it.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import transformers
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from offload.kvcache import KVStore, Streamed, StreamFailed, fingerprint
from worker.files import model_digest

log = logging.getLogger(__name__)



@dataclass
class Prefilled:
    """A conversation's ids run through the model, with the cache restored where it could."""

    cache: DynamicCache  # covers every id given to prefill()
    logits: torch.Tensor  # float32 [vocab]: the next token after them
    restored: int  # ids whose cache came from the store
    prefilled: int  # ids run through the model now (at least one)


def _base(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _forward_kwargs(model) -> tuple[str, bool]:
    """The cache argument's name (transformers 5.2x renamed past_key_values to cache) and
    whether the forward takes logits_to_keep."""
    params = inspect.signature(type(_base(model)).forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    return name, "logits_to_keep" in params


def _device_dtype(model) -> tuple[torch.device, torch.dtype]:
    p = next(p for p in model.parameters() if p.is_floating_point())
    return p.device, p.dtype


def _kv_shape(config) -> tuple[int, int]:
    """(key-value heads, head dim) of a layer, from the model's config."""
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return heads, int(head_dim)


# Tokens a restored cache has room for beyond the turn's new ones: a reply's worth.
REPLY_ROOM = 512


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of buffers with room to grow:
    update() writes the new tokens after the others, and only a full buffer is copied, into
    one a quarter larger (amortized: each token copied a few times in all, not once per
    step). The views hold the same values as DynamicLayer's concatenations."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._k = self._v = None  # the buffers; keys/values: their first tokens

    def adopt(self, keys: torch.Tensor, values: torch.Tensor,
              ready: Callable[[], None] | None = None) -> None:
        """Hold `keys` and `values` ([batch, heads, tokens, dim] views of buffers with room
        after them, as KVStore.load(room=...) gives them) without copying. `ready`: called
        before they are first used (a streamed restore's wait for this layer)."""
        self.lazy_initialization(keys, values)
        self._k, self._v = _whole(keys), _whole(values)
        self.keys, self.values = keys, values
        self._pending = ready

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        ready, self._pending = getattr(self, "_pending", None), None
        if ready is not None:
            ready()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if self._k is None or n + t > self._k.shape[-2]:
            self._k, self._v = (self._grown(self.keys, key_states, n + t),
                                self._grown(self.values, value_states, n + t))
        self._k[..., n : n + t, :].copy_(key_states)
        self._v[..., n : n + t, :].copy_(value_states)
        self.keys, self.values = self._k[..., : n + t, :], self._v[..., : n + t, :]
        return self.keys, self.values

    @staticmethod
    def _grown(old: torch.Tensor, new: torch.Tensor, need: int) -> torch.Tensor:
        cap = need + need // 4 + 64
        buf = torch.empty((*new.shape[:-2], cap, new.shape[-1]), dtype=new.dtype,
                          device=new.device)
        if old.numel():
            buf[..., : old.shape[-2], :].copy_(old)
        return buf

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None


def _whole(view: torch.Tensor) -> torch.Tensor:
    """The buffer a [..., tokens, dim] view with room after it was cut from (its tokens'
    dimension as long as the stride of the dimension before says)."""
    cap = view.stride(-3) // view.stride(-2)
    return view.as_strided((*view.shape[:-2], cap, view.shape[-1]), view.stride())


# transformers' switch for SDPA on the key-value heads (transformers/integrations/sdpa_attention.py).
KV_HEADS_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def attend_on_kv_heads() -> None:
    """transformers' SDPA attention on the key-value heads in this process and the ones it
    starts (see the module docstring: chat processes only)."""
    os.environ[KV_HEADS_SWITCH] = "1"


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`: GrowingLayers when every layer is a DynamicLayer."""
    cache = DynamicCache(config=model.config)
    layers = getattr(cache, "layers", [])
    if layers and all(type(x) is DynamicLayer for x in layers):
        cache.layers = [GrowingLayer() for _ in layers]
    return cache


# The layers a cache is stored from and restored into: full attention, [b, h, tokens, d].
_PLAIN_LAYERS = (DynamicLayer, GrowingLayer)


def _storable(cache: DynamicCache, config) -> bool:
    layers = getattr(cache, "layers", [])
    n = getattr(config, "num_hidden_layers", None)
    return bool(layers) and len(layers) == n and all(type(x) in _PLAIN_LAYERS for x in layers)


def restore(model, store: KVStore, ids: list[int], most: int | None = None,
            room: int | None = None) -> tuple[DynamicCache, int]:
    """A cache holding the longest stored prefix of `ids`: `most` tokens at most (default
    all but the last id), read into buffers with room for `room` more tokens (default the
    ids after `most` and a reply: a restore shorter than `most` grows its buffers once)."""
    config = model.config.get_text_config(decoder=True)
    cache = new_cache(model)
    if not _storable(cache, config):
        return cache, 0
    most = len(ids) - 1 if most is None else most
    n, layers = store.load(ids, max_tokens=most, room=len(ids) - most + REPLY_ROOM
                           if room is None else room)
    if not n:
        return cache, 0
    device, dtype = _device_dtype(model)
    want = _kv_shape(config)
    if len(layers) != len(cache.layers) or any(
        t.dtype != dtype or tuple(t.shape) != (want[0], n, want[1]) for pair in layers for t in pair
    ):
        log.warning("kv cache: the stored layout does not fit this model; prefilling it all")
        return cache, 0
    for layer, (k, v) in zip(cache.layers, layers, strict=True):
        if isinstance(layer, GrowingLayer) and device.type == "cpu":
            layer.adopt(k.unsqueeze(0), v.unsqueeze(0))
        else:
            _fill(layer, k.unsqueeze(0).to(device), v.unsqueeze(0).to(device))
    if cache.get_seq_length() != n:
        raise RuntimeError(f"the filled cache holds {cache.get_seq_length()} tokens, not {n}")
    return cache, n


def _fill(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """An empty DynamicLayer holding `keys` and `values` as they are: the state update()
    leaves (lazy_initialization, then keys and values set), without update()'s copy of the
    restored tensors (a concatenation onto an empty tensor: 190 MB more at 4k tokens)."""
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values = keys.contiguous(), values.contiguous()


def _restore_streamed(model, store: KVStore, ids: list[int]
                      ) -> tuple[DynamicCache, int, Streamed | None]:
    """restore(), with the layers read while the forward runs (KVStore.stream) where the
    cache and the device allow: (cache, restored ids, the stream to close after the
    forward, or None)."""
    config = model.config.get_text_config(decoder=True)
    cache = new_cache(model)
    device, dtype = _device_dtype(model)
    if (device.type != "cpu" or not _storable(cache, config)
            or not all(type(x) is GrowingLayer for x in cache.layers)
            or not isinstance(store, KVStore)):  # (a model on two machines: head.StagedStore)
        return (*restore(model, store, ids), None)
    most = len(ids) - 1  # as restore()'s default, with the same room
    s = store.stream(ids, max_tokens=most, room=len(ids) - most + REPLY_ROOM)
    if s is None:
        return (*restore(model, store, ids), None)
    want = _kv_shape(config)
    try:
        if len(s.layers) != len(cache.layers) or any(
            t.dtype != dtype or tuple(t.shape) != (want[0], s.tokens, want[1])
            for pair in s.layers for t in pair
        ):
            s.close()
            log.warning("kv cache: the stored layout does not fit this model; prefilling it all")
            return cache, 0, None
        for i, (layer, (k, v)) in enumerate(zip(cache.layers, s.layers, strict=True)):
            layer.adopt(k.unsqueeze(0), v.unsqueeze(0), ready=partial(s.wait, i))
    except BaseException:
        s.close()  # its reads write into the buffers: wait for them, close the files
        raise
    return cache, s.tokens, s


@torch.inference_mode()
def prefill(model, store: KVStore | None, token_ids: list[int]) -> Prefilled:
    """Run `token_ids` (the whole conversation so far) through `model` (plain or
    peft-wrapped, in eval mode), restoring what `store` has of them first, layer by layer
    under the forward where it can; `store` None: a cold prefill of them all."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("prefill needs at least one token id")
    while True:  # again after a bad layer: close() removed its block, so this ends
        cache, restored, stream = new_cache(model), 0, None
        if store is not None:
            try:
                cache, restored, stream = _restore_streamed(model, store, ids)
            except Exception:  # the cache is an optimisation: prefill it all
                log.exception("kv cache: restoring failed; prefilling the whole history")
                cache, restored = new_cache(model), 0
        try:
            logits = extend(model, cache, ids[restored:])
        except StreamFailed as exc:  # this forward's work is thrown away
            log.warning("kv cache: %s; the block is removed and the turn starts again", exc)
            continue
        finally:
            if stream is not None:
                stream.close()
        break
    return Prefilled(cache, logits, restored, len(ids) - restored)


@torch.inference_mode()
def extend(model, cache: DynamicCache, token_ids: list[int]) -> torch.Tensor:
    """Run `token_ids` through `model` on top of `cache` (which grows by them): the float32
    logits [vocab] of the token after the last one. The decoding loop's one step."""
    device, _ = _device_dtype(model)
    name, keep = _forward_kwargs(model)
    kwargs = {name: cache, "use_cache": True}
    if keep:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=torch.tensor([[int(t) for t in token_ids]], device=device), **kwargs)
    return out.logits[0, -1].float()


def save(store: KVStore | None, token_ids: list[int], cache: DynamicCache) -> int:
    """Store `cache` for exactly the first cache.get_seq_length() ids of `token_ids` (the
    reply's last token is usually not in the cache yet). Returns the tokens stored (0 when
    nothing could be: no store, a cache it cannot take, a full disk; logged, never raised)."""
    if store is None:
        return 0
    n = cache.get_seq_length()
    if n == 0:
        return 0
    try:
        if len(token_ids) < n:
            raise ValueError(f"the cache covers {n} tokens, only {len(token_ids)} ids given")
        layers = getattr(cache, "layers", [])
        if not layers or not all(type(x) in _PLAIN_LAYERS for x in layers):
            log.info("kv cache: %s is not saved (not full-attention DynamicLayers)",
                     type(cache).__name__)
            return 0
        pairs = []
        for layer in layers:
            k, v = layer.keys, layer.values
            if k.dim() != 4 or k.shape[0] != 1 or k.shape[-2] != n or v.shape[-2] != n:
                raise ValueError(f"a layer of shape {tuple(k.shape)} for {n} tokens, batch 1")
            pairs.append((k[0], v[0]))
        return store.save([int(t) for t in token_ids[:n]], pairs)
    except Exception:  # a turn is never failed by its cache
        log.exception("kv cache: saving failed; the next turn prefills instead")
        return 0


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def model_fingerprint(base_model_dir: str | os.PathLike, adapter_dir: str | os.PathLike | None,
                      dtype: torch.dtype | str, part: str | None = None) -> str:
    """The store namespace of a model: its base weights and config, the adapter's weights
    and config (None: no adapter), the dtype, torch / transformers / peft versions and the
    store's FORMAT_VERSION (fingerprint() adds it). Any change misses every cache. `part`:
    the part of the model whose cache it is (a stage on one of two machines)."""
    parts = {} if part is None else {"part": part}
    return fingerprint(
        **parts,
        base=model_digest(base_model_dir),
        adapter=model_digest(adapter_dir) if adapter_dir is not None else None,
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        transformers=transformers.__version__,
        peft=_version("peft"),
    )
