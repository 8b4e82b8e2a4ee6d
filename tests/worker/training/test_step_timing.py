"""The timed run's arithmetic (worker/training/step_timing.py): the fit of a step's time to
its shape, and how one shape's time is taken from a few noisy tries. The timed run itself,
through the offload engine with a real model, is tested by the worker
(tests/worker/test_tasks.py: the machine profile)."""

from __future__ import annotations

import time

import pytest

from worker.training.flops import step_flops
from worker.training.step_timing import fit_step_time, steady_seconds

FLOPS = (3e8, 1e6)  # (linear, attention) per token, about a 135M model's LoRA step
SHAPES = [(4, 64), (4, 128), (4, 256)]


def _exact(rows: int, width: int, fixed: float = 0.4, per_flop: float = 2e-11) -> float:
    return fixed + per_flop * step_flops(FLOPS, rows, width)


def test_a_consistent_run_is_fitted_exactly():
    measured = [(r, w, _exact(r, w)) for r, w in SHAPES]
    fixed, per_flop = fit_step_time(measured, FLOPS)
    assert fixed == pytest.approx(0.4) and per_flop == pytest.approx(2e-11)


def test_a_slow_long_shape_does_not_drag_the_short_ones():
    # The 4x256 step timed 20% slow: by least squares of the relative error the short shapes,
    # most of a job's steps, stay within 10% (plain least squares: 4x64 off by 13%). A far
    # slower try is steady_seconds' to catch (below).
    measured = [(r, w, _exact(r, w) * (1.2 if w == 256 else 1.0)) for r, w in SHAPES]
    fixed, per_flop = fit_step_time(measured, FLOPS)
    for rows, width in [(4, 64), (4, 100), (4, 128)]:
        predicted = fixed + per_flop * step_flops(FLOPS, rows, width)
        assert predicted == pytest.approx(_exact(rows, width), rel=0.10)


def test_one_point_or_a_negative_part_scales_everything_with_the_work():
    fixed, per_flop = fit_step_time([(4, 128, 2.0)], FLOPS)
    assert fixed == 0.0 and per_flop == pytest.approx(2.0 / step_flops(FLOPS, 4, 128))
    # Longer steps timed faster than short ones: no sensible line; the mean rate.
    measured = [(4, 64, 3.0), (4, 256, 1.0)]
    fixed, per_flop = fit_step_time(measured, FLOPS)
    assert fixed == 0.0 and per_flop == pytest.approx(4.0 / sum(step_flops(FLOPS, r, w)
                                                               for r, w, _ in measured))


def _scripted(seconds: list[float]):
    calls = []

    def step() -> None:
        time.sleep(seconds[len(calls)])
        calls.append(1)

    return step, calls


def test_the_fastest_of_two_tries_and_the_middle_of_three_when_they_disagree():
    step, calls = _scripted([0.05, 0.055])
    assert 0.045 <= steady_seconds(step, 2) < 0.09 and len(calls) == 2
    # One try far slower than the other: a third decides, and the middle one is kept.
    step, calls = _scripted([0.4, 0.05, 0.06])
    taken = steady_seconds(step, 2)
    assert len(calls) == 3 and 0.055 <= taken < 0.3
    step, calls = _scripted([0.05])
    assert steady_seconds(step, 1) >= 0.045 and len(calls) == 1


def test_the_output_layer_is_charged_only_where_a_label_is_predicted():
    head = 1e8  # of FLOPS' linear part
    whole = step_flops(FLOPS, 4, 64)
    assert step_flops(FLOPS, 4, 64, None, head) == whole  # the timed run: every position
    # 4 practice questions of 64 tokens, 40 positions predicting their answers: the output
    # layer skips the other 216.
    assert step_flops(FLOPS, 4, 64, 40, head) == pytest.approx(whole - 216 * head)
    assert step_flops(FLOPS, 4, 64, 4 * 64, head) == pytest.approx(whole)
