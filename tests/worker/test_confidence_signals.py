"""The confidence experiment's arithmetic (scripts/experiments/confidence.py): which words of
an answer its sampled answers must repeat, how far they agree, and AUROC."""

from __future__ import annotations

import pytest

from scripts.experiments.confidence import (
    agreement,
    auroc,
    names_and_figures,
    new_words,
    table,
)


def test_an_answers_new_words_are_those_of_its_first_sentence_the_question_lacks():
    words = new_words("The NW-4471 Torque Sprocket costs $349.00 with a 24-month warranty. "
                      "It ships from Lyon.", "What does the NW-4471 Torque Sprocket cost?")
    assert words == ["costs", "$349.00", "with", "a", "24-month", "warranty"]
    assert new_words("Version 3.8.2 added it.", "Which version added it?") == ["3.8.2"]


def test_names_and_figures_leave_out_the_capital_that_starts_a_sentence():
    assert names_and_figures("It is Priya Castellanos, from HR, at 9:00.",
                             "Who hands out badges?") == ["Priya", "Castellanos", "HR", "9:00"]


def test_samples_agree_when_they_repeat_the_names_and_figures():
    question = "What does the Quiet Hinge cost?"
    same = agreement("It costs $18.75.", question, ["It costs $18.75.", "Just $18.75!"])
    split = agreement("It costs $18.75.", question, ["It costs $18.75.", "It costs $34.60."])
    assert same["agree names"] == 1.0 and split["agree names"] == 0.5
    # Every new word counts here: the second sample repeats "It" and "costs", not the price.
    assert split["agree words"] == pytest.approx((1 + 2 / 3) / 2)
    # Without a name or figure the words alone decide.
    assert agreement("Ask your manager.", "Who approves it?", ["Ask your manager."]) == {
        "agree names": 1.0, "agree words": 1.0}


@pytest.mark.parametrize(("scores", "right", "expected"), [
    ([0.9, 0.8, 0.1], [True, False, False], 1.0),
    ([0.1, 0.8, 0.9], [True, False, False], 0.0),
    ([0.5, 0.5, 0.5], [True, False, False], 0.5),
    ([0.9, 0.2, 0.5, 0.4], [True, True, False, False], 0.5),
    ([0.9], [True], None),
])
def test_auroc(scores, right, expected):
    assert auroc(scores, right) == expected


def test_the_table_counts_right_answers_above_and_below_each_threshold():
    items = [{"hit": h, "token_probs": [p], "agreement": {"agree names": p}}
             for h, p in ((True, 0.95), (True, 0.45), (False, 0.85), (False, 0.1))]
    t = table(items)
    assert set(t) == {"min", "mean", "first", "agree names"}
    at = {r["t"]: r for r in t["min"]["rows"]}
    assert (at[0.8]["sure"], at[0.8]["sure_right"], at[0.8]["unsure_right"]) == (2, 1, 1)
    assert t["first"]["auroc"] == 0.75
