"""What a finished job records besides its scores, each in a column of its own: the
training set built from the documents (`Job.dataset`), the training run's figures
(`Job.metrics`) and the downloads that could not be made (`Job.export_errors`).

The worker builds a `JobResults` from the pipeline's result when it writes the row
(worker/jobs/run.py); the web app and the CLI read the columns through the same models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.contract.artifacts import KINDS
from app.contract.scores import checked_scores


class DatasetStats(BaseModel):
    """worker.dataset's counts (n_train_examples, n_heldout_chunks, n_probes, ...) and its
    notes in words. The counts are open-ended: the model card lists whatever is there."""

    model_config = ConfigDict(extra="allow", frozen=True)

    notes: list[str] = Field(default_factory=list)


class TrainingMetrics(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    train_seconds: float | None = None
    tokens_per_s: float | None = None
    final_loss: float | None = None
    steps: int = 0
    tokens: int = 0
    # Wall seconds of each phase of the job: "before" (scoring the base model), "train",
    # "after" (scoring the tuned model), "export"; what the next estimates learn from.
    phase_s: dict[str, float] = Field(default_factory=dict)


class ExportErrors(BaseModel):
    """kind (app.contract.artifacts) -> why that download could not be made, in words."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    errors: dict[str, str] = Field(default_factory=dict)

    @field_validator("errors")
    @classmethod
    def _known_kinds(cls, errors: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(errors) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown download kinds {unknown}; the kinds are {KINDS}")
        return errors


def dataset_notes(dataset: Mapping[str, Any] | None) -> list[str]:
    """The notes of `Job.dataset` (none for a job that has not finished)."""
    return DatasetStats.model_validate(dict(dataset or {})).notes


def export_errors(raw: Mapping[str, Any] | None) -> dict[str, str]:
    """`Job.export_errors`, checked (none for a job that has not finished)."""
    return ExportErrors(errors=dict(raw or {})).errors


@dataclass(frozen=True)
class JobResults:
    """The four JSON columns a finished job's row gets, each checked against its shape."""

    scores: dict[str, Any]
    dataset: dict[str, Any]
    metrics: dict[str, Any]
    export_errors: dict[str, str]

    @classmethod
    def from_pipeline(cls, result: Mapping[str, Any]) -> JobResults:
        """From worker.jobs.pipeline.run_pipeline's result; ValueError when a part does not
        have its shape. The values are kept as the pipeline wrote them."""
        dataset = dict(result.get("dataset") or {})
        metrics = dict(result.get("metrics") or {})
        DatasetStats.model_validate(dataset)
        TrainingMetrics.model_validate(metrics)
        return cls(
            scores=checked_scores(result["scores"]),
            dataset=dataset,
            metrics=metrics,
            export_errors=export_errors(result.get("export_errors")),
        )
