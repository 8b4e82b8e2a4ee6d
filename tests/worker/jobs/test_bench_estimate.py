"""The estimate benchmark's reading of its ETA trace (scripts/bench_estimate.py)."""

from __future__ import annotations

import pytest

from scripts.bench_estimate import _eta_errors


def test_eta_errors_take_the_first_point_at_or_past_each_share_of_training():
    # (seconds since Train, step, time left shown) of a 100-step job whose score card came
    # at 1,000 s.
    trace = [(50.0, 5, 990.0), (100.0, 10, 1080.0), (110.0, 11, 500.0),
             (300.0, 30, 560.0), (520.0, 55, 400.0), (700.0, 80, 300.0)]
    errors = _eta_errors(trace, 100, 1000.0)
    assert errors["10%"] == pytest.approx(1080 / 900 - 1, abs=1e-3)  # step 10, not 11
    assert errors["25%"] == pytest.approx(560 / 700 - 1, abs=1e-3)  # step 30: first past 25
    assert errors["50%"] == pytest.approx(400 / 480 - 1, abs=1e-3)
    assert errors["75%"] == pytest.approx(0.0)
    # Never reached, or read after the job had finished: no figure rather than a wrong one.
    assert _eta_errors(trace[:2], 100, 1000.0).keys() == {"10%"}
    assert _eta_errors([(1200.0, 50, 10.0)], 100, 1000.0) == {}
