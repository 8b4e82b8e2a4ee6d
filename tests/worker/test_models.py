"""The tests' tiny model factory (tests/worker/models.py): small, seeded, complete."""

from __future__ import annotations

import json

from tests.worker.conftest_training import tiny_model_dir
from tests.worker.models import save_tiny_model


def test_tiny_model_is_small_seeded_and_complete(tmp_path_factory, smol_tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_model_dir(tmp_path_factory, smol_tokenizer)
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (folder / name).is_file(), name
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # loads in 4.x too

    model = AutoModelForCausalLM.from_pretrained(folder)
    cfg = model.config
    assert (
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.intermediate_size,
    ) == (64, 2, 4, 2, 128)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template and len(tokenizer) == cfg.vocab_size

    same = save_tiny_model(tmp_path / "same", tokenizer_dir=folder, seed=0)
    other = save_tiny_model(tmp_path / "other", tokenizer_dir=folder, seed=1)
    a, b, c = (AutoModelForCausalLM.from_pretrained(f).state_dict() for f in (folder, same, other))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )

    ids = tokenizer("Hello", return_tensors="pt").input_ids
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
    )
    assert out.shape[1] == ids.shape[1] + 4
