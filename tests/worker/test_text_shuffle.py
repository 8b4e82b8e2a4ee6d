"""The recall experiment's reordered document text (scripts/experiments/text_shuffle.py)."""

from __future__ import annotations

import random

from scripts.experiments.text_shuffle import reordered, sentence_groups, shuffled_copies
from worker.dataset.build import encode_text
from worker.dataset.corpus import text_example

TEXT = ("The Quiet Hinge costs $18.75. It ships in 3 days. Harbour Blue is our colour. "
        "Dana Ruiz signs off orders over 500 units. Returns go to dock 4. "
        "The plant opened in 1987.")


def test_a_sentence_that_leans_on_the_one_before_stays_behind_it():
    assert sentence_groups(TEXT) == [
        "The Quiet Hinge costs $18.75. It ships in 3 days.",
        "Harbour Blue is our colour.",
        "Dana Ruiz signs off orders over 500 units.",
        "Returns go to dock 4.",
        "The plant opened in 1987.",
    ]


def test_copies_hold_the_same_sentences_in_new_seeded_orders(smol_tokenizer):
    eos = smol_tokenizer.eos_token_id
    chunk = text_example(encode_text(smol_tokenizer, TEXT) + [eos])
    one_group = text_example(encode_text(smol_tokenizer, "Returns go to dock 4."))
    copies = shuffled_copies(smol_tokenizer, [chunk, one_group], 3, seed=0, max_len=256)
    assert len(copies) == 3  # the one-sentence chunk has no other order
    texts = [smol_tokenizer.decode(c["input_ids"], skip_special_tokens=True) for c in copies]
    for c, text in zip(copies, texts, strict=True):
        assert c["labels"] == c["input_ids"] and c["input_ids"][-1] == eos
        assert sorted(sentence_groups(text)) == sorted(sentence_groups(TEXT))
    assert len({*texts, TEXT}) > 2  # new orders, not the chunk as it was
    assert copies == shuffled_copies(smol_tokenizer, [chunk, one_group], 3, seed=0, max_len=256)
    assert copies != shuffled_copies(smol_tokenizer, [chunk, one_group], 3, seed=1, max_len=256)
    assert shuffled_copies(smol_tokenizer, [chunk], 0, seed=0, max_len=256) == []
    short = shuffled_copies(smol_tokenizer, [chunk], 1, seed=0, max_len=8)[0]["input_ids"]
    assert len(short) == 8 and short[-1] == eos


def test_a_tables_rows_move_under_its_header_and_paragraphs_stay_whole():
    table = "Code | Product | Price\nNW-1 | Hinge | $1\nNW-2 | Fan | $2\nNW-3 | Jug | $3"
    prose = "Returns go to dock 4. The plant opened in 1987."
    orders = {reordered(f"{table}\n\n{prose}", random.Random(k)) for k in range(12)}
    assert len(orders) > 4
    for text in orders:
        paragraphs = text.split("\n\n")
        assert len(paragraphs) == 2
        rows = next(p for p in paragraphs if "|" in p).split("\n")
        assert rows[0] == "Code | Product | Price" and sorted(rows[1:]) == table.split("\n")[1:]
        assert sorted(sentence_groups(next(p for p in paragraphs if "|" not in p))) == sorted(
            sentence_groups(prose))
