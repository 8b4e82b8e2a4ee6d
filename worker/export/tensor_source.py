"""What an exporter reads a finished model from: its tensors one at a time, not a model.

A model that fits in memory is read from its state_dict (`model_source`). A model larger
than memory lives in the offload engine's swap and the model's own files; its source
(`StreamedSource`) pages one transformer block in at a time, so writing the merged
safetensors or a GGUF file never holds more than a block of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.errors import UserFacingError


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the plain (adapter-merged) model, as its state_dict names it."""

    name: str  # e.g. "model.layers.0.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorSource(Protocol):
    """A plain transformers causal LM (LoRA merged in), readable tensor by tensor.

    `specs()` and `tensors()` list the same names in the same order (state_dict order; a
    tied lm_head.weight is listed as the state_dict lists it, rotary inv_freq buffers are
    not listed). `tensors()` yields real CPU tensors; a caller that keeps only the current
    one holds at most a block of the model (for a streamed source)."""

    config: Any  # the model's transformers config (model_type, sizes, tie_word_embeddings)
    generation_config: Any | None

    def specs(self) -> list[TensorSpec]: ...

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def _persistent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v for k, v in model.state_dict().items() if not k.endswith("rotary_emb.inv_freq")
    }


class ModelSource:
    """A TensorSource over a model in memory (its state_dict)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.generation_config = getattr(model, "generation_config", None)

    def specs(self) -> list[TensorSpec]:
        return [
            TensorSpec(k, tuple(v.shape), v.dtype) for k, v in _persistent(self.model).items()
        ]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        with torch.no_grad():
            for k, v in _persistent(self.model).items():
                yield k, v.detach().cpu()


def model_source(model: torch.nn.Module) -> ModelSource:
    """The TensorSource of a plain (already merged) model in memory."""
    return ModelSource(model)


def as_source(model_or_source: Any) -> TensorSource:
    """A model in memory wrapped with model_source; anything else is taken as a source."""
    if isinstance(model_or_source, torch.nn.Module):
        return model_source(model_or_source)
    return model_or_source


def checked_tensors(
    source: TensorSource, specs: list[TensorSpec]
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """`source.tensors()` paired with `specs` (what a writer planned its file from), in order.

    A file's layout is fixed from the specs before any data is written, so a tensor that is
    not the one listed (name, shape or dtype), or one too many or too few, would make a
    broken file: ValueError in words instead."""
    expected = iter(specs)
    count = 0
    for name, tensor in source.tensors():
        spec = next(expected, None)
        if spec is None:
            raise ValueError(
                f"The model gave more tensors than it listed ({len(specs)}): "
                f"{name!r} is not on its list."
            )
        got = (name, tuple(tensor.shape), tensor.dtype)
        if got != (spec.name, tuple(spec.shape), spec.dtype):
            raise ValueError(
                f"The model's tensor number {count + 1} is {name!r} {list(tensor.shape)} "
                f"{tensor.dtype}, but its list says {spec.name!r} {list(spec.shape)} "
                f"{spec.dtype}."
            )
        count += 1
        yield spec, tensor
        del tensor  # not held while the source makes the next one
    if count != len(specs):
        raise ValueError(
            f"The model gave {count} tensors but listed {len(specs)}; "
            f"{specs[count].name!r} and after are missing."
        )


class StreamedSource:
    """A trained model whose blocks live in an open offload engine, as a TensorSource: the
    plain model's tensors (LoRA merged in, as peft's merge_and_unload computes them), one
    block paged in at a time."""

    def __init__(self, model: torch.nn.Module, engine) -> None:
        from peft import PeftModel

        self.base = model.get_base_model() if isinstance(model, PeftModel) else model
        self.engine = engine
        self.config = self.base.config
        self.generation_config = getattr(self.base, "generation_config", None)
        paths = {id(m): n for n, m in self.base.named_modules()}
        self._prefixes = [paths[id(b)] + "." for b in engine.blocks]

    def _entries(self) -> list[tuple[str, str, torch.Tensor]]:
        """(plain name, own name, tensor) in state_dict order, adapters left out."""
        out = []
        for key, t in self.base.state_dict(keep_vars=True).items():
            if ".lora_" in key or key.endswith("rotary_emb.inv_freq"):
                continue
            out.append((key.replace(".base_layer.", "."), key, t))
        return out

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(n, tuple(t.shape), t.dtype) for n, _, t in self._entries()]

    def _block_of(self, key: str) -> int | None:
        for i, prefix in enumerate(self._prefixes):
            if key.startswith(prefix):
                return i
        return None

    def _merged_block(self, i: int) -> dict[str, torch.Tensor]:
        """Block i's tensors by own state_dict name, adapters merged into their layers."""
        from peft.tuners.lora import LoraLayer

        prefix = self._prefixes[i]
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad(), self.engine.block_weights(i) as block:
            for key, t in block.state_dict(keep_vars=True).items():
                out[prefix + key] = t.detach().clone()
            for mod_name, mod in block.named_modules():
                if not isinstance(mod, LoraLayer):
                    continue
                if any(mod.lora_variant.values()) or any(mod.lora_bias.values()):
                    raise UserFacingError(
                        "Only plain LoRA adapters can be merged block by block."
                    )
                key = f"{prefix}{mod_name}.base_layer.weight"
                for adapter in mod.active_adapters:
                    if adapter in mod.lora_A:
                        delta = mod.get_delta_weight(adapter)  # on the adapter's device
                        out[key] += delta.to(out[key].device)  # as peft's merge adds it
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        current, values = None, {}
        for plain, key, t in self._entries():
            i = self._block_of(key)
            if i is None:
                yield plain, t.detach().cpu()
                continue
            if i != current:
                current, values = i, self._merged_block(i)
            yield plain, values.pop(key)
