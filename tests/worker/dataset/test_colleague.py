"""The score card's questions put as a colleague asks: tables found, reverse questions,
short forward ones, and the malformed ones the old card asked are not asked."""

from __future__ import annotations

import pytest

from app.contract.scores import QUESTION_KINDS
from worker.dataset.colleague import (
    MAX_SHARED,
    make_probes,
    other_words,
    reverse_questions,
    shared_words,
    table_practice,
    table_questions,
    well_formed,
)
from worker.dataset.probes import _candidates_for_doc, normalise
from worker.dataset.tables import find_tables

PIPE = """Our range

Code | Product | Price | Weight | Warranty
NW-4471 | Torque Sprocket | $129.50 | 2.3 kg | 36 months
NW-5820 | Gale Fan Mk II | $349.00 | 6.8 kg | 24 months
NW-3109 | Quiet Hinge | $18.75 | 0.2 kg | Lifetime
"""

RECORDS = """Prices

Code: NW-4471
Product: Torque Sprocket
In stock: 412

Code: NW-5820
Product: Gale Fan Mk II
In stock: 58
"""


def test_pipe_table_rows_are_keyed_by_name_and_code():
    [table] = find_tables("sheet.docx", PIPE)
    assert table.key_header == "Product" and table.code_header == "Code"
    assert [r.key for r in table.rows] == ["Torque Sprocket", "Gale Fan Mk II", "Quiet Hinge"]
    assert table.rows[0].code == "NW-4471"
    assert table.rows[0].cells == {"Price": "$129.50", "Weight": "2.3 kg", "Warranty": "36 months"}


def test_records_become_a_table():
    [table] = find_tables("prices.xlsx", RECORDS)
    assert table.key_header == "Product"
    assert table.rows[1].cells == {"In stock": "58"}


@pytest.mark.parametrize(
    "text",
    [
        "Code | Price\nA1 | 3\n",  # one row: a list of fields, not a table
        "Name | Price\nBolt | 3\nBolt | 4\n",  # the rows cannot be told apart
        "Code | Price\n12 | 3\n13 | 4\n",  # no column of names
        "Q1 | 1200 | 1300\nQ2 | 1 | 2\n",  # figures only
        "Just a sentence: with a colon.\nAnother: line here.",  # one record is no table
    ],
)
def test_no_table_to_look_things_up_in(text):
    assert find_tables("d", text) == []


def test_table_questions_by_row_and_column_and_by_code():
    [table] = find_tables("sheet.docx", PIPE)
    asked = {a.question: a.answer for a in table_questions(table)}
    assert asked["What is the weight of the Torque Sprocket?"] == "2.3 kg"
    assert asked["What is the price of the Quiet Hinge?"] == "$18.75"
    assert asked["Which product has the code NW-5820?"] == "Gale Fan Mk II"
    [records] = find_tables("prices.xlsx", RECORDS)
    asked = {a.question: a.answer for a in table_questions(records)}
    assert asked["How many of the Gale Fan Mk II are in stock?"] == "58"
    assert all(a.kind == "table" for a in table_questions(table))
    # A column headed by a verb is asked with it: not "What is the Leak check applies to?".
    [limits] = find_tables("qc.docx", "Test | Applies to | Pass limit\n"
                           "Leak check | Dishwashers | no drips\nPull-down | Fridges | below 5 °C\n")
    asked = {a.question: a.answer for a in table_questions(limits)}
    assert asked["What does the Leak check apply to?"] == "Dishwashers"
    assert asked["What is the pass limit of the Pull-down?"] == "below 5 °C"


