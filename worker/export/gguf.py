"""A Llama-architecture Hugging Face model (SmolLM2 and kin) as a GGUF file for llama.cpp and
Ollama, written with the `gguf` package, plus the Ollama Modelfile that goes with it.

What llama.cpp's convert_hf_to_gguf.py does for a Llama model with a GPT-2 style BPE
tokenizer, in the same way (the embedded SmolLM2 GGUF is the reference for the keys):

- hyperparameters under `llama.*`; tensor names from gguf.TensorNameMap;
- q_proj / k_proj rows permuted into llama.cpp's rotary layout (GGUF readers such as
  transformers undo this when they load the file);
- 1-D tensors (norms) stay float32; 2-D weights are float16, or Q8_0 where their rows are
  whole 32-value blocks; a tied output head is not stored (llama.cpp reuses token_embd);
- tokenizer: `gpt2` model, the vocabulary in id order with token types (CONTROL for special
  added tokens), the merges, special token ids, add_bos_token, and the chat template.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from worker.errors import UserFacingError
from worker.export.tensor_source import TensorSpec, as_source, checked_tensors

FTYPES = {
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}
F16, Q8_0 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0
# SmolLM2's pre-tokenizer as llama.cpp names it (tokenizer.ggml.pre).
SMOLLM_PRE = "smollm"


def permute_rows(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotate-half layout of q/k rows -> llama.cpp's interleaved layout (per head, the
    two halves of each head's rows are interleaved)."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute_rows(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of permute_rows: llama.cpp layout back to HF's."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _merges(tokenizer) -> list[str]:
    """BPE merges as "a b" strings, read from the fast tokenizer's own JSON."""
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = model.get("merges") or []
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def _adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bos is not None and bool(ids) and ids[0] == bos


def tokenizer_metadata(tokenizer, vocab_size: int) -> dict:
    """The tokenizer.* keys llama.cpp reads, as plain Python values."""
    vocab = tokenizer.get_vocab()
    added = tokenizer.get_added_vocab()
    by_id = {i: t for t, i in vocab.items()}
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
            continue
        token = by_id[i]
        tokens.append(token)
        if token in added:
            special = decoder[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            types.append(int(gguf.TokenType.NORMAL))
    meta = {
        "model": "gpt2",
        "pre": SMOLLM_PRE if _is_smollm(tokens) else "default",
        "tokens": tokens,
        "token_type": types,
        "merges": _merges(tokenizer),
        "add_bos_token": _adds_bos(tokenizer),
        "chat_template": tokenizer.chat_template or None,
    }
    for key in ("bos", "eos", "unk", "pad"):
        value = getattr(tokenizer, f"{key}_token_id", None)
        if value is not None:
            meta[f"{key}_token_id"] = int(value)
    return meta


def _is_smollm(tokens: list[str]) -> bool:
    # SmolLM/SmolLM2's vocabulary starts with these special tokens, in this order.
    return tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _llama_config(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(config, "rope_theta", None) or 10000.0
    scaling = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if scaling not in (None, "default"):
        raise UserFacingError(
            f"GGUF export supports plain RoPE only; this model uses {scaling!r} scaling."
        )
    return {
        "n_layer": config.num_hidden_layers,
        "n_head": config.num_attention_heads,
        "n_head_kv": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": head_dim,
        "theta": float(theta),
    }


def _tensor_type(shape: tuple[int, ...], ftype: str) -> gguf.GGMLQuantizationType:
    """F32 for 1-D tensors (norms), Q8_0 for `ftype` q8_0 where rows are whole 32-value
    blocks, F16 otherwise."""
    if len(shape) < 2:
        return gguf.GGMLQuantizationType.F32
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]  # 32 values
    if ftype == "q8_0" and shape[-1] % block == 0:
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType.F16


@dataclass(frozen=True)
class _Planned:
    """Where one HF tensor goes in the GGUF file (None: not stored)."""

    gguf_name: str
    kind: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int


def _plan(spec: TensorSpec, names: gguf.TensorNameMap, tied: bool, ftype: str) -> _Planned | None:
    """The GGUF name, type and byte size of `spec`, from its name and shape alone (the data
    is not needed, so the whole file is laid out before any tensor is read)."""
    hf_name = spec.name
    if tied and hf_name == "lm_head.weight":
        return None  # llama.cpp uses token_embd for the output when output is absent
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    gguf_name = names.get_name(hf_name.removesuffix(".weight"))
    if gguf_name is None or not hf_name.endswith(".weight"):
        raise ValueError(f"No GGUF name for tensor {hf_name!r}.")
    shape = tuple(int(d) for d in spec.shape)
    kind = _tensor_type(shape, ftype)
    count = int(np.prod(shape, dtype=np.int64))
    if kind == gguf.GGMLQuantizationType.F32:
        nbytes = 4 * count
    elif kind == gguf.GGMLQuantizationType.F16:
        nbytes = 2 * count
    else:
        byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, kind)
        nbytes = int(np.prod(byte_shape, dtype=np.int64))
    return _Planned(gguf_name + ".weight", kind, shape, nbytes)


def _gguf_array(tensor: torch.Tensor, hf_name: str, kind, hp: dict) -> np.ndarray:
    """One tensor as the array written to the file: q/k rows permuted, then F32, F16 or
    packed Q8_0 bytes."""
    data = tensor.detach().to(torch.float32)
    if hf_name.endswith("q_proj.weight"):
        data = permute_rows(data, hp["n_head"])
    elif hf_name.endswith("k_proj.weight"):
        data = permute_rows(data, hp["n_head_kv"])
    array = data.cpu().numpy()
    if kind == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32)
    if kind == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, kind)


