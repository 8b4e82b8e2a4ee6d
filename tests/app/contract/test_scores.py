"""The scores' schema: what the worker may write into Job.scores and how every reader sees it."""

from __future__ import annotations

import copy

import pytest

from app.contract.scores import (
    QUESTION_KINDS,
    Questions,
    Side,
    as_side,
    checked_scores,
    headline_kind,
    headline_recall,
    kind_counts,
    kind_figures,
    parse_scores,
)

from ..test_score_card import full_scores, with_kinds, with_previous


def test_scores_as_the_worker_writes_them_pass_unchanged():
    raw = with_previous(full_scores())
    kept = copy.deepcopy(raw)
    assert checked_scores(raw) == kept  # the row gets exactly what the pipeline returned
    scores = parse_scores(raw)
    assert scores.after.questions.items[0].sentence == "Model X0 has a warranty of 20 months."
    assert scores.after.probes[0].prompt == "Model X0 has a warranty of"
    assert scores.after.qa.items[0].contains is True and scores.after.general.n_paragraphs == 6
    assert scores.previous.questions.n_recalled == 4


@pytest.mark.parametrize(
    "bad",
    [
        {"after": {"perplexity": 1.0, "employee": {}}},  # an unknown figure
        {"before": {}, "after": {}, "dataset": {"notes": []}},  # not a score: Job.dataset
        {"after": {"n_probes": "many"}},
        {"after": {"questions": {"items": [{"question": "Q?", "hit": "sometimes"}]}}},
        {"after": {"questions": {"items": [{"question": "Q?", "kind": "as written"}]}}},
    ],
)
def test_other_shapes_are_refused(bad):
    with pytest.raises(ValueError):
        checked_scores(bad)


def test_missing_or_null_parts_read_as_nothing_measured():
    side = as_side({"perplexity": None, "questions": None, "general": None, "qa": None})
    assert side.measured and not as_side({}).measured and not as_side(None).measured
    assert (side.questions.n, side.general.perplexity, side.qa.n, side.probes) == (0, None, 0, [])
    assert parse_scores(None).after is None and parse_scores({"before": None}).before == Side()


def test_older_rows_with_only_a_recall_rate_count_their_hits():
    side = as_side({"n_probes": 10, "recall": 0.3})
    assert side.completion_counts() == (10, 3)
    assert as_side({"n_probes": 10, "n_recalled": 4, "recall": 0.9}).completion_counts() == (10, 4)


def test_the_headline_is_the_questions_when_measured_else_the_completions():
    scores = parse_scores(full_scores(after_hits=6))
    assert headline_kind(scores.after) == "questions"
    fig = headline_recall(scores.before, scores.after)
    assert (fig.kind, fig.n, fig.before, fig.after, fig.gain) == ("questions", 10, 0, 6, 6)
    without = full_scores(after_hits=6)
    for side in ("before", "after"):
        del without[side]["questions"]
    fig = headline_recall(without["before"], without["after"])
    assert (fig.kind, fig.n, fig.after) == ("completion", 10, 3)  # hits // 2 completions


def test_question_kinds_are_the_three_the_worker_records_in_the_cards_order():
    assert list(QUESTION_KINDS) == ["other words", "reverse", "table"]
    assert QUESTION_KINDS["reverse"] == "asked the other way round"


def test_older_question_items_without_a_kind_still_parse():
    old = full_scores()  # items as older jobs wrote them: no "kind" key
    assert "kind" not in old["after"]["questions"]["items"][0]
    assert checked_scores(old) == old
    scores = parse_scores(old)
    assert {q.kind for q in scores.after.questions.items} == {""}
    assert kind_counts(scores.after.questions) == {}
    assert kind_figures(scores.before, scores.after) == []
    null_kind = as_side({"questions": {"items": [{"question": "Q?", "kind": None}]}})
    assert null_kind.questions.items[0].kind == ""


def test_kind_counts_tally_hits_and_questions_per_kind_in_the_cards_order():
    items = [
        {"question": "Q1?", "kind": "table", "hit": True},
        {"question": "Q2?", "kind": "other words", "hit": False},
        {"question": "Q3?", "kind": "table", "hit": False},
        {"question": "Q4?", "kind": "other words", "hit": True},
        {"question": "Q5?", "kind": "other words", "hit": True},
        {"question": "Q6?", "kind": "", "hit": True},  # no kind: left out
    ]
    counts = kind_counts(Questions.model_validate({"items": items}))
    assert counts == {"other words": (2, 3), "table": (1, 2)}  # no "reverse": none asked
    assert list(counts) == ["other words", "table"]


# 10 questions; the first `hits` are answered right (full_scores), so after 5 hits: table
# 3 of 3, other words 2 of 4, reverse 0 of 3.
KINDS = ["table"] * 3 + ["other words"] * 4 + ["reverse"] * 3


def test_kind_figures_count_the_same_questions_before_and_after():
    scores = parse_scores(with_kinds(full_scores(before_hits=1, after_hits=5), KINDS))
    figures = kind_figures(scores.before, scores.after)
    assert [(k.kind, k.n, k.before, k.after) for k in figures] == [
        ("other words", 4, 0, 2),
        ("reverse", 3, 0, 0),
        ("table", 3, 1, 3),  # question 0, right before training too
    ]
    assert figures[2].words == "looked up in a table" and figures[2].rate_after == 1.0

    # Items before training without kinds: counted under the kind each has after training.
    raw = with_kinds(full_scores(before_hits=1, after_hits=5), KINDS)
    for item in raw["before"]["questions"]["items"]:
        del item["kind"]
    figures = kind_figures(raw["before"], raw["after"])
    assert [k.before for k in figures] == [0, 0, 1]

    # No items before training: 0 hits reads as 0 per kind, some hits cannot be told apart.
    raw["before"]["questions"]["items"] = []
    raw["before"]["questions"]["n_recalled"] = 0
    assert [k.before for k in kind_figures(raw["before"], raw["after"])] == [0, 0, 0]
    raw["before"]["questions"]["n_recalled"] = 1
    assert [k.before for k in kind_figures(raw["before"], raw["after"])] == [None] * 3
