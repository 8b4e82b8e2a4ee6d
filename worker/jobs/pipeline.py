"""One training job from documents to downloads, with no database in sight.

base model -> tokenizer + model -> dataset -> score before -> train -> score after -> export.
The Celery task and the CLI both call `run_pipeline`; they turn `Hooks` into progress rows or
console output. Everything is deterministic from the seed, and a job that is run again in the
same `workdir` picks up where it stopped: the "before" scores are cached in before.json, the
training resumes from workdir/checkpoint, a finished job returns its result.json.

Where the base model lives (in memory, or streamed from the disk when it is larger than
memory) is behind one handle (worker.jobs.model_handle); the phases here do not ask.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoTokenizer

from app.contract.training import AUTO, settle
from worker.dataset.build import build_dataset
from worker.dataset.corpus import DatasetSplit, SourceDoc
from worker.distributed.launch import train_on_ranks
from worker.errors import UserFacingError
from worker.export.card import model_card
from worker.export.writers import export_all
from worker.files import model_digest, write_json_atomic
from worker.jobs.model_handle import BaseModelHandle, InMemoryBaseModel, open_base_model
from worker.scoring.evaluate import evaluate
from worker.scoring.previous import score_previous
from worker.training.base_model import EMBEDDED_HUB_ID, EMBEDDED_NAME, resolve_base_model
from worker.training.continued import adapter_start
from worker.training.recipe import Cancelled, FineTuneRecipe, Hooks, TrainConfig
from worker.training.replay import replay_examples, replay_pairs
from worker.training.resources import configure_threads, job_device
from worker.training.streamed import STREAMED_EVAL_BATCH

__all__ = ["Cancelled", "Hooks", "run_pipeline"]

log = logging.getLogger(__name__)

# Settings build_dataset takes from params when given (else its own defaults).
DATASET_KEYS = ("holdout_frac", "max_probes", "generated_qa")
# How many of the base model's own everyday answers to train on alongside (worker.training.replay).
REPLAY_KEY = "replay"
_TRAIN_KEYS = {f.name for f in fields(TrainConfig)}
# The training metrics a result keeps.
METRIC_KEYS = ("train_seconds", "tokens_per_s", "final_loss", "steps", "tokens")


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _check_cancel(hooks: Hooks) -> None:
    if hooks.should_cancel():
        raise Cancelled("Cancelled.")


@dataclass
class JobSettings:
    """What one run is, decided from its inputs before anything is loaded."""

    config: TrainConfig
    dataset_args: dict
    data_key: str  # the dataset, the "before" scores and the replay answers depend on it
    job_key: str  # the whole result depends on it
    replay_n: int
    # start_adapter: a LoRA adapter folder (a previous version, worker/training/continued.py)
    # whose weights the training starts from instead of a fresh adapter; start_model: a merged
    # model folder a full fine-tune starts from.
    start_adapter: Path | None
    start_model: Path | None
    # The settings params leaves to the dataset (app.contract.training.AUTO): set by
    # settled_job once the dataset is built.
    auto: tuple[str, ...] = ()


def run_pipeline(
    docs: list[SourceDoc],
    params: dict,
    base_model: str,
    models_dir: Path,
    workdir: Path,
    hooks: Hooks | None = None,
    *,
    swap_dir: Path | None = None,
    budget_bytes: int | None = None,
    start_adapter: Path | None = None,
    start_model: Path | None = None,
    stream_base: str = "auto",
    device: str = "cpu",
    scores_cache: Path | None = None,
    processes: int = 1,
    parallel: str = "auto",
    peers: Callable[[], list] | None = None,
    run_id: str = "doctune",
) -> dict:
    """Fine-tune `base_model` on `docs` with `params`; returns params, dataset stats, scores
    before/after, artifact paths and metrics (also written to workdir/result.json).

    Training runs through the SSD offload engine: `swap_dir` is where it pages (default
    workdir/swap; one job at a time per folder), `budget_bytes` the memory it may use
    (default: half of what is free).

    `params`: app.contract.training.default_params merged with the user's choices (method,
    epochs, learning_rate, lora_rank, max_seq_len) plus optional TrainConfig fields (seed,
    batch_size, checkpoint_every, max_steps, ...) and dataset settings (holdout_frac,
    max_probes). Raises UserFacingError (a ValueError) with a plain-words message for unusable
    input, Cancelled when `hooks.should_cancel()` turns true.

    Incremental jobs (worker/training/continued.py) start from a previous version, scored as
    "previous" next to "before" and "after": `start_adapter`, a LoRA adapter folder the new
    adapter starts from; `start_model`, a merged model folder (same architecture as the base
    model) whose weights a full fine-tune starts from.

    `stream_base` ("auto", "always", "never"): whether the base model is streamed from the
    disk instead of loaded (worker/training/streamed.py); "auto" streams a model whose float32
    weights take more than half of the free memory. The results are the same either way.
    `device` ("cpu", "cuda", "auto"): where the job computes (worker.training.resources.job_device).
    `scores_cache`: a folder where the base model's "before" scores are kept across jobs, so a
    retrain on the same documents (other epochs, learning rate, method) does not score the
    base model again (see _before_key for what they are filed under).
    `processes`: data-parallel training processes on this machine (worker/distributed/);
    the result is the one process's (bitwise for 2, to float rounding for more). `peers()`:
    the other machines' free training workers to train with (worker.distributed.nodes),
    asked when training starts and again after a lost machine; `run_id` names the run's
    rendezvous; `parallel` ("auto", "data", "pipeline"): how the ranks share the work
    (worker.distributed.launch.choose_parallel). A base model streamed from the disk trains in one process, here.
    """
    hooks = hooks or Hooks()
    configure_threads()
    dev = job_device(device)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    job = job_settings(docs, params, base_model, start_adapter, start_model)
    done = _finished(workdir, job.job_key)
    if done is not None:
        return done
    swap = Path(swap_dir or workdir / "swap")
    tokenizer, split, base, job = _prepare(
        docs, base_model, models_dir, job, hooks, stream_base, dev, budget_bytes, swap
    )

    score = functools.partial(_score, tokenizer=tokenizer, split=split, batch=base.eval_batch)
    phases = _PhaseClock()
    with phases("before"):
        before, previous = _score_base_model(base, tokenizer, split, job, workdir, hooks, score,
                                             scores_cache)
    recipe = _recipe(base, tokenizer, split, job, workdir, hooks)
    on_ranks = isinstance(base, InMemoryBaseModel) and (
        processes > 1 or (peers is not None and bool(peers())))
    if on_ranks:
        with phases("train"):
            if job.start_model is not None:  # the previous version, before the ranks train it
                previous = _previous_scores(workdir, job.job_key, hooks,
                                            lambda: score(base.model))
            train_on_ranks(base, recipe, processes, hooks, peers=peers, run_id=run_id,
                           parallel=parallel,
                           start_adapter=job.start_adapter, start_model=job.start_model)
    recipe.setup()
    if on_ranks and recipe.progress.step < recipe.total_steps:
        raise UserFacingError("The training processes finished, but their checkpoint could "
                              "not be read back. Run the job again.")
    try:
        if job.start_model is not None and not on_ranks:  # through the engine, before it trains
            with phases("before"):
                previous = _previous_scores(workdir, job.job_key, hooks,
                                            lambda: score(recipe.model))
        with phases("train"):
            train_metrics = _train(base, recipe, hooks)
        # "previous": the version this job started from, on the same probes (incremental).
        with phases("after"):
            after = _score_after(recipe, hooks, score)
        scores = {"before": before, "after": after} | (
            {"previous": previous} if previous is not None else {}
        )
        with phases("export"):
            artifacts, export_errors, resolved = _export(
                recipe, tokenizer, base, job, docs, split, base_model, scores, workdir, hooks
            )
    finally:
        base.release(recipe)
    result = {
        "params": resolved,
        "dataset": split.stats,
        "scores": scores,
        "artifacts": artifacts,
        "export_errors": export_errors,
        "metrics": {k: train_metrics[k] for k in METRIC_KEYS} | {"phase_s": phases.seconds},
    }
    write_json_atomic(workdir / "result.json", {"key": job.job_key, "result": result})
    return result


class _PhaseClock:
    """Wall seconds per phase (a phase entered twice adds up); a resumed job counts what it
    ran this time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            took = time.perf_counter() - started
            self.seconds[name] = round(self.seconds.get(name, 0.0) + took, 3)


