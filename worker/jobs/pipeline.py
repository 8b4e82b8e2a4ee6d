"""One training job from documents to downloads, with no database in sight.

base model -> tokenizer + model -> dataset -> score before -> train -> score after -> export.
The Celery task and the CLI both call `run_pipeline`; they turn `Hooks` into progress rows or
console output. Everything is deterministic from the seed, and a job that is run again in the
same `workdir` picks up where it stopped: the "before" scores are cached in before.json, the
training resumes from workdir/checkpoint, a finished job returns its result.json.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from dataclasses import fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from worker.dataset.build import build_dataset
from worker.dataset.corpus import SourceDoc
from worker.export.card import model_card
from worker.export.tensor_source import StreamedSource
from worker.export.writers import MAX_SHARD_BYTES, export_all
from worker.scoring.evaluate import evaluate
from worker.training.base_model import EMBEDDED_HUB_ID, EMBEDDED_NAME, resolve_base_model
from worker.training.recipe import Cancelled, EngineOptions, FineTuneRecipe, Hooks, TrainConfig
from worker.training.replay import replay_examples, replay_pairs
from worker.training.resources import auto_budget_bytes, configure_threads, job_device
from worker.training.streamed import (
    STREAMED_EVAL_BATCH,
    WeightsReader,
    describe,
    eval_batch_size,
    load_resident_weights,
    load_unloaded_model,
    scoring_engine,
    should_stream,
)

__all__ = ["Cancelled", "Hooks", "run_pipeline"]

log = logging.getLogger(__name__)

# Settings build_dataset takes from params when given (else its own defaults).
DATASET_KEYS = ("holdout_frac", "max_probes", "generated_qa")
# How many of the base model's own everyday answers to train on alongside (worker.training.replay).
REPLAY_KEY = "replay"
_TRAIN_KEYS = {f.name for f in fields(TrainConfig)}


def _fingerprint(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, ensure_ascii=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _check_cancel(hooks: Hooks) -> None:
    if hooks.should_cancel():
        raise Cancelled("Cancelled.")


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


def _add_replay(model, tokenizer, split, n: int, max_seq_len: int, workdir: Path,
                data_key: str, hooks: Hooks, batch_size: int = 8) -> None:
    """Add the base model's own answers to `n` everyday prompts to the training examples
    (worker.training.replay), generated once and kept in workdir/replay.json for a resumed job."""
    key = _fingerprint(data_key, REPLAY_KEY, n)
    cached = _read_json(workdir / "replay.json")
    if cached and cached.get("key") == key:
        pairs = [(p, a) for p, a in cached["pairs"]]  # JSON lists back to pairs
    else:
        hooks.on_phase("running", "Noting how the base model answers everyday questions")
        pairs = replay_pairs(model, tokenizer, n, batch_size=batch_size)
        _write_json(workdir / "replay.json", {"key": key, "pairs": pairs})
    examples = replay_examples(tokenizer, pairs, max_seq_len)
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
        _write_json(workdir / "previous.json", {"key": job_key, "scores": previous})
    _check_cancel(hooks)
    return previous


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
) -> dict:
    """Fine-tune `base_model` on `docs` with `params`; returns params, dataset stats, scores
    before/after, artifact paths and metrics (also written to workdir/result.json).

    Training runs through the SSD offload engine: `swap_dir` is where it pages (default
    workdir/swap; one job at a time per folder), `budget_bytes` the memory it may use
    (default: half of what is free).

    `params`: app.training_defaults.default_params merged with the user's choices (method,
    epochs, learning_rate, lora_rank, max_seq_len) plus optional TrainConfig fields (seed,
    batch_size, checkpoint_every, max_steps, ...) and dataset settings (holdout_frac,
    max_probes). Raises ValueError with a plain-words message for unusable input, Cancelled
    when `hooks.should_cancel()` turns true.

    Incremental jobs (worker/training/continued.py) start from a previous version, scored as
    "previous" next to "before" and "after": `start_adapter`, a LoRA adapter folder the new
    adapter starts from; `start_model`, a merged model folder (same architecture as the base
    model) whose weights a full fine-tune starts from.

    `stream_base` ("auto", "always", "never"): whether the base model is streamed from the
    disk instead of loaded (worker/training/streamed.py); "auto" streams a model whose float32
    weights take more than half of the free memory. The results are the same either way.
    `device` ("cpu", "cuda", "auto"): where the job computes (worker.training.engines.job_device).
    """
    hooks = hooks or Hooks()
    configure_threads()
    dev = job_device(device)
    cuda = dev.type == "cuda"
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if not any((d.text or "").strip() or d.qa_pairs for d in docs):
        raise ValueError(
            "No usable text: the documents of this job contain no text and no "
            "question-answer pairs to train on."
        )
    unknown = set(params) - _TRAIN_KEYS - set(DATASET_KEYS) - {REPLAY_KEY}
    if unknown:
        log.warning("Ignoring unknown training settings: %s", sorted(unknown))
    config = TrainConfig.from_dict({k: v for k, v in params.items() if k in _TRAIN_KEYS})
    if start_model is not None and (config.method != "full" or start_adapter is not None):
        raise ValueError("Only full fine-tuning can start from a previous version's model.")
    dataset_args = {k: params[k] for k in DATASET_KEYS if k in params}
    doc_ids = sorted([d.name, d.sha256, bool(d.qa_pairs)] for d in docs)
    data_key = _fingerprint(base_model, doc_ids, config.max_seq_len, config.seed, dataset_args)
    # start_adapter: a LoRA adapter folder (a previous version, worker/training/continued.py) whose
    # weights the training starts from instead of a fresh adapter.
    job_key = _fingerprint(data_key, config.to_dict(), str(start_adapter or ""))
    if start_model is not None:  # a merged model folder a full fine-tune starts from
        job_key = _fingerprint(job_key, "start_model", str(start_model))
    replay_n = int(params.get(REPLAY_KEY) or 0)
    if replay_n:
        job_key = _fingerprint(job_key, REPLAY_KEY, replay_n)

    result_path = workdir / "result.json"
    done = _read_json(result_path)
    if (
        done
        and done.get("key") == job_key
        and all(Path(p).is_file() for p in done["result"]["artifacts"].values())
    ):
        log.info("Job in %s already finished; returning its result.", workdir)
        return done["result"]

    hooks.on_phase("running", "Preparing the base model")
    model_dir = resolve_base_model(base_model, models_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    split = build_dataset(
        docs, tokenizer, max_seq_len=config.max_seq_len, seed=config.seed, **dataset_args
    )
    if not split.train_examples:
        raise ValueError(
            "No usable text to train on: after holding out text for scoring, nothing was "
            "left. Add more documents or question-answer pairs."
        )
    _check_cancel(hooks)
    streamed = Path(model_dir).is_dir() and should_stream(
        Path(model_dir), stream_base, device=dev
    )
    reader = None
    torch.manual_seed(config.seed)
    if streamed:  # larger than memory: the blocks stay on the disk (worker/training/streamed.py)
        log.info("Streaming the base model's blocks from the disk: %s", describe(model_dir))
        hooks.on_phase("running", "Preparing the base model (larger than memory: streamed)")
        reader = WeightsReader(Path(model_dir))
        model = load_unloaded_model(Path(model_dir), reader)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    scoring_budget = (budget_bytes or auto_budget_bytes(device=dev)) if streamed else 0
    # On a GPU the engine's page pool lives in (pinned) host memory: half of what is free.
    host_budget = auto_budget_bytes(device=torch.device("cpu")) if cuda else None
    # Every forward of a streamed model reads it whole: batches as large as memory allows.
    eval_batch = (
        eval_batch_size(model.config, scoring_budget, STREAMED_EVAL_BATCH) if streamed else 8
    )

    def score(m) -> dict:
        return evaluate(m, tokenizer, split, batch_size=eval_batch)

    with contextlib.ExitStack() as scoring:
        if streamed:
            scoring.enter_context(scoring_engine(
                model, reader, scoring_budget, Path(swap_dir or workdir / "swap"),
                dev if cuda else None, host_budget))
        cached = _read_json(workdir / "before.json")
        if cached and cached.get("key") == data_key:
            before = cached["scores"]
        else:
            hooks.on_phase("evaluating", f"Scoring before training ({len(split.probes)} probes)")
            before = score(model)
            _write_json(workdir / "before.json", {"key": data_key, "scores": before})
        _check_cancel(hooks)
        if replay_n:
            _add_replay(model, tokenizer, split, replay_n, config.max_seq_len, workdir,
                        data_key, hooks, eval_batch)
            _check_cancel(hooks)
        previous = None
        if start_adapter is not None:
            from worker.scoring.previous import score_previous

            previous = _previous_scores(
                workdir, job_key, hooks,
                lambda: score_previous(model, tokenizer, split, Path(start_adapter),
                                       lambda m, t, s: score(m)),
            )

    engine = EngineOptions(
        budget_bytes=budget_bytes,
        swap_dir=swap_dir,
        # LoRA reads the frozen base weights straight from the model's files (read-only).
        weights_files=sorted(Path(model_dir).glob("*.safetensors"))
        if Path(model_dir).is_dir()
        else [],
        init_weights=reader.init_weights if reader is not None else None,
        device=str(dev) if cuda else None,
        host_budget_bytes=host_budget,
    )
    if start_model is not None:
        # "before" (and the replay answers) came from the base model; from here on the model
        # is the previous version, which is scored and then trained further.
        hooks.on_phase("running", "Loading the previous version")
        if streamed:
            start_reader = WeightsReader(Path(start_model))
            load_resident_weights(model, start_reader)
            engine.init_weights = start_reader.init_weights
        else:
            from worker.training.continued import load_model_weights

            n_loaded = load_model_weights(model, Path(start_model))
            log.info("Starting from the previous version's model (%d tensors).", n_loaded)
        recipe = FineTuneRecipe(model, split.train_examples, config, workdir, hooks, pad_id,
                                engine)
    elif start_adapter is not None:
        from worker.training.continued import ContinuedRecipe

        recipe = ContinuedRecipe(Path(start_adapter), model, split.train_examples, config,
                                 workdir, hooks, pad_id, engine)
    else:
        recipe = FineTuneRecipe(model, split.train_examples, config, workdir, hooks, pad_id,
                                engine)
    recipe.setup()
    try:
        if start_model is not None:  # scored through the training engine, before it trains
            previous = _previous_scores(workdir, job_key, hooks, lambda: score(recipe.model))
        hooks.on_phase("running", "Training")
        started = time.perf_counter()
        # A streamed model stays in its engine for scoring and export.
        train_metrics = recipe.train(keep_engine=streamed)
        log.info("Training took %.1f s in this run.", time.perf_counter() - started)
        model = recipe.model  # in memory again, or still streamed by the open engine
        if not streamed:
            recipe.cleanup()

        _check_cancel(hooks)
        hooks.on_phase("evaluating", "Scoring after training")
        after = score(model)
        model.eval()
        export_source = StreamedSource(model, recipe.engine.engine) if streamed else None
        artifacts, export_errors, resolved = _export(
            model, tokenizer, recipe, config, dataset_args, docs, split, base_model,
            {"before": before, "after": after}
            | ({"previous": previous} if previous is not None else {}),
            workdir, export_source, hooks,
            # a streamed model is written in shards that fit the activations' share of the
            # budget (its page pool stays allocated meanwhile)
            scoring_budget // 8 if streamed else MAX_SHARD_BYTES,
        )
    finally:
        recipe.cleanup(restore=not streamed)

    result = {
        "params": resolved,
        "dataset": split.stats,
        # "previous": the version this job started from, on the same probes (incremental).
        "scores": {"before": before, "after": after}
        | ({"previous": previous} if previous is not None else {}),
        "artifacts": artifacts,
        "export_errors": export_errors,
        "metrics": {
            "train_seconds": train_metrics["train_seconds"],
            "tokens_per_s": train_metrics["tokens_per_s"],
            "final_loss": train_metrics["final_loss"],
            "steps": train_metrics["steps"],
            "tokens": train_metrics["tokens"],
        },
    }
    _write_json(result_path, {"key": job_key, "result": result})
    return result


def _export(model, tokenizer, recipe, config, dataset_args, docs, split, base_model, scores,
            workdir: Path, source, hooks: Hooks, max_shard_bytes: int
            ) -> tuple[dict, dict, dict]:
    """The model card and every download: (artifacts, export errors, resolved settings).
    `source`: the trained model tensor by tensor when it is streamed (else None: read from
    `model` in memory)."""
    _check_cancel(hooks)
    hooks.on_phase("running", "Exporting")
    resolved = (
        config.to_dict()
        | dataset_args
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
            "method": config.method,
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
        model, tokenizer, workdir / "exports", card, base_model_id=base_id, source=source,
        max_shard_bytes=max_shard_bytes,
    )
    return artifacts, export_errors, resolved
