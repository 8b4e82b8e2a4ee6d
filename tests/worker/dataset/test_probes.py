"""Recall probes: planted facts are found, junk and give-aways are skipped."""

from __future__ import annotations

import pytest

from worker.dataset.colleague import make_probes
from worker.dataset.probes import (
    _candidates_for_doc,
    contains_answer,
    fact_sentences,
    fact_spans,
    gives_answer,
    normalise,
    split_sentences,
)

HANDBOOK = """Acme Handbook

Welcome to our company. The warranty lasts 36 months. Part NW-4471 ships from Lyon.
Our chief executive is Jane Smith. Write to help@acme.example for refunds.
The Ghent office opened on 3 March 2019. We are certified to ISO 9001 since 2015.

Page 3 of 9
| Q1 | 1200 | 1300 | 1400 |
The cat sat on the mat. It is fine.
"""


def _by_answer(probes):
    return {p.answer: p for p in probes}


def _best_spans(text: str):
    """Each usable sentence's best span, as a sentence completion (prompt, answer)."""
    return [cands[0] for cands in _candidates_for_doc(0, text)]


def test_planted_facts_become_completion_prompts():
    found = _by_answer(_best_spans(HANDBOOK))

    warranty = found["36 months"]
    assert warranty.prompt.endswith("The warranty lasts")
    assert warranty.sentence == "The warranty lasts 36 months."

    lyon = found["Lyon"]
    assert lyon.prompt.endswith("Part NW-4471 ships from")
    assert lyon.sentence == "Part NW-4471 ships from Lyon."

    assert found["Jane Smith"].prompt.endswith("Our chief executive is")
    assert found["help@acme.example"].prompt.endswith("Write to")
    assert found["3 March 2019"].prompt.endswith("The Ghent office opened on")
    assert found["ISO 9001"].prompt.endswith("We are certified to")


def test_junk_is_skipped():
    probes = _best_spans(HANDBOOK) + make_probes([("handbook.txt", HANDBOOK)])
    answers = {p.answer for p in probes}
    # Page numbers, table rows and sentences without a distinctive span give nothing.
    assert not answers & {"3", "9", "1200", "1300", "1400", "Q1", "mat", "Page"}
    assert all("cat sat" not in p.sentence for p in probes)
    # One forward question per sentence.
    card = [p for p in make_probes([("handbook.txt", HANDBOOK)]) if p.kind == "other words"]
    assert len({p.sentence for p in card}) == len(card)


def test_no_probe_gives_its_answer_away():
    text = (
        "Paris sends parcels to Paris. Lyon is lovely in spring. "
        "Ask for 7 of them. The fee is 5 euros."
    )
    probes = _best_spans(text)
    # "Paris" is the first word or already in the prompt; "Lyon" is the first word;
    # a lone digit is too easy to hit by chance. "5 euros" is a real fact.
    assert [p.answer for p in probes] == ["5 euros"]
    for p in make_probes([("handbook.txt", HANDBOOK)]):
        assert not contains_answer(p.prompt, p.answer)
        assert not contains_answer(p.question, p.answer)
        assert len(normalise(p.answer)) >= 2


def test_short_prefix_gets_previous_sentence_as_context():
    probes = _best_spans("Orders are packed every morning. Ask Jane Smith.")
    assert len(probes) == 1
    assert probes[0].prompt == "Orders are packed every morning. Ask"
    assert probes[0].answer == "Jane Smith"


def test_ambiguous_prompts_are_dropped():
    text = "The basic price is $10. The basic price is $20. The premium tier costs $35."
    probes = make_probes([("d", text)])
    assert [p.answer for p in probes] == ["$35"]
    assert probes[0].question == "How much does the premium tier cost?"


def test_repeated_answers_are_used_once():
    text = "Returns are accepted within 30 days. Repairs are finished within 30 days."
    [probe] = make_probes([("d", text)])
    assert probe.question.casefold() == "how long are returns accepted?"


def _facts(prefix: str, n: int, base: int = 100) -> str:
    return " ".join(f"The {prefix} item number {i} weighs {base + i} kg." for i in range(n))