def test_a_cell_a_guess_would_answer_is_not_asked():
    rows = [f"Glacia fridge {n} | {400 + n} | {'1 year' if n < 3 else f'{n} years'} | Fridges"
            for n in range(1, 11)]
    rows[9] = "Ironmead grill | 1295 | 5 years | Grills"
    [table] = find_tables("products.xlsx", "Product | Price | Warranty | Category\n"
                          + "\n".join(rows) + "\n")
    asked = {a.question: a.answer for a in table_questions(table)}
    # Every price differs: each is asked.
    assert sum(q.startswith("What is the price") for q in asked) == 10
    # "1 year" is two warranties of ten, not more than a fifth: asked. "Fridges" is nine of
    # ten categories, and the rows' names say it anyway.
    assert asked["What is the warranty of the Glacia fridge 1?"] == "1 year"
    assert asked["What is the warranty of the Glacia fridge 3?"] == "3 years"
    assert not any("category of the Glacia" in q for q in asked)
    # "Grills" is held by one row only, but its name says it: a guess, not a lookup.
    assert "What is the category of the Ironmead grill?" not in asked
    assert asked["What is the warranty of the Ironmead grill?"] == "5 years"
    [table] = find_tables("products.xlsx", "Product | Warranty\n" + "\n".join(
        f"Bolt {n} | {'1 year' if n < 4 else f'{n} years'}" for n in range(1, 11)) + "\n")
    warranties = {q: a for q, a in ((a.question, a.answer) for a in table_questions(table))}
    assert "1 year" not in warranties.values()  # three of ten: say "1 year" and be right
    assert warranties["What is the warranty of the Bolt 4?"] == "4 years"


def test_table_practice_is_worded_apart_from_the_card():
    [table] = find_tables("sheet.docx", PIPE)
    card = {normalise(a.question) for a in table_questions(table)}
    practice = table_practice(table)
    assert ("Look up NW-3109 in the sheet.", practice[-1][1]) in practice
    assert "Weight: 0.2 kg" in practice[-1][1]
    assert not card & {normalise(q) for q, _ in practice}


def _forward(text: str) -> dict[str, str]:
    """Each sentence's forward question, as the card would ask it: answer -> question."""
    out = {}
    for cands in _candidates_for_doc(0, text):
        for c in cands:
            asked = other_words(c.fact)
            if asked:
                out[asked.answer] = asked.question
                break
    return out


def test_forward_questions_are_short_and_in_few_of_the_documents_words():
    text = (
        "Welcome to Northwind. The company was founded in 1987 by Marguerite Olsson-Dray in a "
        "converted boathouse on Larkspur Quay in Port Ellery. Every employee receives 27 days "
        "of paid annual leave. Laptops are replaced every 42 months. The Friday all-hands at "
        "16:30 in the Lantern Room. Applications close on 30 June."
    )
    asked = _forward(text)
    assert asked["Port Ellery"] == "Where was the company founded in 1987 by Marguerite Olsson-Dray?"
    assert asked["27 days"] == "How many days does every employee receive?"
    assert asked["42 months"].casefold() == "how often are laptops replaced?"
    assert asked["30 June"] == "When do applications close?"
    for question in asked.values():
        assert well_formed(question, "")


def test_a_code_in_brackets_is_left_out_of_the_question():
    text = (
        "The Harbour Kettle (HK-210) boils a litre in two minutes. It costs £36. "
        "The Lantern Lamp (LL-7) lights the whole room."
    )
    asked = _forward(text)
    assert asked["£36"] == "How much does the Harbour Kettle cost?"
    assert all("(" not in q for q in asked.values())


@pytest.mark.parametrize(
    "text",
    [
        # What the old card asked (seen on the fixture corpus): the span inside a phrase,
        # the end of a range, an imperative, the sentence with a gap in it.
        "This sheet describes the current Northwind Widgets product range for sales staff.",
        "Our core hours are 10:00 to 15:00, Monday to Friday.",
        "Applications close soon. Send your CV to the talent team.",
        "Remember this. Mention that Quiet Hinge has a lifetime warranty.",
        (
            "Outside core hours you may start and finish when it suits you, as long as "
            "your weekly total reaches 37.5 hours."
        ),
        "It is machined from marine-grade aluminium alloy 6082 at the plant.",
        # Cut short, it would ask something else ("How often must passwords?").
        (
            "Passwords for the ERP must have at least 20 characters and are changed every "
            "35 months."
        ),
    ],
)
def test_malformed_or_sentence_copying_questions_are_not_asked(text):
    asked = _forward("An opening sentence. " + text)
    assert "Northwind Widgets" not in asked
    assert "15:00" not in asked
    assert "CV" not in asked and "Quiet Hinge" not in asked
    assert "37.5 hours" not in asked and "6082" not in asked and "35 months" not in asked


