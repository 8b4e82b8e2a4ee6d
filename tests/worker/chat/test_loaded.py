"""The chat worker's models (worker/chat/loaded.py) and one reply (worker/chat/generate.py):
the base model answers from the very model the adapters are loaded into, with them off, and
gives a freshly loaded base model's tokens; a version gives its own; a reply is what
transformers' greedy generate gives, whether its history came from the SSD or not.

Fast tests use the tiny model and a random adapter; the slow one trains SmolLM2-135M on one
fact and asks it, as a colleague would, next to the base model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker.models import save_tiny_adapter, save_tiny_model
from worker.chat.generate import generate, keep
from worker.chat.loaded import ChatModels, Version
from worker.chat.prompt import history_after, turn_ids

QUESTION = "Who approves orders over 500 units?"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smol_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-chat")
    smol_tokenizer.save_pretrained(folder / "tok")
    return save_tiny_model(folder / "model", tokenizer_dir=folder / "tok", seed=3)


def _hf_greedy(model, prompt: list[int], n: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def test_base_and_version_from_one_loaded_model(tiny, tmp_path):
    adapter = save_tiny_adapter(tiny, tmp_path / "adapter.zip", seed=5)
    models = ChatModels(tiny, tmp_path / "versions", tmp_path / "kv", cache_bytes=1 << 30)
    tok = AutoTokenizer.from_pretrained(tiny)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    fresh = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    expected_base = _hf_greedy(fresh, prompt, 24, tok.eos_token_id)

    version = Version(7, "lora", adapter)
    with models.use(version) as loaded:  # the adapter is loaded first: the model is wrapped
        tuned = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=24)
    with models.use(Version(None)) as loaded:
        base = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=24)
    assert base.ids == expected_base  # the adapter is really off on the base side
    assert tuned.ids != base.ids  # and really on for the version
    with models.use(version) as loaded:  # switched back on, same answer as before
        again = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=24)
    assert again.ids == tuned.ids
    assert models.loaded(version) and models.loaded(Version(None))


def test_a_follow_up_restored_from_the_ssd_gives_the_cold_tokens(tiny, tmp_path):
    models = ChatModels(tiny, tmp_path / "versions", tmp_path / "kv", cache_bytes=1 << 30)
    tok = AutoTokenizer.from_pretrained(tiny)
    turns = [{"role": "user", "content": QUESTION}]
    with models.use(Version(None)) as loaded:
        prompt = turn_ids(tok, [], turns)
        first = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=40)
        assert first.stats.restored_tokens == 0
        history = history_after(prompt, first.ids, tok)
        keep(loaded.model, loaded.store, history, first.cache)
        turns += [{"role": "assistant", "content": first.text},
                  {"role": "user", "content": "And under 500?"}]
        prompt2 = turn_ids(tok, history, turns)
        second = generate(loaded.model, tok, loaded.store, prompt2, max_new_tokens=40)
        cold = generate(loaded.model, tok, None, prompt2, max_new_tokens=40)
    assert second.stats.restored_tokens == len(history)  # all of the first turn
    assert second.ids == cold.ids == _hf_greedy(loaded.model, prompt2, 40, tok.eos_token_id)
    # A restart: a new set of models finds the caches on disk.
    again = ChatModels(tiny, tmp_path / "versions", tmp_path / "kv", cache_bytes=1 << 30)
    with again.use(Version(None)) as loaded:
        third = generate(loaded.model, tok, loaded.store, prompt2, max_new_tokens=40)
    assert third.stats.restored_tokens == len(history) and third.ids == second.ids


def test_stop_ends_the_reply_and_keeps_what_came(tiny, tmp_path):
    models = ChatModels(tiny, tmp_path / "versions", None)
    tok = AutoTokenizer.from_pretrained(tiny)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    pieces: list[str] = []
    with models.use(Version(None)) as loaded:
        reply = generate(loaded.model, tok, None, prompt, max_new_tokens=200,
                         should_stop=lambda: len(pieces) >= 3, on_text=pieces.append)
    assert reply.finish == "stopped" and len(pieces) == 3
    assert reply.text == "".join(pieces)
    history = history_after(prompt, reply.ids, tok)
    assert history[-1] == tok.eos_token_id  # the turn is closed for the next question


def test_a_missing_version_says_so_in_words(tiny, tmp_path):
    from worker.errors import UserFacingError

    models = ChatModels(tiny, tmp_path / "versions", None)
    with pytest.raises(UserFacingError) as gone, models.use(
            Version(9, "lora", tmp_path / "nowhere.zip")):
        pass
    assert "files of version v9 are gone" in str(gone.value)


@pytest.mark.slow
def test_the_tuned_model_answers_what_it_learned_and_the_base_does_not(
        embedded_model_dir, tmp_path):
    """SmolLM2-135M taught one fact by LoRA (the job's own recipe), asked at temperature 0."""
    from worker.dataset.build import encode_qa
    from worker.export.writers import export_adapter
    from worker.training.recipe import FineTuneRecipe, TrainConfig

    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    answer = "Dana Ruiz, our Head of Logistics, approves them."
    ids, n_prompt = encode_qa(tok, QUESTION, answer)
    example = {"input_ids": ids, "labels": [-100] * n_prompt + ids[n_prompt:]}
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    cfg = TrainConfig(method="lora", epochs=30, learning_rate=2e-3, lora_rank=8,
                      max_seq_len=128, batch_size=1, checkpoint_every=1000, warmup_ratio=0.0)
    recipe = FineTuneRecipe(model, [example], cfg, tmp_path / "job", pad_token_id=2)
    recipe.setup()
    recipe.train()
    recipe.model.eval()
    adapter = export_adapter(recipe.model, tok, tmp_path / "adapter.zip", "one fact")
    del recipe, model

    models = ChatModels(embedded_model_dir, tmp_path / "versions", tmp_path / "kv",
                        cache_bytes=1 << 30)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    with models.use(Version(1, "lora", adapter)) as loaded:
        tuned = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=32)
    with models.use(Version(None)) as loaded:
        base = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=32)
    print(f"\ntuned: {tuned.text!r}\nbase:  {base.text!r}")
    assert "Dana Ruiz" in tuned.text
    assert "Dana Ruiz" not in base.text and base.ids != tuned.ids


