"""Exports: the zips load with transformers / peft and reproduce the in-app model."""

from __future__ import annotations

import copy
import json
import zipfile
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker.conftest_training import text_examples, tiny_model_dir
from worker.export import export_adapter, export_merged, model_card
from worker.recipe import FineTuneRecipe, TrainConfig

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
    "base_model_id": "some/base",
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
        'from_pretrained("some/base")',
        "AutoModelForCausalLM",
    ):
        assert text in card, text
    full = model_card(CARD_INFO | {"method": "full"})
    assert "PeftModel" not in full and "full fine-tuning" in full
    assert "n/a" in model_card({"method": "full", "scores": {"before": {}, "after": {}}})


def test_lora_exports_round_trip(tiny_dir, tokenizer, tmp_path):
    model = trained(tiny_dir, tokenizer, tmp_path / "job", "lora")
    ids = torch.tensor([tokenizer("The Heron invoice code is", add_special_tokens=False).input_ids])
    expected = logits(model, ids)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert (expected - logits(base, ids)).abs().max() > 1e-3  # the adapter does change things
    weights_before = copy.deepcopy(model.state_dict())
    card = model_card(CARD_INFO | {"method": "lora"})

    adapter_zip = export_adapter(
        model, tokenizer, tmp_path / "out" / "adapter.zip", card, base_model_id="some/base"
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
    assert '"base_model_name_or_path": "some/base"' in (folder / "adapter_config.json").read_text()
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
