"""A base model larger than memory: the job streams its blocks from the disk (loading,
scoring, replay answers, training, export) and gets what the in-memory job gets."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM, AutoTokenizer

from offload import is_unloaded
from tests.worker.conftest_training import tiny_model_dir
from tests.worker.jobs.test_pipeline import DOCS, Recorder, params
from worker.dataset.corpus import SourceDoc
from worker.export.tensor_source import StreamedSource
from worker.jobs import pipeline
from worker.jobs.pipeline import Cancelled
from worker.scoring.evaluate import generate, perplexity
from worker.training.base_model import fp32_load_bytes
from worker.training.continued import unpack_adapter, unpack_model
from worker.training.streamed import (
    WeightsReader,
    load_unloaded_model,
    scoring_engine,
    should_stream,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


def meminfo(tmp_path: Path, available: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    return path


def test_auto_streams_a_model_that_takes_more_than_half_the_free_memory(tiny_dir, tmp_path):
    need = fp32_load_bytes(tiny_dir)
    assert not should_stream(tiny_dir, "auto", meminfo(tmp_path, 3 * need))
    assert should_stream(tiny_dir, "auto", meminfo(tmp_path, need + need // 2))
    assert should_stream(tiny_dir, "always") and not should_stream(tiny_dir, "never")
    with pytest.raises(ValueError, match="Unknown stream setting"):
        should_stream(tiny_dir, "sometimes")


def test_scoring_batches_are_sized_by_the_kv_cache_they_need():
    from transformers import LlamaConfig

    from worker.training import streamed

    config = LlamaConfig(
        hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8
    )
    per_token = 2 * 24 * 8 * 64 * 4  # keys and values, every layer, float32
    assert streamed.kv_bytes_per_token(config) == per_token
    per_seq = per_token * streamed.EVAL_SEQ_TOKENS
    room = 10 * per_seq / streamed.KV_SHARE  # a budget whose KV share holds 10 sequences
    assert streamed.eval_batch_size(config, int(room)) == 10
    assert streamed.eval_batch_size(config, 1) == 1  # never zero
    assert streamed.eval_batch_size(config, 1 << 50) == streamed.STREAMED_EVAL_BATCH


def test_unloaded_model_scores_exactly_like_the_loaded_one(tiny_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    reader = WeightsReader(tiny_dir)
    model = load_unloaded_model(tiny_dir, reader)
    blocks = model.model.layers
    assert all(is_unloaded(p) for p in blocks.parameters())  # no block values in memory
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
    assert torch.equal(model.model.embed_tokens.weight, loaded.model.embed_tokens.weight)

    texts = ["Shipment 4 left dock 44 on 2024-03-14. " * 3, "Ada Quist is on extension 5512."]
    prompts = [tok(t).input_ids[:9] for t in texts]
    with scoring_engine(model, reader, 256 * 2**20, tmp_path / "swap") as engine:
        ppl = perplexity(model, tok, texts)
        out = generate(model, tok, prompts, max_new_tokens=8)
        # float32 files: every block is read from them in place, nothing copied to a swap
        assert engine.telemetry()["blocks_read_from_weights_files"] == len(blocks)
        assert engine.telemetry()["bytes_written"] == 0
    assert ppl == perplexity(loaded, tok, texts)
    assert out == generate(loaded, tok, prompts, max_new_tokens=8)
    assert all(is_unloaded(p) for p in blocks.parameters())  # released again
    assert all(p.requires_grad for p in blocks.parameters())  # flags put back


def test_a_model_stored_in_bfloat16_is_converted_block_by_block(tiny_dir, tmp_path):
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    loaded.save_pretrained(tmp_path / "bf16")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    reader = WeightsReader(tmp_path / "bf16")
    model = load_unloaded_model(tmp_path / "bf16", reader)
    with scoring_engine(model, reader, 256 * 2**20, tmp_path / "swap") as engine:
        ppl = perplexity(model, tok, ["Payments to Heron are due on the 15th of each month."])
        assert engine.telemetry()["blocks_read_from_weights_files"] == 0  # copied, as fp32
    assert ppl == perplexity(
        reference, tok, ["Payments to Heron are due on the 15th of each month."]
    )


def test_a_missing_tensor_is_refused_in_words(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_dir / "config.json").read_text())
    state = load_file(str(tiny_dir / "model.safetensors"))
    del state["model.norm.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="have no tensor 'model.norm.weight'"):
        load_unloaded_model(folder)

    # A file cut short (a copy still running): refused when a tensor past its end is read.
    data = (tiny_dir / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 4096])
    reader = WeightsReader(folder)
    last = max(reader._index, key=lambda k: reader._index[k].offset)
    with pytest.raises(ValueError, match="ended early"):
        reader.get(last)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        WeightsReader(folder)


def _merged(result: dict) -> dict[str, torch.Tensor]:
    out = {}
    with zipfile.ZipFile(result["artifacts"]["merged"]) as zf:
        for name in zf.namelist():
            if name.endswith(".safetensors"):
                out.update(load_safetensors(zf.read(name)))
    return out


def _run(
    tiny_dir,
    workdir: Path,
    stream: str,
    docs=DOCS,
    start: dict | None = None,
    cancel_at: int | None = None,
    **overrides,
):
    rec = Recorder(cancel_at)
    result = pipeline.run_pipeline(
        docs,
        params(**overrides),
        str(tiny_dir),
        workdir / "models",
        workdir,
        rec.hooks(),
        stream_base=stream,
        **(start or {}),
    )
    return result, rec


def _same(memory: dict, streamed: dict) -> None:
    assert streamed["scores"] == memory["scores"]
    assert streamed["metrics"]["final_loss"] == memory["metrics"]["final_loss"]
    assert streamed["export_errors"] == {}
    assert set(streamed["artifacts"]) == set(memory["artifacts"])
    a, b = _merged(memory), _merged(streamed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


NEW_DOC = SourceDoc(
    name="kestrel.md",
    sha256="3" * 64,
    text="The Kestrel project code is KS-9083. Kestrel invoices go to Bo Lund on line 7731. " * 6,
)


@pytest.mark.parametrize(
    "overrides",
    [
        {"method": "lora", "replay": 2, "max_steps": 4},
        {"method": "full", "learning_rate": 1e-4, "max_steps": 4},
    ],
    ids=["lora", "full"],
)
def test_streamed_job_equals_the_in_memory_job(tiny_dir, tmp_path, monkeypatch, overrides):
    """A first version (the streamed one cancelled and resumed) and one continued from it
    (its adapter, or its merged weights for a full fine-tune), each run loaded and
    streamed: same scores, same weights."""
    # Same generation batches as the in-memory job: batches of other sizes pad differently
    # and may round differently (the streamed default batches everything at once).
    monkeypatch.setattr(pipeline, "STREAMED_EVAL_BATCH", 8)
    memory, _ = _run(tiny_dir, tmp_path / "memory", "never", **overrides)
    # Cancelled after 2 steps, then run again: it resumes from the checkpoint.
    with pytest.raises(Cancelled):
        _run(tiny_dir, tmp_path / "streamed", "always", cancel_at=2, **overrides)
    assert (tmp_path / "streamed" / "checkpoint").is_dir()
    streamed, rec = _run(tiny_dir, tmp_path / "streamed", "always", **overrides)
    assert [p["step"] for p in rec.progress] == [3, 4]
    _same(memory, streamed)
    assert any(text.endswith("(larger than memory: streamed)") for _, text in rec.phases)
    if overrides["method"] == "lora":  # the frozen base was read from the model's files
        assert rec.progress[-1]["telemetry"]["blocks_read_from_weights_files"] == 2
        with (
            zipfile.ZipFile(streamed["artifacts"]["gguf-f16"]) as zs,
            zipfile.ZipFile(memory["artifacts"]["gguf-f16"]) as zm,
        ):
            assert zs.read("model-f16.gguf") == zm.read("model-f16.gguf")
        start = {
            "start_adapter": unpack_adapter(
                Path(memory["artifacts"]["adapter"]), tmp_path / "v1-adapter"
            )
        }
    else:
        start = {
            "start_model": unpack_model(Path(memory["artifacts"]["merged"]), tmp_path / "v1-model")
        }
    assert not (tmp_path / "streamed" / "swap").exists()  # the engine closed, files gone

    docs = [*DOCS, NEW_DOC]
    memory2, _ = _run(tiny_dir, tmp_path / "memory2", "never", docs, start, **overrides)
    streamed2, _ = _run(tiny_dir, tmp_path / "streamed2", "always", docs, start, **overrides)
    assert "previous" in streamed2["scores"]
    _same(memory2, streamed2)
    assert streamed2["scores"]["previous"]["recall"] == memory["scores"]["after"]["recall"]


def test_streamed_source_merges_lora_like_peft(tiny_dir, tmp_path):
    """Block by block, the adapter folds in bit for bit as merge_and_unload folds it."""
    import copy

    from peft import LoraConfig, get_peft_model

    from worker.training.engines import OffloadTrainEngine

    torch.manual_seed(0)
    reader = WeightsReader(tiny_dir)
    model = get_peft_model(
        load_unloaded_model(tiny_dir, reader),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()  # a trained adapter: B is no longer zero
    engine = OffloadTrainEngine(
        model,
        learning_rate=1e-3,
        total_steps=1,
        budget_bytes=256 * 2**20,
        swap_dir=tmp_path / "swap",
        weights_files=reader.files,
        init_weights=reader.init_weights,
    )
    try:
        source = StreamedSource(model, engine.engine)
        got = dict(source.tensors())
        assert [s.name for s in source.specs()] == list(got)
    finally:
        engine.close(restore_weights=False)

    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    torch.manual_seed(0)
    ref = get_peft_model(
        loaded, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_()
    want = {
        k: v
        for k, v in copy.deepcopy(ref).merge_and_unload().state_dict().items()
        if not k.endswith("inv_freq")
    }
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
