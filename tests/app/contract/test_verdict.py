"""The verdict in words, for each kind of outcome a job can have."""

from __future__ import annotations

import pytest

from app.contract.scores import forgetting, headline_recall
from app.contract.verdict import FORGETTING_RISE, verdict


def side(hits: int, n: int = 40, general: float | None = 20.0, ppl: float = 30.0, **kw) -> dict:
    return {
        "perplexity": ppl,
        "n_probes": n,
        "n_recalled": max(0, hits - 1),  # completions: a different count than questions
        "questions": {"n": n, "n_recalled": hits, "recall": hits / n if n else None},
        "general": {"perplexity": general} if general is not None else None,
        **kw,
    }


PARAMS = {"method": "lora", "epochs": 8, "learning_rate": 2e-4}


def test_learned_and_safe():
    v = verdict(side(0), side(31), PARAMS)
    assert v.headline == "Learned 31 of 40 facts (was 0). Safe to use."
    assert v.level == "good" and v.ok
    assert any("31 of 40 questions about your documents" in d for d in v.details)
    assert any("no sign of forgetting" in d for d in v.details)


def test_barely_changed():
    v = verdict(side(0), side(1), PARAMS)
    assert v.headline == "Barely changed: add more documents or train longer."
    assert v.level == "barely" and not v.ok
    assert "Train longer (for example 16 epochs instead of 8)." in v.advice
    assert any("question-answer pairs" in a for a in v.advice)
    assert any("raise the learning rate (for example to 0.0005)" in a for a in v.advice)


def test_a_small_gain_on_many_probes_is_still_barely():
    assert verdict(side(0, n=100), side(9, n=100)).level == "barely"  # under 10%
    assert verdict(side(0, n=100), side(10, n=100)).level == "partial"


def test_partly_learned():
    v = verdict(side(1), side(12), PARAMS)
    assert v.level == "partial"
    assert v.headline.startswith("Learned 12 of 40 facts (was 1). Partly learned")


def test_forgetting_is_flagged_in_words():
    v = verdict(side(0, general=20.0), side(30, general=20.0 * (1 + FORGETTING_RISE) + 1), PARAMS)
    assert v.level == "forgetting" and not v.ok
    assert v.headline == (
        "Learned 30 of 40 facts (was 0), but the model got worse at general English; "
        "try fewer epochs."
    )
    assert any("for example 4 instead of 8" in a for a in v.advice)
    assert any("got worse at ordinary text" in d for d in v.details)


def test_worse_than_before():
    v = verdict(side(20), side(5), PARAMS)
    assert v.level == "worse"
    assert v.headline == "Got worse: recalls 5 facts of 40, down from 20. Do not use it."
    assert any("lower learning rate (for example 0.0001)" in a for a in v.advice)


def test_no_facts_says_why_recall_was_not_measured():
    v = verdict(side(0, n=0), side(0, n=0), PARAMS)
    assert v.level == "unmeasured"
    assert "recall could not be measured" in v.headline
    assert "no sentence in the documents states a distinctive fact" in v.details[0]
    assert any("question-answer pairs" in a for a in v.advice)


def test_old_scores_without_questions_use_the_completions():
    before = {"n_probes": 10, "n_recalled": 1, "perplexity": 40.0}
    after = {"n_probes": 10, "n_recalled": 8, "perplexity": 12.0}
    fig = headline_recall(before, after)
    assert (fig.kind, fig.n, fig.before, fig.after) == ("completion", 10, 1, 8)
    v = verdict(before, after)
    assert v.headline == "Learned 8 of 10 facts (was 1). Safe to use."
    assert forgetting(before, after) is None  # no general sample: nothing claimed
    assert not any("General English" in d for d in v.details)


def test_overfitting_and_own_questions_are_reported():
    before = side(0, ppl=20.0, qa={"n": 4, "f1": 0.1, "exact": 0.0})
    after = side(25, ppl=45.0, qa={"n": 4, "f1": 0.55, "exact": 0.5})
    v = verdict(before, after)
    assert any("rose from 20.0 to 45.0" in d for d in v.details)
    assert any("word overlap 10% → 55% (4 questions)" in d for d in v.details)
    assert any("fewer epochs" in a for a in v.advice)


@pytest.mark.parametrize("scores", [None, {}, {"questions": None}])
def test_missing_parts_do_not_crash(scores):
    assert verdict(scores, scores).level == "unmeasured"
