"""Incremental training: a new version starts from the previous version's adapter, or for a
full fine-tune from its merged model (checked on the weights themselves), and trains on the
new documents plus a replay sample of the old.

The jobs run in this process through the same services and worker code as the web path
(the INLINE session mark hands queued tasks back instead of sending them), on the tiny
random model the app tests use as base model."""

from __future__ import annotations

import io
import json
import time
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from app.contract.tasks import INGEST_TASK, TRAIN_TASK
from app.contract.training import chosen
from app.db import session_scope
from app.models import Job, JobState, Project
from app.queue import INLINE
from app.services.documents import register_uploads
from app.services.jobs import create_job
from app.services.projects import create_project
from app.services.uploads import receive_local_file
from app.settings import settings
from tests.fixtures import docs as fx
from worker.errors import UserFacingError
from worker.ingest import ingest_document
from worker.jobs.inputs import plan_inputs, replay_plan
from worker.jobs.run import job_workdir, run_job
from worker.training.continued import (
    adapter_settings,
    adapter_start,
    load_model_weights,
    unpack_model,
)
from worker.training.recipe import EngineOptions, FineTuneRecipe, TrainConfig

FACTS = [
    "The Northwind warranty lasts 36 months from the date of delivery.",
    "Part NW-4471 ships from the Lyon warehouse within 2 working days.",
    "Support tickets marked urgent are answered within 4 hours by Dana Whitfield.",
]
NEW_FACTS = [
    "The Kelmscott Ridge showroom opens on 14 June with 12 staff.",
    "The Gale Fan Mk III draws 38 watts at full speed.",
]


def test_replay_plan_takes_every_new_document_and_a_sample_of_the_old():
    sources = [{"id": i, "new": i >= 20} for i in range(24)]  # 20 old, 4 new
    ids, replay = replay_plan(sources, seed=7)
    assert set(range(20, 24)) <= set(ids)
    assert len(replay) == 5 and set(replay) <= set(range(20))  # 25% of 20, more than 4 new
    assert replay_plan(sources, seed=7) == (ids, replay)  # a resumed job draws the same
    assert replay_plan(sources, seed=8)[1] != replay
    few_old = [{"id": 1, "new": False}, {"id": 2, "new": True}, {"id": 3, "new": True}]
    assert replay_plan(few_old, seed=0) == ([1, 2, 3], [1])
    nothing_new = [{"id": 1, "new": False}, {"id": 2, "new": False}]
    assert replay_plan(nothing_new, seed=0) == ([1, 2], [])


def _examples(tokenizer, n: int = 6) -> list[dict]:
    out = []
    for i in range(n):
        ids = tokenizer(f"{FACTS[i % 3]} Example {i}.")["input_ids"]
        out.append({"input_ids": ids, "labels": list(ids)})
    return out


def _lora_state(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


@pytest.mark.parametrize("engine", ["memory", "offload"])
def test_a_continued_recipe_starts_from_the_previous_adapter(
    tiny_model, smol_tokenizer, tmp_path, engine
):
    import copy

    config = TrainConfig(
        method="lora", epochs=1, learning_rate=5e-3, lora_rank=4, batch_size=2, max_steps=3
    )

    def options(name: str) -> EngineOptions:  # one swap folder per engine
        return EngineOptions(kind=engine, swap_dir=tmp_path / name / "swap")

    first = FineTuneRecipe(
        copy.deepcopy(tiny_model),
        _examples(smol_tokenizer),
        config,
        tmp_path / "v1",
        engine=options("v1"),
    )
    first.setup()
    first.train()
    previous = _lora_state(first.model)
    first.model.save_pretrained(tmp_path / "adapter")
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 1e-4 for k, v in previous.items())

    fresh = FineTuneRecipe(
        copy.deepcopy(tiny_model),
        _examples(smol_tokenizer),
        config,
        tmp_path / "fresh",
        engine=options("fresh"),
    )
    fresh.setup()
    started = FineTuneRecipe(
        copy.deepcopy(tiny_model),
        _examples(smol_tokenizer),
        config,
        tmp_path / "v2",
        engine=options("v2"),
        start_weights=adapter_start(tmp_path / "adapter"),
    )
    started.setup()
    try:
        start = _lora_state(started.model)
        assert started.loaded_tensors == len(previous) > 0
        assert start.keys() == previous.keys()
        for key, value in previous.items():
            assert torch.equal(start[key], value), key
        fresh_b = [v for k, v in _lora_state(fresh.model).items() if k.endswith("lora_B.weight")]
        assert all(torch.count_nonzero(v) == 0 for v in fresh_b)  # what "from base" starts at
    finally:
        started.cleanup(remove_checkpoint=True)
        fresh.cleanup(remove_checkpoint=True)
        first.cleanup(remove_checkpoint=True)


