"""The chat on two machines (worker/chat/stages.py, head.py, tail.py): this process holds the
first stage, a second process (`python -m worker.chat.tail`, as another machine's training
worker starts it) the second, joined by gloo over loopback. The replies are one machine's
tokens, for the base model and a LoRA version; a follow-up restores both stages' caches from
their SSD stores; a stage that lost its part of the cache, or a lost second stage, costs a
prefill or the reply, never a wrong answer."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.worker.models import save_tiny_adapter, save_tiny_model
from worker.chat.generate import generate, keep
from worker.chat.head import await_tail, listen
from worker.chat.loaded import ChatModels, Version
from worker.chat.prompt import history_after, turn_ids
from worker.chat.stages import StageFailed, StageLost, stage_adapter, stage_blocks

ROOT = Path(__file__).resolve().parents[3]
QUESTION = "Who approves orders over 500 units?"


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory, smol_tokenizer) -> Path:
    folder = tmp_path_factory.mktemp("tiny-stages")
    smol_tokenizer.save_pretrained(folder / "tok")
    return save_tiny_model(folder / "model", tokenizer_dir=folder / "tok", seed=3,
                           num_hidden_layers=4)


class TwoStages:
    """The first stage here (ChatModels with stage 0 and a Tail), the second in a child."""

    def __init__(self, base: Path, folder: Path, idle_s: float = 120) -> None:
        self.tail_data = folder / "tail-data"
        self.jobs = self.tail_data / "jobs"  # versions' files: in the shared data folder
        self.jobs.mkdir(parents=True)
        store, endpoint = listen("127.0.0.1")
        env = {**os.environ, "DOCTUNE_BASE_MODEL": str(base),
               "DOCTUNE_DATA_DIR": str(self.tail_data), "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "worker.chat.tail", endpoint, "--address", "127.0.0.1",
             "--idle-s", str(idle_s)], cwd=ROOT, env=env)
        self.tail = await_tail(store, "127.0.0.1", "child")
        self.models = ChatModels(base, folder / "versions", folder / "head-kv",
                                 cache_bytes=1 << 30, stage=0, tail=self.tail)

    def close(self) -> None:
        self.tail.close()
        self.models.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def two(tiny4, tmp_path):
    stages = TwoStages(tiny4, tmp_path)
    yield stages
    if stages.proc.poll() is None:
        stages.close()


def _ask(models: ChatModels, version: Version, prompt: list[int], n: int = 24,
         temperature: float = 0.0):
    with models.use(version, greedy=temperature <= 0) as loaded:
        return generate(loaded.model, loaded.tokenizer, loaded.store, prompt, max_new_tokens=n,
                        temperature=temperature, seed=3)


def test_the_cut_is_the_pipeline_trainings(tiny4):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny4)
    first, second = stage_blocks(config, 0), stage_blocks(config, 1)
    assert first[0] == 0 and first[1] == second[0] and second[1] == 4 and first[1] < 4


def test_two_stages_answer_as_one_machine(two, tiny4, tmp_path):
    """Base model and a LoRA version (its matrices cut to each stage's blocks, renumbered),
    switched back and forth: every reply is the one machine's tokens."""
    adapter = save_tiny_adapter(tiny4, two.jobs / "adapter.zip", seed=5)
    one = ChatModels(tiny4, tmp_path / "one-versions", None)
    tok = AutoTokenizer.from_pretrained(tiny4)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    version = Version(7, "lora", adapter)
    expected_base, expected_tuned = _ask(one, Version(None), prompt), _ask(one, version, prompt)
    assert expected_base.ids != expected_tuned.ids  # the adapter changes the answer

    assert _ask(two.models, Version(None), prompt).ids == expected_base.ids
    assert _ask(two.models, version, prompt).ids == expected_tuned.ids
    assert _ask(two.models, Version(None), prompt).ids == expected_base.ids  # adapter off again
    # Sampling needs every logit: the second stage sends them all, the same draws come out.
    sampled = _ask(one, version, prompt, 40, temperature=1.5)
    assert sampled.ids != expected_tuned.ids[: len(sampled.ids)]
    assert _ask(two.models, version, prompt, 40, temperature=1.5).ids == sampled.ids


def test_a_full_version_answers_as_on_one_machine(two, tiny4, tmp_path):
    """A full fine-tuned version: each stage loads its blocks from the version's own files."""
    from transformers import AutoModelForCausalLM

    from worker.export.writers import export_merged

    tuned = save_tiny_model(tmp_path / "tuned", tokenizer_dir=tiny4, seed=12,
                            num_hidden_layers=4)
    tok = AutoTokenizer.from_pretrained(tiny4)
    model = AutoModelForCausalLM.from_pretrained(tuned)
    version = Version(8, "full", export_merged(model, tok, two.jobs / "merged.zip", "full"))
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    one = ChatModels(tiny4, tmp_path / "one-versions", None)
    expected = _ask(one, version, prompt)
    assert expected.ids != _ask(one, Version(None), prompt).ids
    assert _ask(two.models, version, prompt).ids == expected.ids


def test_an_idle_second_stage_ends_and_is_found_gone(tiny4, tmp_path):
    """After its idle time the second stage exits (its memory and its machine's worker free
    again); the first stage's check before a reply finds it gone."""
    two = TwoStages(tiny4, tmp_path, idle_s=1)
    try:
        assert two.proc.wait(timeout=30) == 0
        assert not two.tail.alive()
    finally:
        two.models.close()


def test_a_follow_up_restores_both_stages_caches(two, tiny4):
    tok = AutoTokenizer.from_pretrained(tiny4)
    turns = [{"role": "user", "content": QUESTION}]
    prompt = turn_ids(tok, [], turns)
    with two.models.use(Version(None)) as loaded:
        first = generate(loaded.model, tok, loaded.store, prompt, max_new_tokens=30)
        history = history_after(prompt, first.ids, tok)
        keep(loaded.model, loaded.store, history, first.cache)
    tail_files = list((two.tail_data / "kvcache").rglob("*.safetensors"))
    assert tail_files, "the second stage saved no cache"
    turns += [{"role": "assistant", "content": first.text},
              {"role": "user", "content": "And under 500?"}]
    prompt2 = turn_ids(tok, history, turns)
    one = ChatModels(tiny4, two.models.work_dir.parent / "one", None)
    cold = _ask(one, Version(None), prompt2, 30)
    with two.models.use(Version(None)) as loaded:
        second = generate(loaded.model, tok, loaded.store, prompt2, max_new_tokens=30)
    assert second.stats.restored_tokens == len(history)
    assert second.ids == cold.ids

    for f in tail_files:  # the second stage lost its part: both prefill, same tokens
        f.unlink()
    with two.models.use(Version(None)) as loaded:
        third = generate(loaded.model, tok, loaded.store, prompt2, max_new_tokens=30)
        history2 = history_after(prompt2, third.ids, tok)
        keep(loaded.model, loaded.store, history2, third.cache)
    assert third.stats.restored_tokens < len(history) and third.ids == cold.ids

    # The conversation deleted: both stages' files go.
    head_dir = two.models.cache_dir
    assert list(head_dir.rglob("*.safetensors")) and list(two.tail_data.rglob("*.safetensors"))
    assert two.models.forget(Version(None), history2) > 0
    assert not list(head_dir.rglob("*.safetensors"))
    assert not list((two.tail_data / "kvcache").rglob("*.safetensors"))


def test_a_lost_second_stage_fails_the_reply_in_its_own_words(two, tiny4):
    tok = AutoTokenizer.from_pretrained(tiny4)
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    _ask(two.models, Version(None), prompt, 4)
    assert two.tail.alive()
    two.proc.kill()
    two.proc.wait()
    with pytest.raises(StageLost):
        _ask(two.models, Version(None), prompt, 4)
    assert not two.tail.alive()


def test_another_base_model_on_the_other_machine_is_refused(tiny4, tmp_path, smol_tokenizer):
    other = save_tiny_model(tmp_path / "other", tokenizer_dir=tiny4, seed=11, num_hidden_layers=4)
    two = TwoStages(tiny4, tmp_path)
    try:  # the first stage's weights, and a second stage made from another model's
        two.models.base_dir = other
        with pytest.raises(StageFailed, match="differs"), two.models.use(Version(None)):
            pass
    finally:
        two.close()


def test_a_version_outside_the_data_folder_is_refused(two, tiny4, tmp_path):
    """The second stage opens only files in its DocTune data folder, whatever it is told."""
    adapter = save_tiny_adapter(tiny4, tmp_path / "elsewhere.zip", seed=5)
    with pytest.raises(StageFailed, match="not in this machine's DocTune data folder"), \
            two.models.use(Version(7, "lora", adapter)):
        pass
    tok = AutoTokenizer.from_pretrained(tiny4)  # and it goes on answering
    prompt = turn_ids(tok, [], [{"role": "user", "content": QUESTION}])
    assert _ask(two.models, Version(None), prompt, 4).ids


def test_a_stage_adapter_keeps_its_blocks_renumbered(tiny4, tmp_path):
    from safetensors.torch import load_file

    from worker.training.continued import unpack_adapter

    folder = unpack_adapter(save_tiny_adapter(tiny4, tmp_path / "a.zip"), tmp_path / "a")
    whole = load_file(folder / "adapter_model.safetensors")
    part = load_file(stage_adapter(folder, 3, 4, tmp_path / "s") / "adapter_model.safetensors")
    assert part and len(part) * 4 == len(whole)
    for key, value in part.items():
        assert ".layers.0." in key
        assert value.equal(whole[key.replace(".layers.0.", ".layers.3.")])
