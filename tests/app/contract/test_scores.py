"""The scores' schema: what the worker may write into Job.scores and how every reader sees it."""

from __future__ import annotations

import copy

import pytest

from app.contract.scores import (
    Side,
    as_side,
    checked_scores,
    headline_kind,
    headline_recall,
    parse_scores,
)

from ..test_score_card import full_scores, with_previous


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
