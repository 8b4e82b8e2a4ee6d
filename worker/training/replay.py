"""Replay: the base model's own answers to a few everyday requests, trained on alongside the
documents so fine-tuning does not wash out its general English and chat manners.

The base model answers the prompts in worker/training/data/replay_prompts.txt (written for DocTune)
once, greedily, before training; those answers become chat examples with the loss on the
answer. Training to keep producing what it already produces anchors the model where the
documents pull it away (self-distillation). The forgetting check's sample is a different
text, so the check stays an honest measure.
"""

from __future__ import annotations

from pathlib import Path

from worker.dataset.build import encode_qa, qa_prompt_ids
from worker.dataset.corpus import answer_example

REPLAY_PROMPTS = Path(__file__).parent / "data" / "replay_prompts.txt"
ANSWER_TOKENS = 96  # the longest answer the base model gives a replay prompt


def replay_prompts(n: int) -> list[str]:
    lines = REPLAY_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()][:n]


def replay_pairs(
    model, tokenizer, n: int, max_new_tokens: int = ANSWER_TOKENS, batch_size: int = 8
) -> list[tuple[str, str]]:
    """(prompt, the model's own greedy answer) for the first `n` replay prompts."""
    from worker.scoring.evaluate import generate

    prompts = replay_prompts(n)
    was_training = model.training
    model.eval()
    try:
        answers = generate(
            model,
            tokenizer,
            [qa_prompt_ids(tokenizer, p) for p in prompts],
            max_new_tokens,
            batch_size,
        )
    finally:
        if was_training:
            model.train()
    return [(p, a.strip()) for p, a in zip(prompts, answers, strict=True) if a.strip()]


def replay_examples(
    tokenizer, pairs: list[tuple[str, str]], max_seq_len: int
) -> list[dict[str, list[int]]]:
    """Chat training examples (loss on the answer) from replay pairs."""
    out = []
    for prompt, answer in pairs:
        ids, n_prompt = encode_qa(tokenizer, prompt, answer)
        ids = ids[:max_seq_len]
        if n_prompt < len(ids):
            out.append(answer_example(ids, n_prompt))
    return out


def planned_lengths(tokenizer, n: int, max_seq_len: int) -> list[int]:
    """The longest the replay examples of the first `n` prompts can be, before the base
    model has answered them: each prompt with an answer of ANSWER_TOKENS (and its end)."""
    return [min(len(qa_prompt_ids(tokenizer, p)) + ANSWER_TOKENS + 1, max_seq_len)
            for p in replay_prompts(n)]


def planned_predicting(tokenizer, n: int, max_seq_len: int) -> list[int]:
    """planned_lengths' examples' positions that predict a label: their answers (and end)."""
    return [
        max(0, length - len(qa_prompt_ids(tokenizer, p)))
        for length, p in zip(planned_lengths(tokenizer, n, max_seq_len), replay_prompts(n),
                             strict=True)
    ]