def test_spread_across_documents_and_capped():
    docs = [
        ("a", _facts("red", 20)),
        ("b", _facts("blue", 20, 200)),
        ("c", _facts("green", 3, 300)),
    ]
    probes = make_probes(docs, max_probes=9)
    assert len(probes) == 9
    counts = {name: sum(p.source == name for p in probes) for name, _ in docs}
    assert counts == {"a": 3, "b": 3, "c": 3}
    # Document order, then sentence order.
    assert [p.source for p in probes] == sorted(p.source for p in probes)


def test_sampling_is_deterministic_by_seed():
    docs = [("a", _facts("red", 30))]
    first = make_probes(docs, max_probes=5, seed=0)
    assert first == make_probes(docs, max_probes=5, seed=0)
    others = [make_probes(docs, max_probes=5, seed=s) for s in range(1, 4)]
    assert any(o != first for o in others)
    assert make_probes(docs, max_probes=0) == []


def test_split_sentences_handles_abbreviations_and_wrapped_lines():
    text = "Call Dr. Who at noon. Prices rose\nsharply in 2020.\nNext item\n\nNew paragraph here."
    assert split_sentences(text) == [
        "Call Dr. Who at noon.",
        "Prices rose sharply in 2020.",
        "Next item",
        "New paragraph here.",
    ]


STRUCTURED = """Leave Policy

3.1 Annual leave
• Full-time staff: 25 days per year, plus bank holidays
• part-time staff receive leave pro rata
1. Carry-over. Up to 5 days can be carried into the next year.

3.2 Sickness
If you are ill, phone your line manager before 9:30 on your first day of absence.

Contacts
HR Manager: Priya Nandakumar (ext. 214)
Office hours: Mon–Fri 8:30–17:00

Product: Kelvin Desk
Price: £420

Product: Arden Chair
Price: £185
"""


def test_fact_sentences_read_items_under_their_heading():
    """Office files' lists, "Label: value" lines and figures without a verb are read under
    the heading above them, without their markers; headings are no sentences; prose, a
    numbered item of whole sentences and a table's records stay as split_sentences has
    them."""
    assert fact_sentences(STRUCTURED) == [
        "Annual leave — Full-time staff: 25 days per year, plus bank holidays.",
        "Annual leave — part-time staff receive leave pro rata.",
        "Carry-over.",
        "Up to 5 days can be carried into the next year.",
        "If you are ill, phone your line manager before 9:30 on your first day of absence.",
        "Contacts — HR Manager: Priya Nandakumar (ext. 214).",
        "Contacts — Office hours: Mon–Fri 8:30–17:00.",
        "Product: Kelvin Desk",
        "Price: £420",
        "Product: Arden Chair",
        "Price: £185",
    ]
    # Word's headings and list items come out a paragraph each (worker.extract.office).
    assert fact_sentences("2.1 Annual leave\n\nFull-time staff: 22 days\n\nLunch: 45 minutes"
                          "\n\n2.2 Sickness\n\nCall in by 9:15 on the first day") == [
        "Annual leave — Full-time staff: 22 days.",
        "Annual leave — Lunch: 45 minutes.",
        "Sickness — Call in by 9:15 on the first day.",
    ]
    # Prose with no heading, list or label is read exactly as split_sentences reads it.
    prose = HANDBOOK.split("\n\n", 1)[1]
    assert fact_sentences(prose) == split_sentences(prose)


def test_an_item_s_fact_is_asked_with_its_heading_s_words():
    facts = {
        f.sentence[f.start:f.end]: f.sentence
        for f in fact_spans([("handbook.docx", STRUCTURED)])
    }
    assert facts["25 days"].startswith("Annual leave — ")
    assert facts["214"] == facts["Priya Nandakumar"]  # "ext. 214" no longer ends a sentence
    # A label after the heading is the item's first word, not a name to ask for.
    assert "Contacts" not in facts and "Office" not in facts and "HR Manager" not in facts
    assert "Mon" not in facts and facts["8:30"].endswith("Office hours: Mon–Fri 8:30–17:00.")