def write_gguf(
    model_or_source, tokenizer, path: Path, ftype: str = "f16", name: str = "model"
) -> Path:
    """Write a plain transformers Llama-style causal LM (adapters already merged), given as
    the model or as a TensorSource (worker.export.tensor_source), as a GGUF file at `path`
    (atomically: path.tmp, fsync, rename). Raises ValueError for a model this writer does
    not support, or a source whose tensors are not the ones it listed.

    Two passes, so a model larger than memory can be written: the file's layout (every
    tensor's name, type, shape and offset) comes from the source's specs, then the tensors
    are read, converted and written one at a time in the same order."""
    if ftype not in FTYPES:
        raise ValueError(f"Unknown GGUF type {ftype!r}; use one of {sorted(FTYPES)}.")
    source = as_source(model_or_source)
    config = source.config
    if config.model_type not in ("llama",):
        raise UserFacingError(
            f"GGUF export supports Llama-architecture models (like SmolLM2); this one is "
            f"{config.model_type!r}. Use the merged model download instead."
        )
    hp = _llama_config(config)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, hp["n_layer"])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    specs = source.specs()
    plan = [_plan(spec, names, tied, ftype) for spec in specs]
    vocab_size = config.vocab_size
    tok = tokenizer_metadata(tokenizer, vocab_size)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    try:
        writer.add_name(name)
        writer.add_type(gguf.GGUFType.MODEL)
        writer.add_context_length(int(config.max_position_embeddings))
        writer.add_embedding_length(int(config.hidden_size))
        writer.add_block_count(hp["n_layer"])
        writer.add_feed_forward_length(int(config.intermediate_size))
        writer.add_head_count(hp["n_head"])
        writer.add_head_count_kv(hp["n_head_kv"])
        writer.add_rope_freq_base(hp["theta"])
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_file_type(FTYPES[ftype])
        writer.add_vocab_size(vocab_size)
        writer.add_rope_dimension_count(hp["head_dim"])
        writer.add_tokenizer_model(tok["model"])
        writer.add_tokenizer_pre(tok["pre"])
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["token_type"])
        writer.add_token_merges(tok["merges"])
        for key in ("bos", "eos", "unk", "pad"):
            if f"{key}_token_id" in tok:
                getattr(writer, f"add_{key}_token_id")(tok[f"{key}_token_id"])
        writer.add_add_bos_token(tok["add_bos_token"])
        writer.add_add_space_prefix(False)
        if tok["chat_template"]:
            writer.add_chat_template(tok["chat_template"])
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

        # Pass 1: the layout. The writer computes each tensor's offset from these byte
        # sizes (each padded to the file's alignment), so they must be the written sizes.
        for planned in plan:
            if planned is None:
                continue
            writer.add_tensor_info(  # dtype is ignored where raw_dtype is given
                planned.gguf_name,
                planned.shape,
                np.dtype(np.float16 if planned.kind == F16 else np.float32),
                planned.nbytes,
                raw_dtype=planned.kind if planned.kind == Q8_0 else None,
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()

        # Pass 2: the data, one tensor in memory at a time (write_tensor_data pads to the
        # alignment before and after each tensor, as write_tensors_to_file does).
        # (No zip/enumerate here: their reused result tuple would keep the previous tensor
        # alive while the source makes the next one.)
        with torch.no_grad():
            index = 0
            for spec, tensor in checked_tensors(source, specs):
                planned = plan[index]  # checked_tensors yields exactly len(plan), or raises
                index += 1
                if planned is None:
                    del tensor
                    continue
                array = _gguf_array(tensor, spec.name, planned.kind, hp)
                del tensor
                if array.nbytes != planned.nbytes:  # a bug here, not in the model
                    raise RuntimeError(f"GGUF size of {spec.name!r} is not as planned.")
                writer.write_tensor_data(array)
                del array
        writer.close()
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


# ---------------------------------------------------------------------------------------
# Ollama


def default_system_prompt(chat_template: str | None) -> str | None:
    """The system prompt a ChatML template inserts when the conversation has none."""
    if not chat_template:
        return None
    m = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", chat_template, re.DOTALL)
    return m.group(1) if m else None


def modelfile(gguf_name: str, tokenizer) -> str:
    """An Ollama Modelfile for the GGUF file `gguf_name` (next to it in the download).

    ChatML (SmolLM2's format): the same prompt the model was trained and scored with,
    stopping at <|im_end|>. Greedy-ish decoding (temperature 0) like the score card."""
    template = tokenizer.chat_template or ""
    lines = [
        "# Ollama: ollama create my-model -f Modelfile && ollama run my-model",
        f"FROM ./{gguf_name}",
    ]
    if "<|im_start|>" in template:
        lines += [
            'TEMPLATE """{{- if .System }}<|im_start|>system',
            "{{ .System }}<|im_end|>",
            "{{ end }}",
            "{{- range .Messages }}",
            '{{- if eq .Role "user" }}<|im_start|>user',
            "{{ .Content }}<|im_end|>",
            '{{ else if eq .Role "assistant" }}<|im_start|>assistant',
            "{{ .Content }}<|im_end|>",
            "{{ end }}",
            "{{- end }}<|im_start|>assistant",
            '"""',
        ]
        system = default_system_prompt(template)
        if system:
            lines.append(f'SYSTEM """{system}"""')
        lines += ['PARAMETER stop "<|im_end|>"', 'PARAMETER stop "<|im_start|>"']
    elif tokenizer.eos_token:
        lines.append(f'PARAMETER stop "{tokenizer.eos_token}"')
    lines.append("PARAMETER temperature 0")
    return "\n".join(lines) + "\n"
