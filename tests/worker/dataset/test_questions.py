"""Question phrasings made from fact sentences: natural enough to ask, and the probe's
phrasing never among the training phrasings of the same fact."""

from __future__ import annotations

import re

import pytest

from app.contract.scores import QUESTION_KINDS
from worker.dataset.colleague import make_probes
from worker.dataset.probes import fact_spans
from worker.dataset.questions import (
    PROBE_TEMPLATES,
    TRAIN_TEMPLATES,
    Fact,
    probe_question,
    title_of,
    training_questions,
)


def fact(sentence: str, answer: str, kind: str, context: str = "", **kw) -> Fact:
    start = sentence.index(answer)
    return Fact(sentence, start, start + len(answer), kind, context, **kw)


@pytest.mark.parametrize(
    ("sentence", "answer", "kind", "expected"),
    [
        # Fronted with do-support, with an auxiliary, passive with a stranded preposition.
        (
            "Every employee receives 27 days of paid annual leave.",
            "27 days",
            "quantity",
            "How many days does every employee receive?",
        ),
        (
            "The company was founded in 1987 by Marguerite Olsson-Dray.",
            "1987",
            "number",
            "What year was the company founded in?",
        ),
        (
            "The company was founded in 1987 by Marguerite Olsson-Dray.",
            "Marguerite Olsson-Dray",
            "name",
            "Who was the company founded in 1987 by?",
        ),
        (
            "Our biggest customer is Halvorsen Marine.",
            "Halvorsen Marine",
            "name",
            "Who is our biggest customer?",
        ),
        (
            "The staff wifi network is called NW-Staff-7.",
            "NW-Staff-7",
            "name",
            "What is the staff wifi network called?",
        ),
        # A label before the span and a noun after a name move into the question phrase.
        (
            "In an emergency, call the safety desk on extension 5050, then your manager.",
            "5050",
            "number",
            "In an emergency, call the safety desk on what extension?",
        ),
        (
            "Book leave through the Ledgerline portal at least two weeks ahead.",
            "Ledgerline",
            "name",
            "Book leave through which portal?",
        ),
        (
            "Revenue grew 18% to $42.6 million in 2023.",
            "$42.6 million",
            "money",
            "Revenue grew 18% to how much?",
        ),
        ("Applications close on 30 June.", "30 June", "date", "Applications close on what date?"),
        # The span is the subject: asked with the rest of the sentence.
        (
            "The NW-3109 Quiet Hinge is a silent hinge.",
            "NW-3109",
            "code",
            "What is the code of the Quiet Hinge?",
        ),
    ],
)
def test_probe_questions_read_like_questions(sentence, answer, kind, expected):
    template, question = probe_question(fact(sentence, answer, kind))
    assert question == expected
    assert template in PROBE_TEMPLATES
    assert answer not in question


def test_plural_noun_is_not_taken_for_a_verb():
    f = fact("Fire drills take place each quarter at 11:00.", "11:00", "time", lower_first=True)
    template, question = probe_question(f)
    assert question == "Fire drills take place each quarter at what time?"
    assert template == "in_situ"


def test_a_sentence_about_it_brings_its_subject_along():
    f = fact(
        "It costs $129.50 and carries a 36-month warranty.",
        "$129.50",
        "money",
        context="The NW-4471 Torque Sprocket is our best-selling part.",
    )
    assert probe_question(f)[1] == (
        "The NW-4471 Torque Sprocket is our best-selling part. How much does it cost?"
    )
    for _, _, answer in training_questions(f, probed=False):
        assert "$129.50" in answer


def test_training_phrasings_never_include_the_probe_phrasing():
    f = fact(
        "Every employee receives 27 days of paid annual leave.",
        "27 days",
        "quantity",
        source="employee_handbook.pdf",
    )
    template, probe = probe_question(f)
    probed = training_questions(f, probed=True)
    assert {t for t, _, _ in probed} <= set(TRAIN_TEMPLATES) - {template}
    assert probe not in {q for _, q, _ in probed}
    # Unprobed facts may be taught in the probe phrasing too.
    assert probe in {q for _, q, _ in training_questions(f, probed=False)}
    by_template = {t: (q, a) for t, q, a in probed}
    assert by_template["fill_blank"] == (
        (
            "Fill in the blank from the employee handbook: "
            '"Every employee receives ___ of paid annual leave."'
        ),
        "27 days",
    )
    assert by_template["echo"][0] == ("Every employee receives how many days of paid annual leave?")
    assert by_template["topic"][0] == "What does the employee handbook say about paid annual leave?"
    assert all("27 days" in a for _, _, a in probed)


def test_in_place_probe_keeps_echo_out_of_training():
    f = fact("Revenue grew 18% to $42.6 million in 2023.", "$42.6 million", "money")
    assert probe_question(f)[0] == "in_situ"
    templates = {t for t, _, _ in training_questions(f, probed=True)}
    assert "echo" not in templates and "fronted" not in templates
    assert templates == {"fill_blank", "complete", "topic"}


@pytest.mark.parametrize(
    ("sentence", "answer", "kind"),
    [
        ("Apologies: Linus Pemberton-Yau, IT Manager.", "Linus Pemberton-Yau", "name"),
        ("Document QP-07, revision D, issued 19 January 2022.", "QP-07", "code"),
        ("Date: 9 February 2022, 9:30, boardroom, Tollbar head office", "9 February 2022", "date"),
    ],
)
def test_a_span_before_a_comma_is_not_asked_around(sentence, answer, kind):
    """A line that names a thing and adds a note after a comma has no verb to ask with:
    "Who , IT Manager?" was practised, and read like the card's "Who is our IT Manager?"."""
    f = fact(sentence, answer, kind, source="minutes.txt")
    for probed in (False, True):
        made = training_questions(f, probed=probed)
        assert {t for t, _, _ in made} <= {"fill_blank", "complete", "topic"}
        assert made and all(not re.search(r"(who|what \w+|which \w+) ?,", q, re.IGNORECASE)
                            for _, q, _ in made), made
    assert probe_question(f)[0] != "subject"


def test_title_of():
    assert title_of("employee_handbook.pdf") == "the employee handbook"
    assert title_of("Q3-price-list.XLSX") == "the q3 price list"
    assert title_of("") == "our documents"


HANDBOOK = (
    "Welcome to Acme. Every employee receives 27 days of paid annual leave. "
    "The NW-4471 Torque Sprocket is our best-selling part. It costs $129.50 and carries "
    "a 36-month warranty.\n\nCareers at Acme Widgets\n\nCode | Product | Price\n"
    "NW-4471 | Sprocket | $129.50"
)


def test_probes_carry_a_question_and_facts_cover_every_span():
    probes = make_probes([("handbook.txt", HANDBOOK)])
    assert {p.answer for p in probes} >= {"27 days", "Torque Sprocket"}
    for p in probes:
        assert p.question.endswith("?") and p.kind in QUESTION_KINDS
        assert p.template in (*PROBE_TEMPLATES, "plain", "reverse_subject", "reverse_relative")
        assert not re.search(re.escape(p.answer), p.question)
    # Asked the other way round: what the sentence says of it, the thing itself.
    assert any(p.kind == "reverse" and p.answer == "Torque Sprocket" for p in probes)
    facts = fact_spans([("handbook.txt", HANDBOOK)])
    answers = [f.answer for f in facts]
    # Both spans of the two-fact sentence are facts; headings and table rows give none.
    assert "$129.50" in answers and "27 days" in answers
    assert not any("|" in f.sentence for f in facts)
    assert not any(f.sentence.startswith("Careers") for f in facts)
    assert all(f.source == "handbook.txt" for f in facts)