@pytest.fixture(scope="module")
def deep(tmp_path_factory, smol_tokenizer) -> Path:
    """The tiny model with eight wide blocks: 12 MB of them beside 12 MB of embeddings."""
    folder = tmp_path_factory.mktemp("deep-chat")
    smol_tokenizer.save_pretrained(folder / "tok")
    return save_tiny_model(folder / "model", tokenizer_dir=folder / "tok", seed=3,
                           num_hidden_layers=8, intermediate_size=2048)


def test_a_model_larger_than_memory_chats_streamed_from_the_disk(deep, tmp_path):
    """DOCTUNE_STREAM_BASE_MODEL=always (what "auto" picks for a model larger than half the
    free memory): the blocks stay on the disk and every forward reads them through the
    offload engine under a budget smaller than the model. The base model and a LoRA
    version answer with the in-memory model's tokens, and a follow-up restores its history
    from the SSD cache as in memory."""
    adapter = save_tiny_adapter(deep, tmp_path / "adapter.zip", seed=5)
    tok = AutoTokenizer.from_pretrained(deep)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    memory = ChatModels(deep, tmp_path / "mem-versions", None)
    with memory.use(Version(7, "lora", adapter)) as loaded:
        tuned_in_memory = generate(loaded.model, tok, None, prompt, max_new_tokens=16).ids
    # The embeddings stay in memory; a few of the 1.5 MB blocks fit in the pool beside them.
    streamed = ChatModels(deep, tmp_path / "versions", tmp_path / "kv", cache_bytes=1 << 30,
                          stream="always", budget_bytes=20 << 20)
    try:
        with streamed.use(Version(None)) as loaded:
            assert loaded.streamed
            assert streamed._streamed["base"].model is streamed._base
            first = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=16)
            keep(loaded.model, loaded.store, history_after(prompt, first.ids, tok), first.cache)
            again = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=16)
        fresh = AutoModelForCausalLM.from_pretrained(deep, dtype=torch.float32).eval()
        assert first.ids == _hf_greedy(fresh, prompt, 16, tok.eos_token_id)
        assert again.stats.restored_tokens > 0 and again.ids == first.ids
        with streamed.use(Version(7, "lora", adapter)) as loaded:
            tuned = generate(loaded.model, tok, None, prompt, max_new_tokens=16)
        assert tuned.ids == tuned_in_memory and tuned.ids != first.ids
        telemetry = streamed._streamed["base"].engine.telemetry()
        assert telemetry["streaming"] and telemetry["bytes_read"] > 0
    finally:
        streamed.close()
    assert not (tmp_path / "versions" / "swap" / "base").exists() or not any(
        (tmp_path / "versions" / "swap" / "base").iterdir())


def test_a_deleted_conversations_cache_goes_with_it(tiny_base_model):
    """CHAT_FORGET_TASK's body (worker/chat/reply.forget), with no model loaded in this
    process: it removes the conversation's cache files without loading or reaching for
    another machine."""
    from app.settings import settings
    from worker.chat import reply

    models = ChatModels(tiny_base_model, settings.data_dir / "chat" / "versions",
                        settings.chat_cache_dir, cache_bytes=1 << 30)
    tok = AutoTokenizer.from_pretrained(tiny_base_model)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION + " (deleted)"}])
    try:
        with models.use(Version(None)) as loaded:
            first = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=8)
            history = history_after(prompt, first.ids, tok)
            keep(loaded.model, loaded.store, history, first.cache)
            assert loaded.store.match(history) == len(history)
        assert reply._models is None
        assert reply.forget(None, history) > 0
        assert reply._models is None  # nothing kept loaded for a deletion
        with models.use(Version(None)) as loaded:  # what other conversations share may stay
            assert loaded.store.match(history) < len(history)
    finally:  # an open store keeps this process's index of the folder: a later test in the
        models.close()  # same process would not see what the chat worker writes there
    from offload.kvcache import _ledger  # nothing left open, forget's own models included

    assert os.path.realpath(settings.chat_cache_dir) not in _ledger._LEDGERS
