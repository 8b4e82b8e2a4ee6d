"""How long training will take on this machine: the line next to the Train button.

The training worker measures the machine once (disk and CPU speed) and plans LoRA and full
fine-tuning of the base model at a reference batch (worker/training/machine_profile.py); it writes
the result to `settings.machine_profile_path`. This module reads that file (never torch or
offload) and scales the per-step figures to a project's corpus and settings:

  tokens   ~ words x 1.4 + question-answer pairs x 60
  examples ~ text tokens / max_seq_len (chunks) + Q&A pairs
             + practice questions (about 0.085 per word and per `generated_qa`, measured on
               the fixture corpus: 146 from 862 words at 2) + replay answers
  steps    = epochs x ceil(examples / batch size)
  time     = steps x time per step: compute scales with the tokens of a step; a model that
             streams from the SSD takes at least the disk time of a step. A base model
             larger than memory is streamed for scoring too: the profile's scoring time
             (a read of the model per generated token) is added.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.contract.machine_profile import is_current
from app.contract.training import METHODS, default_params
from app.models import Job, JobState
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


def _steps(corpus: Corpus, params: Mapping[str, Any], batch_size: int) -> tuple[int, int]:
    """(optimizer steps, padded tokens per step) for the corpus under `params`."""
    seq = int(params["max_seq_len"])
    text_tokens = corpus.n_words * TOKENS_PER_WORD
    text_examples = math.ceil(text_tokens / seq) if text_tokens else 0
    practice = round(corpus.n_words * PRACTICE_QA_PER_WORD * int(params.get("generated_qa") or 0))
    examples = text_examples + corpus.n_qa + practice + int(params.get("replay") or 0)
    if not examples:
        return 0, 0
    steps = int(params["epochs"]) * math.ceil(examples / batch_size)
    # A batch is padded to its longest example: a text chunk fills max_seq_len.
    width = seq if text_examples else min(seq, TOKENS_PER_QA)
    return steps, batch_size * width


def estimate(
    corpus: Corpus, params: Mapping[str, Any], profile: Mapping[str, Any] | None
) -> Estimate:
    """How long training `corpus` with `params` (method, epochs, max_seq_len) takes."""
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
    batch = int(ref["batch_size"])
    steps, tokens = _steps(corpus, params, batch)
    compute = float(plan["compute_s_per_step"]) * tokens / (batch * int(ref["seq_len"]))
    streams = not plan.get("fits_in_memory")
    per_step = max(compute, float(plan.get("io_s_per_step") or 0.0)) if streams else compute
    seconds = train_s = steps * per_step
    where = "Streams from the SSD" if streams else "Fits in memory"
    base = profile.get("base") or {}
    if base.get("streams"):  # larger than memory: scored through the SSD too
        seconds += float(base.get("scoring_s") or 0.0)
        streams = True
        where = "Base model larger than memory, streams from the SSD"
    return Estimate(method, f"{where}: {human_duration(seconds)}", seconds, steps, streams,
                    train_s)


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


def finished_record(job: Job) -> Finished | None:
    """A done job's estimate against its measured phases; None when it lacks either."""
    estimated = (job.estimate or {}).get("train_s")
    phases = (job.metrics or {}).get("phase_s") or {}
    if not estimated or not phases.get("train"):
        return None
    return Finished(job.method, float(estimated), float(phases["train"]),
                    sum(float(phases.get(p) or 0.0) for p in OTHER_PHASES),
                    sum(float(phases.get(p) or 0.0) for p in ("after", "export")))


def calibrated(est: Estimate, history: list[Finished]) -> Estimate:
    """`est` corrected by the last finished jobs of its method (newest first)."""
    mine = [h for h in history if h.method == est.method][:HISTORY_JOBS]
    if est.train_s is None or not mine:
        return est
    ratios = sorted(h.train_s / h.estimated_train_s for h in mine)
    middle = len(ratios) // 2
    factor = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    other = sum(h.other_s for h in mine) / len(mine)
    seconds = (est.seconds or 0.0) - est.train_s + est.train_s * factor + other
    where = est.text.split(":", 1)[0]
    jobs = "your last job" if len(mine) == 1 else f"your last {len(mine)} jobs"
    return Estimate(est.method, f"{where}: {human_duration(seconds)} (based on {jobs})",
                    seconds, est.steps, est.streams, est.train_s * factor, len(mine))


def estimates_for(
    corpus: Corpus, profile: Mapping[str, Any] | None = None, *, load: bool = True,
    history: list[Finished] | None = None,
) -> dict[str, Estimate]:
    """The estimate of each method with the settings DocTune would pick for `corpus`,
    corrected by `history` (finished jobs, newest first) where there is one."""
    if profile is None and load:
        profile = load_profile()
    return {
        m: calibrated(estimate(corpus, default_params(corpus.n_words, corpus.n_qa, m), profile),
                      history or [])
        for m in METHODS
    }


def history(session: Session, limit: int = 20) -> list[Finished]:
    """The newest finished jobs that recorded both an estimate and their phases."""
    jobs = session.scalars(select(Job).where(Job.state == JobState.done,
                                             Job.estimate.is_not(None))
                           .order_by(Job.finished_at.desc(), Job.id.desc()).limit(limit))
    return [r for j in jobs if (r := finished_record(j)) is not None]


def estimate_record(corpus: Corpus, params: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a job being queued keeps of the estimate (Job.estimate), or None without one."""
    est = estimate(corpus, params, load_profile())
    if est.train_s is None:
        return None
    return {"train_s": round(est.train_s, 3), "steps": est.steps}


def time_left(job: Job, history: list[Finished]) -> float | None:
    """A running job's wait to its score card: its training's own ETA (from its measured
    steps) plus the scoring after training and the exports, as the last finished jobs took
    them (their mean; nothing is added before any job has finished)."""
    if job.eta_s is None:
        return None
    recent = [h for h in history if h.method == job.method][:HISTORY_JOBS] or history[
        :HISTORY_JOBS]
    rest = sum(h.after_s for h in recent) / len(recent) if recent else 0.0
    return float(job.eta_s) + rest
