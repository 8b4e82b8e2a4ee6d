"""Replay: the base model's own answers to everyday prompts, as chat training examples."""

from __future__ import annotations

import json

from worker.dataset.build import qa_prompt_ids
from worker.dataset.corpus import IGNORE_INDEX
from worker.scoring.evaluate import general_text
from worker.training.replay import replay_examples, replay_pairs, replay_prompts


def test_prompts_are_everyday_requests_not_the_forgetting_sample():
    prompts = replay_prompts(100)
    assert len(prompts) >= 16 and replay_prompts(3) == prompts[:3]
    sample = general_text().lower()
    for p in prompts:
        assert p.lower() not in sample  # the forgetting check stays an unseen text


def test_pairs_are_the_models_own_greedy_answers(smol_tokenizer, tiny_model):
    from worker.scoring.evaluate import generate

    pairs = replay_pairs(tiny_model, smol_tokenizer, 3, max_new_tokens=8)
    assert [p for p, _ in pairs] == replay_prompts(3)
    expected = generate(tiny_model, smol_tokenizer,
                        [qa_prompt_ids(smol_tokenizer, p) for p in replay_prompts(3)], 8)
    assert [a for _, a in pairs] == [e.strip() for e in expected]
    assert not tiny_model.training
    json.dumps(pairs)


def test_examples_put_the_loss_on_the_answer(smol_tokenizer):
    [ex] = replay_examples(smol_tokenizer, [("Say hello.", "Hello there!")], 256)
    n = len(qa_prompt_ids(smol_tokenizer, "Say hello."))
    assert ex["labels"][:n] == [IGNORE_INDEX] * n
    assert smol_tokenizer.decode(ex["labels"][n:]).startswith("Hello there!")
    assert replay_examples(smol_tokenizer, [("Say hello.", "Hello there!")], n) == []
