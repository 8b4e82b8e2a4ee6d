"""The dataset plan: the training work a project's documents make, counted by the worker with
the very code that builds a job's dataset (worker/jobs/dataset_plan.py), kept on the project
row (Project.dataset_plan) and read by the Train panel's estimate (app/services/planner.py).

It says how many examples of each kind the job trains on and, step by step, the padded shape
of each batch (a batch is padded to its longest example, and batches are grouped by length),
so the estimate multiplies a measured time per step shape by the real steps instead of
guessing examples per word. The plan is filed under a key over everything that changes it:
the base model (its tokenizer), the documents (id and content hash) and the settings that
shape the dataset. A plan of another key or format is stale.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

# Raise it when the plan's meaning changes (the dataset code counts differently).
FORMAT = 5  # 2: predicting; 3: who holds which job practised (worker/dataset/roles.py);
# 4: and in question-answer pairs' answers; 5: the passes set from the dataset's tokens
# The job settings the dataset and its batches depend on (app.contract.training names them;
# batch size and grouping are the recipe's fixed defaults).
PLAN_PARAMS = ("max_seq_len", "generated_qa", "replay", "epochs", "seed", "holdout_frac",
               "max_probes", "auto")


def plan_key(base_model: str, docs: Iterable[tuple[int, str]], params: Mapping[str, Any]) -> str:
    """The key a plan of `docs` ((document id, content sha256) each) under `params` is filed
    under, for the configured `base_model`."""
    body = {
        "format": FORMAT,
        "base_model": base_model,
        "docs": sorted([int(i), str(s)] for i, s in docs),
        "params": {k: params.get(k) for k in PLAN_PARAMS},
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class DatasetPlan(BaseModel):
    """What a plan holds (the worker writes it with model_dump(), the app validates it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int
    key: str
    examples: int  # training examples, of which:
    chunks: int  # document text
    qa: int  # the documents' own question-answer pairs
    practice: int  # practice questions made from the facts
    replay: int  # the base model's everyday answers
    probes: int  # facts checked, as completions
    questions: int  # of them asked as questions too
    heldout_chunks: int  # text held out: its perplexity is scored
    heldout_qa: int  # the documents' pairs held out: answered when scoring
    epochs: int
    steps: int
    tokens: int  # real (unpadded) tokens over all steps
    # of one pass over the dataset, without the replay answers: what the passes are set from
    # (app.contract.training.settle)
    train_tokens: int
    # (rows, padded width, number of steps of that shape) over all steps
    shapes: list[tuple[int, int, int]] = Field(default_factory=list)
    # per shape (same order): its steps' positions whose next token is a label, summed; the
    # output layer runs only at those (worker/training/engines.lm_loss_sum)
    predicting: list[int] = Field(default_factory=list)
    seconds: float = 0.0  # how long counting took


def checked_plan(data: Any, key: str | None = None) -> DatasetPlan | None:
    """`data` as a plan of this format (and of `key` when given), else None."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        return None
    try:
        plan = DatasetPlan.model_validate(dict(data))
    except ValueError:
        return None
    return plan if key is None or plan.key == key else None
