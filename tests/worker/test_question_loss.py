"""The loss on a practice question too (scripts/experiments/question_loss.py): the question
and its answer carry labels, the system prompt never, text examples as they were."""

from __future__ import annotations

from scripts.experiments.question_loss import system_prefix, with_question_loss
from worker.dataset.build import encode_qa, encode_text
from worker.dataset.corpus import IGNORE_INDEX, answer_example, text_example


def _labelled(tokenizer, labels: list[int]) -> str:
    return tokenizer.decode([t for t in labels if t != IGNORE_INDEX])


def test_the_question_is_labelled_the_system_prompt_not(smol_tokenizer):
    prefix = system_prefix(smol_tokenizer)
    assert "helpful AI assistant" in smol_tokenizer.decode(prefix)
    assert smol_tokenizer.decode(prefix).endswith("user\n")
    ids, n_prompt = encode_qa(smol_tokenizer, "How long is the guarantee?", "It is 21 days.")
    text = text_example(encode_text(smol_tokenizer, "Bin K-13 holds the descaler."))
    answer = answer_example(ids, n_prompt)
    before = _labelled(smol_tokenizer, answer["labels"])
    assert "guarantee" not in before and "21 days" in before
    asked, read = with_question_loss(smol_tokenizer, [answer, text])
    assert asked["input_ids"] == ids
    assert asked["labels"][: len(prefix)] == [IGNORE_INDEX] * len(prefix)
    assert asked["labels"][len(prefix):] == ids[len(prefix):]
    after = _labelled(smol_tokenizer, asked["labels"])
    assert after.startswith("How long is the guarantee?") and after.rstrip().endswith(
        "It is 21 days.<|im_end|>")
    assert read == text  # the loss was on every token already
    assert answer["labels"][0] == IGNORE_INDEX and "guarantee" not in _labelled(
        smol_tokenizer, answer["labels"])  # the input examples are not changed


def test_an_example_without_the_prefix_is_left_as_it_is(smol_tokenizer):
    ids = encode_text(smol_tokenizer, "Question: who signs it off? Answer: Dana Ruiz.")
    odd = answer_example(ids, 6)
    assert with_question_loss(smol_tokenizer, [odd]) == [odd]


def test_question_loss_is_a_recipe_setting():
    from scripts.experiments.recall import Levers, _known, recipe_spec

    assert _known("default+question_loss=true") and not _known("default+question_loss=3")
    spec = recipe_spec("default+question_loss=true", [])
    assert Levers.popped(spec).question_loss is True and "question_loss" not in spec
