"""How long training will take on this machine: the line next to the Train button.

Two measurements, both made by the worker (this module reads them and never imports torch
or offload):

- the machine profile (worker/training/machine_profile.py, `settings.machine_profile_path`):
  disk and CPU speed, offload.plan's figures for LoRA and full fine-tuning, and a timed run
  of the real base model through the offload engine at a few batch shapes, with a fit for
  the time of a step of any shape (app.contract.machine_profile.StepFit);
- the dataset plan of the project (worker/jobs/dataset_plan.py, Project.dataset_plan): the
  examples the job's own dataset code makes of these documents and the padded shape of each
  of its steps (app.contract.dataset_plan).

Training time = the sum over the plan's steps of the fit's time for their shape, and the
checkpoints the job writes (every 25 steps and at each epoch's end) at the timed run's time
for one. Until the
plan is counted (or for settings it was not counted for), the steps come from a rule of thumb:

  tokens   ~ words x 1.4 + question-answer pairs x 60
  examples ~ text tokens / max_seq_len (chunks) + Q&A pairs
             + practice questions (about 0.085 per word and per `generated_qa`, measured on
               the fixture corpus: 146 from 862 words at 2) + replay answers
  steps    = epochs x ceil(examples / batch size), each padded to max_seq_len if there is
             text, else to a short question's length.

Without a timed run (a base model streamed from the disk), a step's time is offload.plan's
compute time scaled by its tokens, and at least the disk time of a step. A base model
larger than memory is streamed for scoring too: the profile's scoring time is added. Once
jobs have finished, their measured phases correct the figure (`calibrated`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, object_session

from app.contract.dataset_plan import DatasetPlan, checked_plan, plan_key
from app.contract.machine_profile import StepFit, is_current
from app.contract.tasks import PLAN_TASK
from app.contract.training import CHECKPOINT_EVERY, METHODS, checkpoints_after, default_params
from app.models import Job, JobState, Project
from app.queue import enqueue_after_commit
from app.services.durations import human_duration
from app.services.projects import Corpus
from app.services.uploads import human_size
from app.settings import settings

TOKENS_PER_WORD = 1.4
TOKENS_PER_QA = 60  # a short question and answer in the chat template
# Practice questions made from fact-bearing sentences (worker/dataset/build.py), per
# word of text and per question asked of each fact: 146 from the 862 words of the fixture
# corpus (tests/fixtures/docs.py) at generated_qa = 2. Real documents state fewer facts per
# word than that corpus does, so this errs long.
PRACTICE_QA_PER_WORD = 0.085
ESTIMATING = "Estimating this machine's speed…"


@dataclass
class Estimate:
    """The estimate for one method: a line of words, and the numbers behind it."""

    method: str
    text: str
    seconds: float | None = None  # None: no estimate (yet, or the model cannot train here)
    steps: int = 0
    streams: bool | None = None  # None: unknown
    train_s: float | None = None  # of `seconds`, the training itself (from the profile)
    based_on: int = 0  # finished jobs the figure was corrected with
    counted: bool = False  # the steps come from the dataset plan (else a rule of thumb)
    # Seconds of each phase of the wait: "before" (scoring the base model), "train",
    # "after" (scoring the tuned model), "export".
    phases: dict[str, float] | None = None
    before_cached: bool = False  # the base model's scores are kept from an earlier job

    def breakdown(self) -> str:
        """The phases in words: "scoring the base model about 3 min, training ..." """
        return ", ".join(f"{label} {human_duration(self.phases[key])}"
                         for key, label in PHASE_LABELS.items()
                         if self.phases and self.phases.get(key))


PHASE_LABELS = {"before": "scoring the base model", "train": "training",
                "after": "scoring the tuned model", "export": "downloads"}


def load_profile(path: Path | None = None) -> dict[str, Any] | None:
    """The machine profile the worker wrote (app.contract.machine_profile), or None: not
    measured yet, unreadable, of another format or shape, or made for another base model
    (the worker measures again when it restarts)."""
    path = path or settings.machine_profile_path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if is_current(data, settings.base_model) else None


Shapes = list[tuple[int, int, int]]  # (rows, padded width, steps of that shape)


def _rule_of_thumb(corpus: Corpus, params: Mapping[str, Any], batch_size: int) -> Shapes:
    """The steps of a job on `corpus` under `params`, guessed from its word count."""
    seq = int(params["max_seq_len"])
    text_tokens = corpus.n_words * TOKENS_PER_WORD
    text_examples = math.ceil(text_tokens / seq) if text_tokens else 0
    practice = round(corpus.n_words * PRACTICE_QA_PER_WORD * int(params.get("generated_qa") or 0))
    examples = text_examples + corpus.n_qa + practice + int(params.get("replay") or 0)
    if not examples:
        return []
    steps = int(params["epochs"]) * math.ceil(examples / batch_size)
    # A batch is padded to its longest example: a text chunk fills max_seq_len.
    width = seq if text_examples else min(seq, TOKENS_PER_QA)
    return [(batch_size, width, steps)]


def _train_seconds(shapes: Shapes, plan: Mapping[str, Any], fit: StepFit | None,
                   ref: Mapping[str, Any], epochs: int = 1, every: int = CHECKPOINT_EVERY,
                   predicting: list[int] | None = None) -> float:
    """Seconds of training over `shapes` (`epochs` passes): the timed run's fit and its
    checkpoints, else offload.plan's compute time per step scaled by the step's tokens (at
    least its disk time when the model streams). `predicting`: per shape, its steps'
    positions that predict a label, summed (the output layer runs only there); None: all."""
    if fit is not None:
        steps = sum(n for _, _, n in shapes)
        checkpoints = checkpoints_after(0, steps, steps // max(1, epochs), every) if steps else 0
        per_shape = predicting if predicting and len(predicting) == len(shapes) else None
        return (sum(n * fit.seconds(rows, width,
                                    per_shape[i] / n if per_shape is not None else None)
                    for i, (rows, width, n) in enumerate(shapes))
                + checkpoints * fit.checkpoint_s)
    per_token = float(plan["compute_s_per_step"]) / (int(ref["batch_size"]) * int(ref["seq_len"]))
    io = float(plan.get("io_s_per_step") or 0.0) if not plan.get("fits_in_memory") else 0.0
    return sum(n * max(per_token * rows * width, io) for rows, width, n in shapes)


def estimate(
    corpus: Corpus, params: Mapping[str, Any], profile: Mapping[str, Any] | None,
    dataset: DatasetPlan | None = None, before_cached: bool = False,
) -> Estimate:
    """How long training `corpus` with `params` (method, epochs, max_seq_len) takes; `dataset`
    is the project's dataset plan counted for these documents and settings, if there is one."""
    method = str(params.get("method") or "lora")
    if profile is None:
        return Estimate(method, ESTIMATING)
    plan = (profile.get("methods") or {}).get(method)
    ref = profile.get("reference") or {}
    if not plan or not ref.get("batch_size") or not ref.get("seq_len"):
        return Estimate(method, "No estimate for this model.")
    if not plan.get("fits"):
        need = plan.get("min_budget_bytes") or 0
        budget = profile.get("budget_bytes") or 0
        return Estimate(
            method,
            f"Too large for this machine: needs about {human_size(int(need))} of memory, "
            f"DocTune may use {human_size(int(budget))}.",
            streams=True,
        )
    shapes = ([tuple(s) for s in dataset.shapes] if dataset is not None
              else _rule_of_thumb(corpus, params, int(ref["batch_size"])))
    timed = (profile.get("steps") or {}).get(method)
    fit = StepFit.model_validate(timed) if timed else None
    epochs = dataset.epochs if dataset is not None else int(params["epochs"])
    every = int(params.get("checkpoint_every") or CHECKPOINT_EVERY)
    train_s = _train_seconds(shapes, plan, fit, ref, epochs, every,
                             dataset.predicting if dataset is not None else None)
    before, after = _scoring_seconds(profile, corpus, params, dataset, before_cached)
    phases = {"before": before, "train": train_s, "after": after,
              "export": _export_seconds(profile)}
    streams = not plan.get("fits_in_memory")
    where = "Streams from the SSD" if streams else "Fits in memory"
    base = profile.get("base") or {}
    if base.get("streams"):  # larger than memory: scored through the SSD too
        phases["before"] += float(base.get("scoring_s") or 0.0) / 2
        phases["after"] += float(base.get("scoring_s") or 0.0) / 2
        streams = True
        where = "Base model larger than memory, streams from the SSD"
    seconds = sum(phases.values())
    return Estimate(method, f"{where}: {human_duration(seconds)}", seconds,
                    sum(n for _, _, n in shapes), streams, train_s,
                    counted=dataset is not None, phases=phases, before_cached=before_cached)


