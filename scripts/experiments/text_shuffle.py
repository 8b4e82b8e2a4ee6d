"""The documents' text again, its sentences in another order (an experiment:
`--recipes default+text_shuffle=2`).

Allen-Zhu & Li ("Physics of Language Models: Part 3.1", 2023) found a fact a model read in
one fixed context is stored on that context, not on the thing it is about, so a question
that does not start the sentence off cannot reach it; reading the same sentences in
permuted orders ("permute") made the facts extractable. Here each document chunk trained on
is added `copies` more times, its paragraphs, sentences and table rows shuffled (seeded, a
new order a copy), a sentence that leans on the one before (starting "It", "They", "This",
...) kept behind it, a table's header line on top.
The same number of tokens as `text_repeat=copies+1`, which repeats the chunk as it is.
"""

from __future__ import annotations

import random
import re

from worker.dataset.build import encode_text
from worker.dataset.corpus import text_example
from worker.dataset.probes import split_sentences

_LEANS_BACK = {"it", "its", "they", "their", "them", "this", "these", "that", "those", "he",
               "she", "his", "her", "then", "there", "also", "both", "each", "such"}  # fmt: skip


def sentence_groups(text: str) -> list[str]:
    """The text's sentences, each with the ones after it that lean on it."""
    groups: list[str] = []
    for sentence in split_sentences(text):
        first = sentence.split()[0].lower().strip("\"'(,") if sentence.split() else ""
        if groups and first in _LEANS_BACK:
            groups[-1] = f"{groups[-1]} {sentence}"
        else:
            groups.append(sentence)
    return groups


def reordered(text: str, rng: random.Random) -> str:
    """The text in another order: its paragraphs, the sentence groups of a paragraph, a
    table's rows under its header line (a paragraph whose lines hold " | ")."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    rng.shuffle(paragraphs)
    out = []
    for para in paragraphs:
        lines = [ln for ln in para.splitlines() if ln.strip()]
        if len(lines) > 2 and all(" | " in ln for ln in lines):
            rows = lines[1:]
            rng.shuffle(rows)
            out.append("\n".join([lines[0], *rows]))
        else:
            groups = sentence_groups(para)
            rng.shuffle(groups)
            out.append(" ".join(groups))
    return "\n\n".join(out)


def shuffled_copies(tokenizer, examples: list[dict], copies: int, seed: int,
                    max_len: int) -> list[dict]:
    """`copies` more of each text example (labels on every token), reordered (`reordered`,
    seeded, a new order each time), at most `max_len` tokens; a chunk with one sentence is
    left out (there is no other order)."""
    if copies < 1:
        return []
    rng = random.Random(f"text_shuffle:{seed}")
    eos = tokenizer.eos_token_id
    out = []
    for ex in examples:
        ended = eos is not None and ex["input_ids"][-1:] == [eos]
        text = tokenizer.decode(ex["input_ids"], skip_special_tokens=True)
        if len(sentence_groups(text)) < 2:
            continue
        for _ in range(copies):
            ids = encode_text(tokenizer, reordered(text, rng))[: max_len - int(ended)]
            out.append(text_example(ids + [eos] * ended))
    return out
