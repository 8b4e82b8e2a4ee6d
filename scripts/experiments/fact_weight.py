"""More of the loss on the facts themselves (an experiment: `--recipes default+fact_weight=4`).

A practice answer is mostly words the question already gave ("Every employee receives ...
of paid annual leave"), and a document chunk mostly ordinary prose; the fact a colleague
asks about ("27 days") is a few of its tokens. Here each label token that is part of a fact
(a span `worker.dataset.probes.fact_spans` finds in the documents: a figure, name, code,
date, amount) counts `weight` times as much as any other token of its row, each row's loss
mass unchanged: a selective token loss in the spirit of Rho-1 (Lin et al. 2024), aimed at
what is asked. The loss is applied
by scripts/experiments/soft_replay.py's loss (its `weights`), so it combines with soft replay.
"""

from __future__ import annotations

import re

import torch

from worker.dataset.corpus import IGNORE_INDEX


def fact_answers(docs) -> list[str]:
    """The distinct fact spans of (name, text) documents, longest first (so a longer span
    is marked before a shorter one inside it)."""
    from worker.dataset.probes import fact_spans

    return sorted({f.answer for f in fact_spans(docs) if f.answer.strip()}, key=len,
                  reverse=True)


def label_weights(tokenizer, labels: list[int], answers: list[str], weight: float) -> list[float]:
    """A weight for each label the row predicts (the labels after the first that are not
    IGNORE_INDEX, in order): a token whose text overlaps a fact span standing as whole
    words in the decoded labels counts `weight` times as much as any other, and the weights
    sum to the number of labels, so the row weighs in the batch as before: the loss is moved
    onto the facts, not made larger (which a higher learning rate would do)."""
    predicted = [t for t in labels[1:] if t != IGNORE_INDEX]
    ends, text = [], ""
    for i in range(len(predicted)):  # the decoded text's length after each token
        text = tokenizer.decode(predicted[: i + 1])
        ends.append(len(text))
    marked = [False] * len(text)
    for answer in answers:
        for m in re.finditer(rf"(?<!\w){re.escape(answer)}(?!\w)", text):
            if not any(marked[m.start() : m.end()]):
                marked[m.start() : m.end()] = [True] * (m.end() - m.start())
    out, start = [], 0
    for end in ends:
        out.append(weight if any(marked[start:end]) else 1.0)
        start = max(start, end)
    scale = len(out) / sum(out) if out else 1.0  # the row's loss mass as before, moved
    return [w * scale for w in out]


def fact_weights(tokenizer, examples: list[dict], answers: list[str],
                 weight: float) -> dict[tuple, torch.Tensor]:
    """soft_replay's `weights`: for each example with a fact among its labels (and some
    other token: a row of facts alone weighs as before), by its token ids, the weight of
    each label it predicts."""
    out = {}
    for ex in examples:
        w = label_weights(tokenizer, ex["labels"], answers, weight)
        if len(set(w)) > 1:
            out[tuple(ex["input_ids"])] = torch.tensor(w)
    return out
