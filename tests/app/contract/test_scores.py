"""The scores' schema: what the worker may write into Job.scores and how every reader sees it."""

from __future__ import annotations

import copy

import pytest

from app.contract.scores import (
    OWN_WORDS_ODDS,
    QUESTION_KINDS,
    Questions,
    Side,
    as_side,
    checked_scores,
    colleague_share,
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


def _asked(tally: dict[str, tuple[int, int]]) -> Questions:
    return Questions.model_validate({"items": [
        {"question": f"{kind} {i}?", "kind": kind, "hit": i < hits}
        for kind, (hits, n) in tally.items() for i in range(n)
    ]})


def test_what_a_colleague_would_see_counts_the_documents_terms_at_lower_odds():
    # Forward questions alone: their share right at colleagues' odds; none or all stay so.
    assert OWN_WORDS_ODDS == 0.5
    for hits, expected in ((0, 0.0), (6, 3 / 7), (9, 9 / 11), (10, 1.0)):
        share = colleague_share(_asked({"other words": (hits, 10)}))
        assert share == pytest.approx(expected)
    odds = lambda p: p / (1 - p)
    assert odds(colleague_share(_asked({"other words": (6, 10)}))) == pytest.approx(
        OWN_WORDS_ODDS * odds(0.6))
    # Reverse and table questions count as answered; each question once (the card's mix).
    tally = {"other words": (6, 9), "reverse": (3, 8), "table": (1, 12)}
    forward = (6 / 9) * OWN_WORDS_ODDS / (1 - 6 / 9 + (6 / 9) * OWN_WORDS_ODDS)
    assert colleague_share(_asked(tally)) == pytest.approx((9 * forward + 3 + 1) / 29)
    assert colleague_share(_asked({"reverse": (3, 8), "table": (1, 12)})) == pytest.approx(4 / 20)
    # Older jobs' questions carry no kind: no estimate.
    assert colleague_share(Questions.model_validate({"items": [{"question": "Q?", "hit": True}]})) is None
    assert colleague_share(Questions()) is None


def test_the_headline_carries_what_a_colleague_would_see_before_and_after():
    scores = parse_scores(with_kinds(full_scores(before_hits=1, after_hits=5), KINDS))
    recall = headline_recall(scores.before, scores.after)
    assert (recall.after, recall.n, recall.rate_after) == (5, 10, 0.5)
    # After: table 3 of 3, forward 2 of 4 (at the odds: a third), reverse 0 of 3; before:
    # table 1 of 3 only.
    assert recall.colleague_after == pytest.approx((3 + 4 / 3) / 10)
    assert recall.colleague_before == pytest.approx(1 / 10)
    assert recall.likely_after == recall.colleague_after
    # Without kinds the headline is the share right, as before.
    plain = parse_scores(full_scores(after_hits=5))
    recall = headline_recall(plain.before, plain.after)
    assert recall.colleague_after is None and recall.likely_after == 0.5