@pytest.mark.parametrize(
    ("targets", "expected"),
    [
        (["down_proj", "up_proj", "gate_proj"], "mlp"),  # peft writes them in any order
        (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], "all"),
        (["o_proj", "v_proj", "q_proj", "k_proj"], "attention"),
    ],
)
def test_a_continued_adapter_keeps_its_rank_alpha_and_projections(tmp_path, targets, expected):
    config = {"r": 8, "lora_alpha": 16, "target_modules": targets}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    assert adapter_settings(tmp_path) == {
        "lora_rank": 8,
        "lora_alpha": 16.0,
        "lora_modules": expected,
    }


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], "q_proj", [], None])
def test_an_adapter_on_projections_no_job_trains_is_refused_in_plain_words(tmp_path, targets):
    config = {"r": 8, "lora_alpha": 16, "target_modules": targets}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(UserFacingError, match="Start from the base model"):
        adapter_settings(tmp_path)


# --- the whole path: job rows, worker code, exports ---------------------------------------


def _run_inline(tasks: list) -> None:
    for task, args in tasks:
        if task == INGEST_TASK:
            ingest_document(*args)
        elif task == TRAIN_TASK:
            assert run_job(*args, node="test-incremental") == JobState.done


def _add_files(project_id: int, paths: list[Path]) -> None:
    tasks: list = []
    with session_scope() as session:
        session.info[INLINE] = tasks
        received = [
            receive_local_file(
                p, dest_dir=settings.documents_dir, max_file_bytes=settings.max_upload_bytes
            )
            for p in paths
        ]
        register_uploads(session, session.get(Project, project_id), received)
    _run_inline(tasks)


def _train(project_id: int, extra: dict, method: str = "lora") -> Job:
    tasks: list = []
    with session_scope() as session:
        session.info[INLINE] = tasks
        job = create_job(session, session.get(Project, project_id), {"method": method})
        job.params = chosen(job.params, extra)  # as chosen in Advanced: not the dataset's
        job_id = job.id
    _run_inline(tasks)
    with session_scope() as session:
        return session.get(Job, job_id)


def _adapter(job: Job) -> dict[str, torch.Tensor]:
    with zipfile.ZipFile(settings.data_path(job.artifacts["adapter"])) as zf:
        name = next(n for n in zf.namelist() if n.endswith("adapter_model.safetensors"))
        return load_safetensors(io.BytesIO(zf.read(name)).getvalue())


def test_the_next_version_continues_the_current_one_on_new_and_replayed_documents(
    migrated_db, tiny_base_model, tmp_path
):
    with session_scope() as session:
        project_id = create_project(session, f"Incremental {time.monotonic_ns()}").id
    fx.make_txt(tmp_path / "facts.txt", FACTS * 4)
    _add_files(project_id, [tmp_path / "facts.txt"])
    v1 = _train(
        project_id,
        {"max_steps": 4, "learning_rate": 5e-3, "lora_rank": 4, "lora_modules": "mlp", "seed": 1},
    )
    assert v1.state == JobState.done and v1.parent_job_id is None, v1.error
    # An adapter on the MLP only exports like any other: adapter, merged model, GGUF.
    assert not v1.export_errors and {"adapter", "merged"} <= set(v1.artifacts), v1.export_errors
    assert any(kind.startswith("gguf") for kind in v1.artifacts), sorted(v1.artifacts)

    fx.make_txt(tmp_path / "new.txt", NEW_FACTS * 4)
    _add_files(project_id, [tmp_path / "new.txt"])
    # One step at the smallest learning rate: v2's adapter must still be v1's, give or take
    # one tiny step, if (and only if) it started from v1's weights. Its own default rank (16)
    # and projections (all seven) give way to v1's (4, the MLP's three): a continued adapter
    # keeps its shape.
    v2 = _train(project_id, {"max_steps": 1, "learning_rate": 1e-6})
    assert v2.state == JobState.done, v2.error
    assert v2.parent_job_id == v1.id
    with session_scope() as session:
        assert session.get(Project, project_id).current_job_id == v2.id  # the new one is in use
    assert {s["name"]: (s["new"], s["role"]) for s in v2.sources} == {
        "facts.txt": (False, "replay"),
        "new.txt": (True, "new"),
    }
    assert (v2.params["lora_rank"], v2.params["lora_modules"]) == (4, "mlp")
    before, after = _adapter(v1), _adapter(v2)
    assert before.keys() == after.keys()
    assert {k.split(".")[-3] for k in before} == {"gate_proj", "up_proj", "down_proj"}
    moved = max((after[k] - before[k]).abs().max().item() for k in before)
    spread = max(before[k].abs().max().item() for k in before if "lora_B" in k)
    assert moved < 1e-5 < spread  # started at v1's weights, which are far from a fresh start
    # The score card can compare with the base model and with the previous version.
    assert set(v2.scores) >= {"before", "previous", "after"}
    assert v2.scores["previous"]["n_probes"] == v2.scores["after"]["n_probes"]