def _finished(workdir: Path, job_key: str) -> dict | None:
    """The result of this very job when it already finished in `workdir` (its downloads
    still there), else None."""
    done = _read_json(workdir / "result.json")
    if (
        done
        and done.get("key") == job_key
        and all(Path(p).is_file() for p in done["result"]["artifacts"].values())
    ):
        log.info("Job in %s already finished; returning its result.", workdir)
        return done["result"]
    return None


def _prepare(
    docs: list[SourceDoc],
    base_model: str,
    models_dir: Path,
    job: JobSettings,
    hooks: Hooks,
    stream_base: str,
    device: torch.device,
    budget_bytes: int | None,
    swap_dir: Path,
) -> tuple[Any, DatasetSplit, BaseModelHandle, JobSettings]:
    """(tokenizer, dataset, the loaded base model's handle, `job` settled for its dataset)."""
    hooks.on_phase("running", "Preparing the base model")
    model_dir = resolve_base_model(base_model, models_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    split = job_dataset(docs, tokenizer, job)
    job = settled_job(job, split)
    if job.auto:  # what the job page says it trains with, from now on
        hooks.on_settings({k: getattr(job.config, k) for k in job.auto})
    _check_cancel(hooks)
    base = open_base_model(
        model_dir, stream_base, device, budget_bytes, swap_dir, eval_cap=STREAMED_EVAL_BATCH
    )
    torch.manual_seed(job.config.seed)
    base.load(hooks)
    return tokenizer, split, base, job


def job_settings(
    docs: list[SourceDoc],
    params: dict,
    base_model: str,
    start_adapter: Path | None,
    start_model: Path | None,
) -> JobSettings:
    """The run's settings and the keys its cached results are filed under; refuses in words
    a job with nothing to train on or an impossible start."""
    if not any((d.text or "").strip() or d.qa_pairs for d in docs):
        raise UserFacingError(
            "No usable text: the documents of this job contain no text and no "
            "question-answer pairs to train on."
        )
    unknown = set(params) - _TRAIN_KEYS - set(DATASET_KEYS) - {REPLAY_KEY, AUTO}
    if unknown:
        log.warning("Ignoring unknown training settings: %s", sorted(unknown))
    config = TrainConfig.from_dict({k: v for k, v in params.items() if k in _TRAIN_KEYS})
    if start_model is not None and (config.method != "full" or start_adapter is not None):
        raise UserFacingError("Only full fine-tuning can start from a previous version's model.")
    dataset_args = {k: params[k] for k in DATASET_KEYS if k in params}
    doc_ids = sorted([d.name, d.sha256, bool(d.qa_pairs)] for d in docs)
    data_key = _fingerprint(base_model, doc_ids, config.max_seq_len, config.seed, dataset_args)
    auto = tuple(sorted(str(k) for k in params.get(AUTO) or []))
    # What the dataset sets is not in the key: the job's row holds the settled values once
    # they are set (Hooks.on_settings), and a resumed job must find its results under it.
    keyed = {k: v for k, v in config.to_dict().items() if k not in auto}
    job_key = _fingerprint(data_key, keyed, str(start_adapter or ""))
    if start_model is not None:
        job_key = _fingerprint(job_key, "start_model", str(start_model))
    replay_n = int(params.get(REPLAY_KEY) or 0)
    if replay_n:
        job_key = _fingerprint(job_key, REPLAY_KEY, replay_n)
    if auto:  # the same settings chosen by hand may settle otherwise
        job_key = _fingerprint(job_key, AUTO, auto)
    return JobSettings(
        config,
        dataset_args,
        data_key,
        job_key,
        replay_n,
        Path(start_adapter) if start_adapter is not None else None,
        Path(start_model) if start_model is not None else None,
        auto,
    )


def settled_job(job: JobSettings, split: DatasetSplit) -> JobSettings:
    """`job` with the settings it leaves to its dataset (the passes, LoRA's step) set from
    the tokens of `split`'s training examples (app.contract.training.settle)."""
    if not job.auto:
        return job
    cfg = job.config.to_dict()
    tokens = train_tokens(split, job.config.max_seq_len)
    return replace(job, config=TrainConfig.from_dict(cfg | settle(cfg | {AUTO: job.auto}, tokens)))


def train_tokens(split: DatasetSplit, max_seq_len: int) -> int:
    """The tokens of `split`'s training examples as training reads them (cut at
    `max_seq_len`; without the replay answers, which are the same few for every job)."""
    return sum(min(len(e["input_ids"]), max_seq_len) for e in split.train_examples)


def job_dataset(docs: list[SourceDoc], tokenizer, job: JobSettings) -> DatasetSplit:
    config = job.config
    split = build_dataset(
        docs, tokenizer, max_seq_len=config.max_seq_len, seed=config.seed, **job.dataset_args
    )
    if not split.train_examples:
        raise UserFacingError(
            "No usable text to train on: after holding out text for scoring, nothing was "
            "left. Add more documents or question-answer pairs."
        )
    return split


def _score_base_model(
    base: BaseModelHandle,
    tokenizer,
    split: DatasetSplit,
    job: JobSettings,
    workdir: Path,
    hooks: Hooks,
    score: Callable[[torch.nn.Module], dict],
    scores_cache: Path | None = None,
) -> tuple[dict, dict | None]:
    """What is measured on the base model, through its scoring engine: (its scores "before",
    kept in before.json and in `scores_cache`; the previous version's when the job continues
    an adapter, else None). The replay answers, if any, join the training examples meanwhile."""
    with base.scoring():
        shared = _before_file(scores_cache, base.model_dir, job.data_key)
        cached = _read_json(workdir / "before.json")
        if cached and cached.get("key") == job.data_key:
            before = cached["scores"]
        elif shared is not None and (kept := _read_json(shared)) and kept.get("key") == shared.stem:
            hooks.on_phase("evaluating", "Scores before training: the same as an earlier job's "
                                         "(same base model and documents)")
            before = kept["scores"]
            write_json_atomic(workdir / "before.json", {"key": job.data_key, "scores": before})
        else:
            hooks.on_phase("evaluating", f"Scoring before training ({len(split.probes)} questions)")
            before = score(base.model)
            write_json_atomic(workdir / "before.json", {"key": job.data_key, "scores": before})
            if shared is not None:
                shared.parent.mkdir(parents=True, exist_ok=True)
                write_json_atomic(shared, {"key": shared.stem, "scores": before})
        _check_cancel(hooks)
        if job.replay_n:
            _add_replay(base.model, tokenizer, split, job, workdir, hooks, base.eval_batch)
            _check_cancel(hooks)
        previous = None
        if job.start_adapter is not None:
            folder = job.start_adapter

            def measure() -> dict:  # the adapter on the base model, then off again
                return score_previous(
                    base.model, tokenizer, split, folder, lambda m, _t, _s: score(m)
                )

            previous = _previous_scores(workdir, job.job_key, hooks, measure)
    return before, previous


# The code the "before" scores come out of: a change to any of these files files them anew.
_SCORING_CODE = ("dataset", "scoring")


@functools.cache
def _scoring_code_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for folder in _SCORING_CODE:
        for path in sorted((root / folder).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _before_file(scores_cache: Path | None, model_dir: str, data_key: str) -> Path | None:
    """Where the base model's "before" scores of this dataset are kept across jobs: filed
    under the dataset (data_key: documents, sequence length, seed, dataset settings), the
    base model's weights (worker/files.py model_digest), the code that builds the probes and
    scores them, and the torch and transformers versions. None without a cache folder or for
    a model that is not a local folder."""
    if scores_cache is None or not Path(model_dir).is_dir():
        return None
    try:
        weights = model_digest(model_dir)
    except (OSError, ValueError):
        return None
    key = _fingerprint("before", data_key, weights, _scoring_code_digest(), torch.__version__,
                       transformers.__version__)
    return Path(scores_cache) / f"{key}.json"


def _add_replay(model, tokenizer, split: DatasetSplit, job: JobSettings, workdir: Path, hooks: Hooks,
                batch_size: int = 8) -> None:
    """Add the base model's own answers to `job.replay_n` everyday prompts to the training
    examples (worker.training.replay), generated once and kept in workdir/replay.json for a
    resumed job."""
    key = _fingerprint(job.data_key, REPLAY_KEY, job.replay_n)
    cached = _read_json(workdir / "replay.json")
    if cached and cached.get("key") == key:
        pairs = [(p, a) for p, a in cached["pairs"]]  # JSON lists back to pairs
    else:
        hooks.on_phase("running", "Noting how the base model answers everyday questions")
        pairs = replay_pairs(model, tokenizer, job.replay_n, batch_size=batch_size)
        write_json_atomic(workdir / "replay.json", {"key": key, "pairs": pairs})
    examples = replay_examples(tokenizer, pairs, job.config.max_seq_len)
    split.train_examples.extend(examples)
    split.stats["n_train_replay"] = len(examples)
    split.stats["n_train_examples"] = len(split.train_examples)
    split.stats.setdefault("notes", []).append(
        f"{len(examples)} of the base model's own answers to everyday questions were trained "
        "on too, so it keeps its general English."
    )


def _previous_scores(workdir: Path, job_key: str, hooks: Hooks, measure) -> dict:
    """The scores of the version an incremental job starts from: `measure()`, done once and
    kept in workdir/previous.json (keyed by `job_key`) for a resumed job."""
    cached = _read_json(workdir / "previous.json")
    if cached and cached.get("key") == job_key:
        previous = cached["scores"]
    else:
        hooks.on_phase("evaluating", "Scoring the previous version")
        previous = measure()
        write_json_atomic(workdir / "previous.json", {"key": job_key, "scores": previous})
    _check_cancel(hooks)
    return previous


def _pad_id(tokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0


def _recipe(base: BaseModelHandle, tokenizer, split: DatasetSplit, job: JobSettings, workdir: Path,
            hooks: Hooks) -> FineTuneRecipe:
    """The recipe that trains the base model, or the previous version it continues."""
    if job.start_model is not None:
        # "before" (and the replay answers) came from the base model; from here on the model
        # is the previous version, which is scored and then trained further.
        hooks.on_phase("running", "Loading the previous version")
        base.start_from_model(job.start_model)
    start = adapter_start(job.start_adapter) if job.start_adapter is not None else None
    return FineTuneRecipe(base.model, split.train_examples, job.config, workdir, hooks,
                          _pad_id(tokenizer), base.engine_options(), start_weights=start)


def _score(model: torch.nn.Module, *, tokenizer, split: DatasetSplit, batch: int) -> dict:
    return evaluate(model, tokenizer, split, batch_size=batch)


def _score_after(recipe: FineTuneRecipe, hooks: Hooks, score: Callable) -> dict:
    _check_cancel(hooks)
    hooks.on_phase("evaluating", "Scoring after training")
    after = score(recipe.model)
    recipe.model.eval()
    return after


def _train(base: BaseModelHandle, recipe: FineTuneRecipe, hooks: Hooks) -> dict:
    hooks.on_phase("running", "Training")
    started = time.perf_counter()
    metrics = base.train(recipe)
    log.info("Training took %.1f s in this run.", time.perf_counter() - started)
    return metrics


def _describe_base(base_model: str) -> tuple[str, str, list[str]]:
    """(display name, id to load it elsewhere, notes) for the model card."""
    if base_model.strip() == "embedded":
        return (
            f"{EMBEDDED_NAME} (embedded)",
            EMBEDDED_HUB_ID,
            [
                (
                    "The base model is SmolLM2-135M-Instruct as shipped in 4-bit GGUF form "
                    "(Q4_1) and dequantized to float32 for training. The hub model "
                    f"`{EMBEDDED_HUB_ID}` is the same model at full precision: the adapter "
                    "works with it, but for exactly the scores above use the merged model."
                )
            ],
        )
    return Path(base_model).name or base_model, base_model, []


def _export(recipe: FineTuneRecipe, tokenizer, base: BaseModelHandle, job: JobSettings,
            docs: list[SourceDoc], split: DatasetSplit, base_model: str, scores: dict,
            workdir: Path, hooks: Hooks) -> tuple[dict, dict, dict]:
    """The model card and every download: (artifacts, export errors, resolved settings)."""
    _check_cancel(hooks)
    hooks.on_phase("running", "Exporting")
    resolved = (
        job.config.to_dict()
        | job.dataset_args
        | {
            "total_steps": recipe.total_steps,
            "steps_per_epoch": recipe.steps_per_epoch,
        }
    )
    display, base_id, notes = _describe_base(base_model)
    card = model_card(
        {
            "base_model": display,
            "base_model_id": base_id,
            "method": job.config.method,
            "params": resolved,
            "documents": [
                {"name": d.name, "sha256": d.sha256, "version": d.version} for d in docs
            ],
            "scores": scores,
            "dataset": {k: v for k, v in split.stats.items() if k != "notes"},
            "notes": notes,
        }
    )
    artifacts, export_errors = export_all(
        recipe.model,
        tokenizer,
        workdir / "exports",
        card,
        base_model_id=base_id,
        source=base.export_source(recipe),
        max_shard_bytes=base.max_shard_bytes(),
    )
    return artifacts, export_errors, resolved
