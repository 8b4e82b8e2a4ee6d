"""Scoring does not fail a reply for how it writes a value (worker.dataset.answer_forms):
"seven years" is "7 years", "£7,895" gives "7895", "09:30" gives "9:30", "a 36-month
warranty" gives "36 months". And it still refuses what is another value."""

from __future__ import annotations

import pytest

from worker.dataset.answer_forms import value_form
from worker.dataset.probes import gives_answer


@pytest.mark.parametrize(
    ("text", "form"),
    [
        ("seven years", "7 year"),
        ("twenty-six days", "26 day"),
        ("a 36-month warranty, 36 months, 1 year", "a 36 month warranty, 36 month, 1 year"),
        ("a two-day course, 1.5 hours", "a 2 day course, 1.5 hour"),
        ("forty two", "42"),
        ("no one came, one did", "no one came, 1 did"),
        ("£7,895 and 1,850", "£7895 and 1850"),
        ("at 09:30, not 19:30", "at 9:30, not 19:30"),
        ("by 7:45am, 32kg, 43p", "by 7:45 am, 32 kg, 43 p"),
        ("on the 9th, code c118, sg-2041", "on the 9, code c118, sg-2041"),
        ("march 9, 2022 and may 1", "9 march 2022 and 1 may"),
        ("march 2022", "march 2022"),
    ],
)
def test_a_value_is_written_one_way(text, form):
    assert value_form(text) == form


@pytest.mark.parametrize(
    ("output", "answer"),
    [
        ("We keep them for 7 years.", "seven years"),
        ("Seven years.", "7 years"),
        ("It lists at £7,895.", "7895"),
        ("The showroom is staffed from 09:30.", "9:30"),
        ("Phone by 7:45am.", "7:45"),
        ("Anything over 32kg.", "32 kg"),
        ("It is on March 9, 2022.", "9 March 2022"),
        ("It is on the 9th March 2022.", "9 March 2022"),
        ("Full-time staff get twenty-six days.", "26 days"),
        ("3720 visits", "3,720"),
        ("One in 20 units.", "1 in 20"),
        ("twenty per cent", "20%"),
        ("It has a 36-month warranty.", "36 months"),
        ("A two-day course.", "2 days"),
        ("Within 30 days.", "30-day"),
        ("It takes 10-15 minutes.", "15 minutes"),  # the end of a range, as before
    ],
)
def test_a_value_written_another_way_is_given(output, answer):
    assert gives_answer(output, answer)


@pytest.mark.parametrize(
    ("output", "answer"),
    [
        ("fifty weeks", "five weeks"),
        ("15 weeks", "5 weeks"),
        ("We made 1,850 of them.", "850"),
        ("It costs £1,255.", "255"),
        ("Open until 19:30.", "9:30"),
        ("43 pence", "43p"),
        ("£640k", "£640,000"),
        ("six months", "6%"),
        ("No one knows.", "1 in 20"),
        ("a 24-hour delivery", "€24"),
        ("a 36-month warranty", "6 months"),
        ("3 months", "3 years"),
    ],
)
def test_another_value_is_still_not_given(output, answer):
    assert not gives_answer(output, answer)
