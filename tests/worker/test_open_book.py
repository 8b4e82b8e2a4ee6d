"""The recall experiment's open book (scripts/experiments/open_book.py) finds passages of the
fixture documents as the chat's "Use my documents" does (app/chat/passages.py)."""

from __future__ import annotations

from app.chat.passages import TOP_K, prompt_with
from scripts.experiments.open_book import Library, found_answer
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