def _merged(job: Job) -> dict[str, torch.Tensor]:
    with zipfile.ZipFile(settings.data_path(job.artifacts["merged"])) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".safetensors"))
        return load_safetensors(zf.read(name))


def test_a_full_fine_tune_continues_the_previous_full_version_from_its_merged_weights(
    migrated_db, tiny_base_model, tmp_path
):
    from transformers import AutoModelForCausalLM

    with session_scope() as session:
        project_id = create_project(session, f"Full incremental {time.monotonic_ns()}").id
    fx.make_txt(tmp_path / "facts.txt", FACTS * 4)
    _add_files(project_id, [tmp_path / "facts.txt"])
    v1 = _train(project_id, {"max_steps": 4, "learning_rate": 5e-3, "seed": 1}, "full")
    assert v1.state == JobState.done and v1.parent_job_id is None, v1.error
    assert "previous" not in v1.scores

    fx.make_txt(tmp_path / "new.txt", NEW_FACTS * 4)
    _add_files(project_id, [tmp_path / "new.txt"])
    v2 = _train(project_id, {"max_steps": 1, "learning_rate": 1e-6}, "full")
    assert v2.state == JobState.done, v2.error
    assert v2.method == "full" and v2.parent_job_id == v1.id
    assert {s["name"]: (s["new"], s["role"]) for s in v2.sources} == {
        "facts.txt": (False, "replay"),
        "new.txt": (True, "new"),
    }

    # The starting weights: v1's merged model, unpacked for v2 and loaded into the base model
    # (tied output layer included), equals v1's weights exactly and not the base model's.
    base = AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32)
    base_weights = {k: v.clone() for k, v in base.state_dict().items()}
    v1_weights = _merged(v1)
    assert load_model_weights(base, job_workdir(v2.id) / "start_model") == len(v1_weights)
    start = base.state_dict()
    for key, value in v1_weights.items():
        assert torch.equal(start[key], value), key
    spread = max((v1_weights[k] - base_weights[k]).abs().max().item() for k in v1_weights)
    # One step at the smallest learning rate: v2 is still v1, give or take that tiny step, if
    # (and only if) it started from v1's weights, which are far from the base model's.
    v2_weights = _merged(v2)
    assert v2_weights.keys() == v1_weights.keys()
    moved = max((v2_weights[k] - v1_weights[k]).abs().max().item() for k in v1_weights)
    assert moved < 1e-5 < spread
    # The score card compares with the base model and with the previous version.
    assert set(v2.scores) >= {"before", "previous", "after"}
    assert v2.scores["previous"]["n_probes"] == v2.scores["after"]["n_probes"]
    assert v2.scores["previous"] != v2.scores["before"]


