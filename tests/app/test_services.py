"""Pure helpers of the services: numbers, durations, the loss chart, score cards, names."""

from __future__ import annotations

import pytest

from app.services.durations import human_duration
from app.services.errors import InvalidInput
from app.services.jobs import format_number, loss_chart, parse_train_form
from app.services.projects import clean_project_name
from app.services.score_card import score_card, score_summary
from app.services.uploads import display_name, human_size, stored_name_for

from .factories import sample_scores


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (-1, "—"),
        (float("nan"), "—"),
        (12, "less than a minute"),
        (170, "about 3 min"),
        (89 * 60, "about 89 min"),
        (2 * 3600, "about 2 h"),
        (2 * 3600 + 15 * 60, "about 2 h 15 min"),
    ],
)
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


def test_format_number():
    assert format_number(2e-4) == "0.0002"
    assert format_number(2e-5) == "0.00002"
    assert format_number(1e-6) == "0.000001"
    assert format_number(0.01) == "0.01"
    assert format_number(16) == "16"


def test_parse_train_form_keeps_defaults_for_empty_fields():
    assert parse_train_form({}) == ("lora", {})
    assert parse_train_form({"method": " FULL ", "epochs": " 4 ", "learning_rate": "1e-5"}) == (
        "full",
        {"epochs": 4, "learning_rate": 1e-5},
    )
    with pytest.raises(InvalidInput) as exc:
        parse_train_form({"epochs": "100", "lora_rank": "abc", "max_seq_len": "inf"})
    assert set(exc.value.errors) == {"epochs", "lora_rank", "max_seq_len"}


def test_loss_chart_scales_into_the_plot_area():
    assert loss_chart(None) is None
    assert loss_chart([[1, float("nan")]]) is None
    chart = loss_chart([[0, 2.0], [50, 1.0], [100, 1.5]], total_steps=200)
    xs = [float(p.split(",")[0]) for p in chart.points.split()]
    ys = [float(p.split(",")[1]) for p in chart.points.split()]
    assert xs[0] == chart.left and xs[1] == pytest.approx(
        chart.left + (chart.right - chart.left) / 4
    )
    assert ys == [chart.top, chart.bottom, (chart.top + chart.bottom) / 2]
    assert (chart.first, chart.last, chart.low, chart.high, chart.total_steps) == (
        2.0,
        1.5,
        1.0,
        2.0,
        200,
    )
    flat = loss_chart([[5, 1.0]])  # one point, no range: still drawable
    assert flat is not None and len(flat.points.split()) == 1


def test_loss_chart_thins_long_histories():
    chart = loss_chart([[i, 1.0 / (i + 1)] for i in range(5000)])
    n = len(chart.points.split())
    assert 300 < n <= 601
    assert chart.last == pytest.approx(1 / 5000)  # the latest value is always drawn


def test_score_card_from_worker_scores():
    card = score_card(sample_scores(n_probes=10, before_hits=1, after_hits=6))
    assert (card.recall_before.pct, card.recall_after.pct) == (10.0, 60.0)
    assert (card.perplexity_before, card.perplexity_after) == (41.7, 12.3)
    assert card.n_probes == 10 and len(card.probes) == 8
    assert card.probes[0].tuned_hit and not card.probes[0].base_hit  # learned facts first
    assert card.qa_n == 5 and card.qa_f1_after == 0.62
    assert score_summary(sample_scores()) == "Recall 10% → 60%"


def test_score_card_tolerates_missing_parts():
    assert score_card(None) is None and score_card({"before": {}}) is None
    card = score_card({"after": {"perplexity": None, "n_probes": 0, "recall": None}})
    assert card.recall_after.pct is None and card.perplexity_after is None and card.qa_n == 0
    assert score_summary({"after": {"n_probes": 0}}) is None


@pytest.mark.parametrize(
    ("original", "shown"),
    [
        ("report.pdf", "report.pdf"),
        ("../../x.txt", "x.txt"),
        ("C:\\Users\\me\\a.docx", "a.docx"),
        ("a\x00b\tc.txt", "abc.txt"),
        ("x\u202etxt.exe", "xtxt.exe"),
        ("", "(unnamed file)"),
        ("dir/", "(unnamed file)"),
        ("  spaced   name .md ", "spaced name .md"),
    ],
)
def test_display_name(original, shown):
    assert display_name(original) == shown


def test_stored_names_are_generated_with_a_safe_extension():
    a, b = stored_name_for("txt", "Notes.TXT"), stored_name_for("txt", "Notes.TXT")
    assert a != b and a.endswith(".txt") and len(a) == 36
    assert stored_name_for("md", "x.markdown").endswith(".markdown")


def test_human_size():
    assert human_size(0) == "0 bytes"
    assert human_size(1536) == "1.5 KB"
    assert human_size(200 * 1024 * 1024) == "200.0 MB"


def test_clean_project_name():
    assert clean_project_name("  a \n b ") == "a b"
    with pytest.raises(InvalidInput):
        clean_project_name("")
