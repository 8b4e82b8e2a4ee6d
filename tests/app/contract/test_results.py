"""A finished job's results besides its scores: one column each, checked by the worker."""

from __future__ import annotations

import pytest

from app.contract.artifacts import KINDS
from app.contract.results import JobResults, dataset_notes, export_errors

from ..test_score_card import full_scores

METRICS = {"train_seconds": 2.5, "tokens_per_s": 900.0, "final_loss": 1.5, "steps": 4,
           "tokens": 4096}  # fmt: skip


def _pipeline_result(**extra) -> dict:
    """Shaped as worker.jobs.pipeline.run_pipeline returns it."""
    return {
        "params": {"method": "lora"},
        "dataset": {"n_train_examples": 12, "n_probes": 10, "notes": ["10 recall probes."]},
        "scores": full_scores(),
        "artifacts": {"adapter": "/data/jobs/1/exports/adapter.zip"},
        "export_errors": {"gguf-q8_0": "The GGUF file (q8_0) could not be made: no space."},
        "metrics": METRICS,
    } | extra


def test_each_part_goes_to_its_own_column_unchanged():
    result = _pipeline_result()
    record = JobResults.from_pipeline(result)
    assert record.scores == result["scores"] and set(record.scores) == {"before", "after"}
    assert record.dataset == result["dataset"] and record.metrics == METRICS
    assert record.export_errors == result["export_errors"]
    assert dataset_notes(record.dataset) == ["10 recall probes."]
    assert dataset_notes(None) == [] and export_errors(None) == {}


@pytest.mark.parametrize(
    "extra",
    [
        {"export_errors": {"gguf-q4": "no such download"}},
        {"metrics": METRICS | {"wall_seconds": 3.0}},
        {"scores": full_scores() | {"metrics": METRICS}},  # the old place: not a score
        {"dataset": {"notes": "one note"}},
    ],
)
def test_a_part_of_another_shape_is_refused(extra):
    with pytest.raises(ValueError):
        JobResults.from_pipeline(_pipeline_result(**extra))


def test_the_page_lists_every_kind_the_worker_makes():
    from app.services.jobs import ARTIFACT_HINTS, ARTIFACT_LABELS
    from worker.export.writers import KINDS as WRITTEN

    assert WRITTEN is KINDS
    assert set(ARTIFACT_LABELS) == set(ARTIFACT_HINTS) == set(KINDS)