def test_a_start_model_of_another_shape_is_refused_in_plain_words(tiny_model, tmp_path):
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=tiny_model.config.vocab_size, hidden_size=32,
                    intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2)
    )
    other.save_pretrained(tmp_path / "other")
    model = copy.deepcopy(tiny_model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit the base model"):
        load_model_weights(model, tmp_path / "other")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    with pytest.raises(ValueError, match="no weights"):
        load_model_weights(model, tmp_path)  # an empty folder

    tiny_model.save_pretrained(tmp_path / "same")  # the same shape loads
    assert load_model_weights(model, tmp_path / "same") == len(model.state_dict())


def test_unpacking_a_merged_model_uses_no_path_from_the_zip(tmp_path):
    made = tmp_path / "merged.zip"
    with zipfile.ZipFile(made, "w") as zf:
        zf.writestr("../../escape.safetensors", b"weights")
        zf.writestr("/abs/config.json", b"{}")
        zf.writestr("README.md", b"card")
        zf.writestr("tokenizer.json", b"{}")
    dest = tmp_path / "job" / "start_model"
    dest.mkdir(parents=True)
    (dest / "stale.safetensors").write_bytes(b"from an earlier run")
    assert unpack_model(made, dest) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "escape.safetensors"]
    assert (dest / "escape.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / "escape.safetensors").exists()
    assert not any(tmp_path.parent.glob("escape.safetensors"))

    no_weights = tmp_path / "no-weights.zip"
    with zipfile.ZipFile(no_weights, "w") as zf:
        zf.writestr("config.json", b"{}")
    with pytest.raises(ValueError, match="no weights"):
        unpack_model(no_weights, dest)
    twice = tmp_path / "twice.zip"
    with zipfile.ZipFile(twice, "w") as zf:
        zf.writestr("a/model.safetensors", b"1")
        zf.writestr("b/model.safetensors", b"2")
    with pytest.raises(ValueError, match="two files named model.safetensors"):
        unpack_model(twice, dest)


def test_retrain_from_base_starts_a_fresh_adapter_on_every_document(migrated_db, tmp_path):
    with session_scope() as session:
        project = create_project(session, f"From base {time.monotonic_ns()}")
        project.start_from = "base"
        project_id = project.id
    fx.make_txt(tmp_path / "facts.txt", FACTS * 4)
    fx.make_txt(tmp_path / "new.txt", NEW_FACTS * 4)
    _add_files(project_id, [tmp_path / "facts.txt"])
    with session_scope() as session:
        project = session.get(Project, project_id)
        done = Job(
            project=project,
            state=JobState.done,
            method="lora",
            sources=[
                {"id": d.id, "name": d.original_name, "sha256": d.sha256} for d in project.documents
            ],
            artifacts={"adapter": str(tmp_path / "missing.zip")},
        )
        session.add(done)
    _add_files(project_id, [tmp_path / "new.txt"])
    with session_scope() as session:
        session.info[INLINE] = []
        job = create_job(session, session.get(Project, project_id), {"method": "lora"})
        assert job.parent_job_id is None
        plan = plan_inputs(session, job, tmp_path / "job")
        assert plan.start_adapter is None and plan.params == {}
        assert sorted(plan.doc_ids) == sorted(s["id"] for s in job.sources)
        assert len(plan.doc_ids) == 2
        session.info[INLINE].clear()
        session.rollback()


@pytest.mark.parametrize("method, kind", [("lora", "adapter"), ("full", "merged")])
def test_a_parent_without_its_adapter_falls_back_to_the_base_model(
    migrated_db, tmp_path, method, kind
):
    with session_scope() as session:
        project = create_project(session, f"Lost {kind} {time.monotonic_ns()}")
        project_id = project.id
    fx.make_txt(tmp_path / "facts.txt", FACTS * 4)
    _add_files(project_id, [tmp_path / "facts.txt"])
    with session_scope() as session:
        project = session.get(Project, project_id)
        session.add(
            Job(
                project=project,
                state=JobState.done,
                method=method,
                sources=[],
                artifacts={kind: str(tmp_path / "gone.zip")},
            )
        )
        session.flush()
        session.info[INLINE] = []
        job = create_job(session, project, {"method": method})
        assert job.parent_job_id is not None  # planned as a continuation...
        plan = plan_inputs(session, job, tmp_path / "job")
        # ...but the adapter (or merged model) file is gone: from the base model
        assert plan.start_adapter is None and plan.start_model is None
        assert plan.doc_ids == [s["id"] for s in job.sources]
        session.info[INLINE].clear()
        session.rollback()