# The downloads (adapter, merged model, two GGUF files, each zipped with its card) are mostly
# CPU work over the model's weights: 14.4 s for SmolLM2-135M's 0.538 GB of float32 weights on
# a 2-core AMD EPYC whose matmuls ran at 121.5 GFLOP/s (`make bench-estimate`, 2026-12-01),
# i.e. this many FLOP-equivalents per byte of weights, scaled by this machine's speed.
EXPORT_WORK_PER_BYTE = 14.4 * 121.5e9 / 0.538e9


def _export_seconds(profile: Mapping[str, Any]) -> float:
    weights = float((profile.get("base") or {}).get("fp32_bytes") or 0)
    flops = float((profile.get("cpu") or {}).get("matmul_flops") or 0)
    return EXPORT_WORK_PER_BYTE * weights / flops if weights and flops else 0.0


def _batches(n: int, size: int = 8) -> int:
    return -(-n // size)


def _scoring_seconds(profile: Mapping[str, Any], corpus: Corpus, params: Mapping[str, Any],
                     dataset: DatasetPlan | None, before_cached: bool = False
                     ) -> tuple[float, float]:
    """(scoring before training, after it) from the profile's timed generation and forwards,
    as worker/scoring/evaluate.py spends them: each side generates 24 tokens per batch of 8
    probes (completions), 48 per batch of their questions and 24 per batch of held-out pairs,
    and reads the held-out text and the forgetting check's sample; before training the base
    model also answers the replay prompts (96 tokens per batch). An answer that ends early
    ends its batch early only if all do: these are the longest the phases take. With
    `before_cached` the base model's scores are kept from an earlier job: only its replay
    answers are made before training."""
    timed = profile.get("scoring")
    if not timed:
        return 0.0, 0.0
    if dataset is not None:
        probes, questions = dataset.probes, dataset.questions
        held_qa, held_chunks, replay = dataset.heldout_qa, dataset.heldout_chunks, dataset.replay
    else:  # as build_dataset holds out (10%, none of fewer than 3) and probes (at most 40)
        chunks = math.ceil(corpus.n_words * TOKENS_PER_WORD / int(params["max_seq_len"]))
        probes = questions = min(40, round(corpus.n_words * PRACTICE_QA_PER_WORD))
        held_qa = round(0.1 * corpus.n_qa) if corpus.n_qa >= 3 else 0
        held_chunks = round(0.1 * chunks) if chunks >= 3 else 0
        replay = int(params.get("replay") or 0)
    decode, forward = float(timed["decode_s"]), float(timed["forward_s"])
    side = decode * (24 * _batches(probes) + 48 * _batches(questions) + 24 * _batches(held_qa))
    side += forward * (_batches(held_chunks) + int(timed["general_forwards"]))
    replay_s = decode * 96 * _batches(replay)
    return (replay_s if before_cached else side + replay_s), side


# The dataset settings the base model's "before" scores depend on (worker/jobs/pipeline.py
# files them under the base model, the documents' names and contents and these).
_BEFORE_KEYS = ("max_seq_len", "seed", "holdout_frac", "max_probes", "generated_qa")


def before_is_cached(session: Session, corpus: Corpus, params: Mapping[str, Any],
                     limit: int = 50) -> bool:
    """Whether a finished job from the base model already scored it on these documents with
    these settings: its scores are kept (worker/jobs/pipeline.py), so a new job does not
    score the base model again, only lets it answer the replay prompts."""
    docs = sorted((d.original_name, d.sha256) for d in corpus.usable)
    key = {k: params.get(k) for k in _BEFORE_KEYS}
    jobs = session.scalars(select(Job).where(Job.state == JobState.done,
                                             Job.parent_job_id.is_(None))
                           .order_by(Job.id.desc()).limit(limit))
    for job in jobs:
        p = job.params or {}
        if ({k: p.get(k) for k in _BEFORE_KEYS} == key
                and sorted((s.get("name"), s.get("sha256")) for s in job.sources or []) == docs):
            return True
    return False


# The dataset plan of a project (Project.dataset_plan: {"plan": ..., "requested": {"key",
# "at"}}), counted by the worker when the Train panel asks for one.
PLAN_WAIT_S = 120  # a plan asked for and not there after this: the rule of thumb, ask again later
PLAN_RETRY_S = 600


def dataset_key(corpus: Corpus, params: Mapping[str, Any]) -> str:
    return plan_key(settings.base_model, [(d.id, d.sha256) for d in corpus.usable], params)


def dataset_plan(project: Project, corpus: Corpus, params: Mapping[str, Any]) -> DatasetPlan | None:
    """The project's dataset plan if it was counted for these documents and `params`."""
    return checked_plan((project.dataset_plan or {}).get("plan"), dataset_key(corpus, params))


def plan_request(project: Project, corpus: Corpus, params: Mapping[str, Any],
                 now: float) -> tuple[str | None, bool]:
    """(the key to ask the worker to count now, or None; whether a count is under way).
    Nothing is asked while documents are still being read or when there are none; a request
    is made again only after PLAN_RETRY_S (a worker that never answers does not get asked on
    every page view, and the panel stops waiting after PLAN_WAIT_S)."""
    if not corpus.usable or corpus.n_pending:
        return None, False
    key = dataset_key(corpus, params)
    if checked_plan((project.dataset_plan or {}).get("plan"), key) is not None:
        return None, False
    asked = (project.dataset_plan or {}).get("requested") or {}
    age = now - float(asked.get("at") or 0.0) if asked.get("key") == key else math.inf
    if age < PLAN_WAIT_S:
        return None, True
    return (key if age >= PLAN_RETRY_S else None), False


def ask_for_plan(project: Project, corpus: Corpus, now: float | None = None) -> bool:
    """Ask the worker to count the project's dataset plan for the Train button's settings
    when it has none for them (sent once the session commits); True while a count is under
    way (the Train panel asks again a few seconds later)."""
    now = time.time() if now is None else now
    params = default_params(corpus.n_words, corpus.n_qa, "lora")
    key, counting = plan_request(project, corpus, params, now)
    if key is not None:
        project.dataset_plan = {**(project.dataset_plan or {}),
                                "requested": {"key": key, "at": now}}
        enqueue_after_commit(object_session(project), PLAN_TASK, project.id, params)
        return True
    return counting


# Learning from finished jobs: each job keeps the estimate made when it was queued
# (Job.estimate) and its measured phases (Job.metrics["phase_s"]). The training estimate is
# scaled by how the last jobs' training compared with their estimates (the median ratio, so
# one odd job does not swing it), and the scoring and export phases, which the profile does
# not predict, are added as those jobs measured them.
HISTORY_JOBS = 3
OTHER_PHASES = ("before", "after", "export")


@dataclass(frozen=True)
class Finished:
    """What a finished job says about this machine's speed."""

    method: str
    estimated_train_s: float
    train_s: float
    other_s: float  # scoring before and after, and the exports
    after_s: float = 0.0  # of which after training: scoring the tuned model, the exports
    export_s: float = 0.0  # of which the exports


def finished_record(job: Job) -> Finished | None:
    """A done job's estimate against its measured phases; None when it lacks either."""
    estimated = (job.estimate or {}).get("train_s")
    phases = (job.metrics or {}).get("phase_s") or {}
    if not estimated or not phases.get("train"):
        return None
    return Finished(job.method, float(estimated), float(phases["train"]),
                    sum(float(phases.get(p) or 0.0) for p in OTHER_PHASES),
                    sum(float(phases.get(p) or 0.0) for p in ("after", "export")),
                    float(phases.get("export") or 0.0))


def calibrated(est: Estimate, history: list[Finished]) -> Estimate:
    """`est` corrected by the last finished jobs of its method (newest first)."""
    mine = [h for h in history if h.method == est.method][:HISTORY_JOBS]
    if est.train_s is None or not mine:
        return est
    ratios = sorted(h.train_s / h.estimated_train_s for h in mine)
    middle = len(ratios) // 2
    factor = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    def mean(values) -> float:
        return sum(values) / len(mine)

    # What scoring and the exports took here, instead of what the profile predicts.
    # Scores kept from an earlier job: "before" is only the replay answers, as predicted.
    before = ((est.phases or {}).get("before", 0.0) if est.before_cached
              else mean(h.other_s - h.after_s for h in mine))
    phases = {"before": before, "train": est.train_s * factor,
              "after": mean(h.after_s - h.export_s for h in mine),
              "export": mean(h.export_s for h in mine)}
    seconds = sum(phases.values())
    where = est.text.split(":", 1)[0]
    jobs = "your last job" if len(mine) == 1 else f"your last {len(mine)} jobs"
    return Estimate(est.method, f"{where}: {human_duration(seconds)} (based on {jobs})",
                    seconds, est.steps, est.streams, est.train_s * factor, len(mine),
                    est.counted, phases, est.before_cached)


def estimates_for(
    corpus: Corpus, profile: Mapping[str, Any] | None = None, *, load: bool = True,
    history: list[Finished] | None = None, project: Project | None = None,
) -> dict[str, Estimate]:
    """The estimate of each method with the settings DocTune would pick for `corpus` (of
    `project`, whose dataset plan is used when it was counted for them), corrected by
    `history` (finished jobs, newest first) where there is one."""
    if profile is None and load:
        profile = load_profile()
    params = {m: default_params(corpus.n_words, corpus.n_qa, m) for m in METHODS}
    # The dataset plan and the kept "before" scores depend on the dataset's settings, which
    # the methods' defaults share (they differ in learning rate): looked up once per view.
    shared = params[METHODS[0]]
    counted = dataset_plan(project, corpus, shared) if project is not None else None
    cached = project is not None and before_is_cached(object_session(project), corpus, shared)
    return {m: calibrated(estimate(corpus, p, profile, counted, cached), history or [])
            for m, p in params.items()}


def history(session: Session, limit: int = 20) -> list[Finished]:
    """The newest finished jobs that recorded both an estimate and their phases."""
    jobs = session.scalars(select(Job).where(Job.state == JobState.done,
                                             Job.estimate.is_not(None))
                           .order_by(Job.finished_at.desc(), Job.id.desc()).limit(limit))
    return [r for j in jobs if (r := finished_record(j)) is not None]


def estimate_record(project: Project, corpus: Corpus,
                    params: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a job being queued keeps of the estimate (Job.estimate), or None without one."""
    cached = before_is_cached(object_session(project), corpus, params)
    est = estimate(corpus, params, load_profile(), dataset_plan(project, corpus, params), cached)
    if est.train_s is None:
        return None
    phases = est.phases or {}
    return {"train_s": round(est.train_s, 3), "steps": est.steps, "counted": est.counted,
            "after_s": round(phases.get("after", 0.0) + phases.get("export", 0.0), 3)}


def time_left(job: Job, history: list[Finished]) -> float | None:
    """A running job's wait to its score card: its training's own ETA (from its measured
    steps) plus the scoring after training and the exports, as the last finished jobs took
    them (their mean), or before any job has finished here as the job's estimate put them."""
    if job.eta_s is None:
        return None
    recent = [h for h in history if h.method == job.method][:HISTORY_JOBS] or history[
        :HISTORY_JOBS]
    if recent:
        rest = sum(h.after_s for h in recent) / len(recent)
    else:
        rest = float((job.estimate or {}).get("after_s") or 0.0)
    return float(job.eta_s) + rest
