"""What a job starts from and trains on: the one place that decides it.

A job whose parent is a done version of the same method continues it: a LoRA job that
version's adapter (same rank and target modules), a full job that version's merged model
(worker.training.continued loads either). It then trains on the documents new to that version
(added or edited files) plus a replay sample of the ones it already knew, so the earlier
knowledge keeps being rehearsed instead of being overwritten. Anything else trains on every
document from the base model.
"""

from __future__ import annotations

import logging
import math
import random
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.training.continued import adapter_settings, unpack_adapter, unpack_model

log = logging.getLogger(__name__)

# Old documents replayed next to the new ones: at least this share of them, and at least as
# many as there are new ones (when there are that many).
REPLAY_SHARE = 0.25


def replay_plan(sources: list[dict[str, Any]], seed: int) -> tuple[list[int], list[int]]:
    """(document ids to train on, the replayed ones among them) for a job's `sources`, each
    marked "new" or not (app.services.jobs.job_sources). Nothing new: everything is trained
    on again. The sample is drawn with `seed`, so a resumed job draws the same one."""
    new = [s["id"] for s in sources if s.get("new", True)]
    old = [s["id"] for s in sources if not s.get("new", True)]
    if not new:
        return [s["id"] for s in sources], []
    k = min(len(old), max(len(new), math.ceil(REPLAY_SHARE * len(old))))
    replay = sorted(random.Random(seed).sample(old, k))
    chosen = set(new) | set(replay)
    return [s["id"] for s in sources if s["id"] in chosen], replay


@dataclass
class JobInputs:
    """What run_job trains on: document ids, the adapter to start from (None: a fresh one)
    and the settings that must follow that adapter, or for a full fine-tune the merged model
    folder to start from (None: the base model)."""

    doc_ids: list[int]
    start_adapter: Path | None = None
    params: dict[str, Any] = field(default_factory=dict)
    start_model: Path | None = None


def plan_inputs(session, job, workdir: Path) -> JobInputs:
    """Decide how job `job` (a row, in `session`) starts. A LoRA job whose parent is a done
    LoRA version continues that version's adapter, a full job whose parent is a done full
    version that version's merged model, on the new documents plus a replay sample; each
    source is marked with its role ("new", "replay", or "known": learned before, not
    replayed). Anything else, or a parent whose adapter or merged model is gone, trains on
    every document from the base model."""
    from app.models import Job, JobState
    from app.settings import settings

    sources = [dict(s) for s in job.sources or []]
    everything = JobInputs([s["id"] for s in sources])
    parent = session.get(Job, job.parent_job_id) if job.parent_job_id else None
    if parent is None or job.method not in ("lora", "full"):
        return everything
    kind = "adapter" if job.method == "lora" else "merged"
    raw = (parent.artifacts or {}).get(kind)
    if parent.state != JobState.done or parent.method != job.method or not raw:
        log.warning(
            "job %s: job %s has no %s to continue; starting from the base model",
            job.id,
            parent.id,
            "adapter" if kind == "adapter" else "merged model",
        )
        return everything
    path = settings.data_path(raw)
    try:
        if kind == "adapter":
            folder = unpack_adapter(path, Path(workdir) / "start_adapter")
            params = adapter_settings(folder)
        else:
            folder, params = unpack_model(path, Path(workdir) / "start_model"), {}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        log.warning(
            "job %s: cannot continue job %s's %s (%s); starting from the base model",
            job.id,
            parent.id,
            kind,
            exc,
        )
        return everything
    seed = int((job.params or {}).get("seed", 0)) + job.id
    doc_ids, replay = replay_plan(sources, seed)
    chosen, replayed = set(doc_ids), set(replay)
    for s in sources:
        s["role"] = "replay" if s["id"] in replayed else "new" if s["id"] in chosen else "known"
    job.sources = sources
    if kind == "merged":
        return JobInputs(doc_ids, start_model=folder)
    return JobInputs(doc_ids, folder, params)