def test_contains_answer_matches_whole_words_after_normalising():
    assert contains_answer("It lasts 36  Months, as agreed.", "36 months")
    assert contains_answer("Lyon.", "lyon")
    assert not contains_answer("It lasts 360 months.", "36 months")
    assert not contains_answer("about 360", "36")
    assert not contains_answer("anything", "")


def test_an_answer_is_given_only_with_its_percent_or_currency_sign():
    """Scoring (gives_answer): "€24" is not "a 24-hour delivery" (a tuned model's answer that
    contains_answer counted right); "6%" is not "6 months"; the sign's words count."""
    assert not gives_answer("We charge a 24-hour delivery to ship to Norway.", "€24")
    assert gives_answer("It costs €24.", "€24") and gives_answer("€24", "€24")
    assert not gives_answer("We match 6 months of salary.", "6%")
    assert gives_answer("A 6% pension match.", "6%")
    assert gives_answer("a 6 per cent match", "6%") and gives_answer("6 percent", "6%")
    assert not gives_answer("It costs 129.50.", "$129.50")
    assert gives_answer("The price is $18.75 each.", "18.75")  # no sign asked for
    assert gives_answer("It lasts 36  Months, as agreed.", "36 months")
    assert gives_answer("Lyon.", "'Lyon.'") and not gives_answer("about 360", "36")
    assert not gives_answer("anything", "") and not gives_answer("anything", "...")
    assert contains_answer("We charge a 24-hour delivery.", "€24")  # what a question gives away


def test_a_number_is_not_given_by_a_piece_of_a_bigger_one():
    """Scoring: a stock count of 17 was scored right from "stocked from 14:30 until 17:15"
    (Saltgrove's card, 2026-12-06)."""
    assert not gives_answer("It is stocked from 14:30 until 17:15.", "17")
    assert not gives_answer("It costs $129.50 each.", "$129")
    assert not gives_answer("Version 3.2 is current.", "2")
    assert not gives_answer("We made 1,850 of them.", "850")
    assert gives_answer("We have 17 in stock.", "17") and gives_answer("In stock: 17.", "17")
    assert gives_answer("Stock: 17, reorder at 5.", "17")
    assert gives_answer("Doors open at 9:30.", "9:30") and gives_answer("It costs $129.", "$129")


@pytest.mark.parametrize(
    ("sentence", "prompt_end", "answer"),
    [
        ("The office opens at 8:30 am on weekdays.", "The office opens at", "8:30 am"),
        ("Call the front desk on +33 4 78 00 12 34 today.", "front desk on", "+33 4 78 00 12 34"),
        ("Call the night desk on 555-0134 for help.", "night desk on", "555-0134"),
        ("Refunds take 14 business days, e.g. by Dr. Who.", "Refunds take", "14 business days"),
        ("The monthly fee is $1,200 per seat.", "The monthly fee is", "$1,200"),
        ("Students get a discount of 15% on books.", "a discount of", "15%"),
        ("We sold the plant to Acme's finance team.", "sold the plant to", "Acme"),
        ("The head office moved to New York City.", "moved to", "New York City"),
    ],
)
def test_span_kinds(sentence, prompt_end, answer):
    [probe] = _best_spans("An opening sentence. " + sentence)
    assert probe.prompt.endswith(prompt_end)
    assert probe.answer == answer


@pytest.mark.parametrize(
    "sentence",
    [
        "See the annex in Section 4 for details.",  # a lone digit
        "Its internal id was x-4471 at most.",  # span starts mid-word: "x-" gives it away
        # A capitalised word the document also writes in lower case is not a name.
        "Please read this Handbook carefully. The handbook is short.",
        "Page 3 of 9",
        "| Q1 | 1200 | 1300 | 1400 |",
    ],
)
def test_no_span_worth_asking(sentence):
    assert _best_spans("An opening sentence. " + sentence) == []
    assert make_probes([("d", "An opening sentence. " + sentence)]) == []