@pytest.mark.parametrize(
    "question",
    [
        "Which product does this sheet describe the current?",
        "What time are our core hours 10:00 to?",
        "Send your who?",
        "How many days must claims be filed in Ledgerline within?",
        "Which programme does?",
        "The NW-4471 Torque Sprocket is our best-selling part. How much does it cost?",
        'Fill in the blank: "Every employee receives ___"?',
        "How much does the sprocket cost? About $129.50?",
        # Seen on office documents before these were refused:
        "What percentage does Lena Fischer reported that order from Graz grew by?",
        "How long does a Quiet Hinge that hum?",
        "How many units is our lead time 25 working days?",
        "Which sold 2,700 units last year?",
        "What time are sick days reported to Carlos Mendes before?",
        "How often must passwords for the ERP have 20 characters and are changed?",
        # Seen on a company's office files (tests/fixtures/large_docs.py) before these were
        # refused: one end of a range, an imperative's verb as a subject, "Who" for a place.
        "Which date and 20 December engineers may only take leave?",
        "Where does Store your password?",
        "Who are the operating hours shown under?",
        # A list item read under its heading (probes.fact_sentences), asked as it is read.
        "Who does Practice meeting – minutes — 2 trainee posts?",
    ],
)
def test_not_well_formed(question):
    assert not well_formed(question, "$129.50")


def test_a_person_may_still_be_asked_for_by_whom_something_is_done():
    assert well_formed("Who is the rota drawn up by?", "Service Manager")
    assert well_formed("Who does the Quality Lead report to?", "Tobias Qureshi-Lane")


@pytest.mark.parametrize(
    "text",
    [
        # A past tense after a number is no unit ("3.2 took" was asked as "Which version
        # effect on 1 March 2022?"); a reflexive is no verb ("How long does laptops lock
        # themselve?").
        "Version 3.2 took effect on 1 March 2022.",
        "Laptops lock themselves after 6 minutes without use.",
    ],
)
def test_a_verb_is_not_taken_for_a_unit_nor_a_pronoun_for_a_verb(text):
    asked = _forward("An opening sentence. " + text)
    assert "3.2 took" not in asked
    assert all("themselve?" not in q for q in asked.values())


def test_reverse_questions_ask_for_the_thing_from_what_is_said_of_it():
    asked = reverse_questions(
        "It costs $18.75 and has a lifetime warranty.",
        "The NW-3109 Quiet Hinge is a silent self-closing hinge for cabinet doors.",
        "sheet.docx",
    )
    assert {a.question: a.answer for a in asked} == {"What costs $18.75?": "Quiet Hinge"}
    [relative] = reverse_questions(
        "Our biggest customer is Halvorsen Marine, which buys 9,000 Torque Sprockets a year.",
        "",
        "deck.pptx",
    )
    assert relative.question == "Which customer buys 9,000 Torque Sprockets a year?"
    assert relative.answer == "Halvorsen Marine" and relative.kind == "reverse"
    # Two things said of it, the second in the past tense: a question for each, not one
    # too long to ask (17 words) nor the two glued with a comma.
    asked = reverse_questions(
        "Our largest customer is Bramblefield Care Group, which runs 46 care home kitchens "
        "and placed £1.1 million of orders with us in 2021.", "", "deck.pptx")
    assert [a.question for a in asked] == [
        "Which customer runs 46 care home kitchens?",
        "Which customer placed £1.1 million of orders with us in 2021?",
    ]
    # A capitalised first word is no name to ask for ("Claims" is a common noun).
    assert reverse_questions("Claims must be filed in Ledgerline within 30 days.", "", "d") == []


def test_the_card_mixes_the_kinds_on_the_fixture_corpus(tmp_path):
    from scripts.experiments.recall import load_corpus

    docs = [(d.name, d.text) for d in load_corpus(tmp_path) if d.text]
    probes = make_probes(docs, max_probes=40)
    kinds = {k: sum(p.kind == k for p in probes) for k in QUESTION_KINDS}
    assert all(kinds.values()), kinds
    assert kinds["reverse"] <= 10 and kinds["table"] <= 10 + (40 - len(probes))
    for p in probes:
        assert well_formed(p.question, p.answer), p.question
        if p.kind == "other words":
            assert len(shared_words(p.question, p.sentence)) <= MAX_SHARED, p.question
            assert p.prompt  # a forward fact is also checked as a sentence completion
        else:
            assert p.prompt == ""
    assert len({normalise(p.answer) for p in probes}) == len(probes)
