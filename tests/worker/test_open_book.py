"""The recall experiment's open book (scripts/experiments/open_book.py) finds passages of the
fixture documents as the chat's "Use my documents" does (app/chat/passages.py)."""

from __future__ import annotations

from app.chat.passages import TOP_K, prompt_with
from scripts.experiments.open_book import Library, found_answer, reading_practice
from scripts.experiments.recall import load_corpus
from tests.fixtures.docs import CALIBRATION


def test_the_search_finds_most_answers_and_the_prompt_is_the_chats(tmp_path):
    library = Library(load_corpus(tmp_path))
    question = "How many days of annual leave do employees get?"
    found = library.search(question)
    assert 0 < len(found) <= TOP_K
    assert found_answer(library, question, "27 days")
    assert library.prompt(question) == (prompt_with(question, found), True)
    # Search is not the bottleneck: the passages hold most calibration answers.
    held = sum(found_answer(library, f.question, f.answer) for f in CALIBRATION)
    assert held >= 0.75 * len(CALIBRATION)
    assert library.prompt("?!") == ("?!", False)  # no words: asked as it is


def test_reading_practice_asks_with_the_passages_found_and_teaches_only_the_answer(
    tmp_path, smol_tokenizer
):
    from worker.dataset.build import build_dataset
    from worker.dataset.corpus import IGNORE_INDEX

    docs = load_corpus(tmp_path)
    split = build_dataset(docs, smol_tokenizer, seed=0, generated_qa=2, holdout_frac=0.0)
    examples = reading_practice(smol_tokenizer, docs, split.probes, 2, 4096)
    assert len(examples) > 20
    calibration = {f.question for f in CALIBRATION}
    for ex in examples[:10]:
        text = smol_tokenizer.decode(ex["input_ids"])
        assert "Answer from these passages" in text and "[1] From" in text
        question = text.split("Question: ", 1)[1].split("<|im_end|>", 1)[0]
        assert question not in calibration and question not in {p.question for p in split.probes}
        taught = [t for t, lab in zip(ex["input_ids"], ex["labels"], strict=True) if lab != IGNORE_INDEX]
        assert 0 < len(taught) < len(ex["input_ids"]) / 3  # the answer, not the passages
    short = reading_practice(smol_tokenizer, docs, split.probes, 2, 200)
    assert len(short) < len(examples) and all(len(e["input_ids"]) <= 200 for e in short)
