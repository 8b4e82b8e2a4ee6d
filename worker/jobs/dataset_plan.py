"""Count a job's training work without loading the model: the dataset the job would build
(worker.jobs.pipeline's own job_settings and job_dataset, so the same chunks, practice
questions and hold-out) and, step by step, the padded shape of each batch as the recipe
makes them (worker.training.batches.step_members, grouped by length), with the positions
of each that predict a label (the output layer runs only there). Only the tokenizer is
loaded. The result is app.contract.dataset_plan's shape, kept on the project row for the
Train panel's estimate (app/services/planner.py).

The replay answers (the base model's own, made at the start of a job) are counted at their
longest, since the model has not written them yet.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from app.contract.dataset_plan import FORMAT, DatasetPlan, plan_key
from worker.dataset.corpus import SourceDoc
from worker.jobs.pipeline import job_dataset, job_settings, settled_job, train_tokens
from worker.training.batches import predicting_count, step_members
from worker.training.replay import planned_lengths, planned_predicting

log = logging.getLogger(__name__)


def count_work(docs: list[SourceDoc], tokenizer, params: Mapping[str, Any], key: str) -> DatasetPlan:
    """The plan of a job on `docs` with `params` (as the Train button would queue it)."""
    started = time.perf_counter()
    job = job_settings(docs, dict(params), "", None, None)
    split = job_dataset(docs, tokenizer, job)
    job = settled_job(job, split)
    cfg = job.config
    lengths = [min(len(e["input_ids"]), cfg.max_seq_len) for e in split.train_examples]
    predicting = [predicting_count(e, cfg.max_seq_len) for e in split.train_examples]
    replay = planned_lengths(tokenizer, job.replay_n, cfg.max_seq_len) if job.replay_n else []
    lengths += replay
    if job.replay_n:
        predicting += planned_predicting(tokenizer, job.replay_n, cfg.max_seq_len)
    per_step = cfg.batch_size * cfg.grad_accum
    steps_per_epoch = cfg.steps_per_epoch(len(lengths))
    total = cfg.total_steps(len(lengths))
    shapes: Counter[tuple[int, int]] = Counter()
    predicts: Counter[tuple[int, int]] = Counter()  # positions predicting a label, by shape
    tokens = 0
    for batch in step_members(lengths, cfg.seed, per_step, cfg.group_by_length,
                              steps_per_epoch, total):
        shape = (len(batch), max(lengths[i] for i in batch))
        shapes[shape] += 1
        predicts[shape] += sum(predicting[i] for i in batch)
        tokens += sum(lengths[i] for i in batch)
    stats = split.stats
    return DatasetPlan(
        format=FORMAT,
        key=key,
        examples=len(lengths),
        chunks=int(stats["n_train_chunks"]),
        qa=int(stats["n_train_qa"]),
        practice=int(stats["n_train_generated_qa"]),
        replay=len(replay),
        probes=int(stats["n_probes"]),
        questions=sum(1 for p in split.probes if p.question),
        heldout_chunks=len(split.heldout_chunks),
        heldout_qa=len(split.heldout_qa),
        epochs=cfg.epochs,
        steps=total,
        tokens=tokens,
        train_tokens=train_tokens(split, cfg.max_seq_len),
        shapes=sorted((rows, width, n) for (rows, width), n in shapes.items()),
        predicting=[predicts[shape] for shape in sorted(shapes)],
        seconds=round(time.perf_counter() - started, 3),
    )


def plan_project(project_id: int, params: Mapping[str, Any]) -> str | None:
    """Count the work of a job on project `project_id`'s documents in use with `params` and
    keep it on the project row; returns the plan's key (None: no such project, nothing to
    count, or the base model's tokenizer is not there yet)."""
    from transformers import AutoTokenizer

    from app.db import session_scope
    from app.models import DocStatus, Project
    from app.settings import settings
    from worker.errors import UserFacingError
    from worker.ingest import load_source_docs
    from worker.training.base_model import resolve_base_model

    with session_scope() as session:
        project = session.get(Project, project_id)
        if project is None:
            return None
        usable = [d for d in project.documents
                  if d.retired_at is None and d.status == DocStatus.extracted]
        key = plan_key(settings.base_model, [(d.id, d.sha256) for d in usable], params)
        docs = load_source_docs(session, [d.id for d in usable])
    if not docs:
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_base_model(settings.base_model, settings.models_dir))
        plan = count_work(docs, tokenizer, params, key)
    except UserFacingError as exc:  # nothing to train on: the Train panel says why already
        log.info("project %s: no dataset plan (%s)", project_id, exc)
        return None
    with session_scope() as session:
        project = session.get(Project, project_id)
        if project is None:
            return None
        project.dataset_plan = {**(project.dataset_plan or {}), "plan": plan.model_dump()}
    log.info("project %s: %d examples, %d steps (counted in %.1f s)",
             project_id, plan.examples, plan.steps, plan.seconds)
    return key
