"""The whole training pipeline on a tiny model: documents in, scores and downloads out."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from app.contract.scores import QUESTION_KINDS
from app.contract.training import LORA_LR_TWO_PASSES, chosen, default_params
from tests.worker.conftest_training import FACTS, tiny_model_dir
from worker.dataset.corpus import SourceDoc
from worker.jobs.pipeline import Cancelled, Hooks, run_pipeline

DOCS = [
    SourceDoc(
        name="heron.md",
        sha256="1" * 64,
        text="\n\n".join(
            f"Section {i}. {FACTS} Shipment {i} left dock {40 + i} on 2024-03-{10 + i:02d}."
            for i in range(6)
        ),
    ),
    SourceDoc(
        name="faq.csv",
        sha256="2" * 64,
        text="",
        qa_pairs=[
            ("What is the Heron invoice code?", "ZX-4471"),
            ("When are Heron payments due?", "On the 15th of each month."),
            ("Who manages Heron?", "Ada Quist"),
            ("What is Ada Quist's extension?", "5512"),
        ],
    ),
]


def params(**overrides) -> dict:
    """The Train button's defaults with these settings chosen (the step is left to the job:
    it sets LoRA's for two passes once the dataset is built)."""
    p = default_params(n_words=400, n_qa=4, method="lora")
    return chosen(
        p,
        {"epochs": 2, "max_seq_len": 48, "batch_size": 4, "checkpoint_every": 2, "max_probes": 6}
        | {"replay": 0}  # the replay test below turns it on
        # A share held out although the documents are short, for the held-out scores.
        | {"holdout_frac": 0.1}
        | overrides,
    )


class Recorder:
    """Hooks that remember what they were told, and cancel at a chosen step."""

    def __init__(self, cancel_at: int | None = None):
        self.phases: list[tuple[str, str]] = []
        self.progress: list[dict] = []
        self.settings: list[dict] = []
        self.cancel_at = cancel_at

    def hooks(self) -> Hooks:
        return Hooks(
            on_phase=lambda state, text: self.phases.append((state, text)),
            on_progress=self.progress.append,
            on_settings=self.settings.append,
            should_cancel=lambda: (
                self.cancel_at is not None
                and bool(self.progress)
                and self.progress[-1]["step"] >= self.cancel_at
            ),
        )


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer) -> Path:
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


@pytest.fixture(scope="module")
def lora_run(tiny_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora-job")
    rec = Recorder()
    result = run_pipeline(DOCS, params(), str(tiny_dir), workdir / "models", workdir, rec.hooks())
    return workdir, rec, result


def test_lora_pipeline_end_to_end(lora_run):
    workdir, rec, result = lora_run
    assert set(result) == {"params", "dataset", "scores", "artifacts", "export_errors", "metrics"}
    assert result["export_errors"] == {}
    p = result["params"]
    assert p["method"] == "lora" and p["seed"] == 0 and p["max_seq_len"] == 48
    # The step left to the job: set for its two passes before training, and said so.
    assert rec.settings == [{"learning_rate": LORA_LR_TWO_PASSES}]
    assert p["learning_rate"] == LORA_LR_TWO_PASSES and p["epochs"] == 2
    assert p["total_steps"] == result["metrics"]["steps"] == len(rec.progress) > 0
    assert result["dataset"]["n_train_examples"] > 0 and result["dataset"]["n_train_qa"] > 0
    phases = result["metrics"]["phase_s"]  # what the next estimates learn from
    assert set(phases) == {"before", "train", "after", "export"}
    assert all(s > 0 for s in phases.values())
    assert phases["train"] >= result["metrics"]["train_seconds"] * 0.9

    for when in ("before", "after"):
        scores = result["scores"][when]
        assert scores["n_probes"] > 0 and 0 <= scores["n_recalled"] <= scores["n_probes"]
        assert scores["perplexity"] > 1
        assert scores["qa"]["n"] == result["dataset"]["n_heldout_qa"]
        # Every fact asked in chat; the forward ones also as sentence completions.
        assert scores["questions"]["n"] >= scores["n_probes"]
        assert {q["kind"] for q in scores["questions"]["items"]} <= set(QUESTION_KINDS)
        assert scores["general"]["perplexity"] > 1  # the forgetting check ran
        assert scores["probe_set"] == result["scores"]["before"]["probe_set"]
    assert result["scores"]["after"]["perplexity"] != result["scores"]["before"]["perplexity"]

    assert [text for _, text in rec.phases] == [
        "Preparing the base model",
        f"Scoring before training ({result['scores']['before']['questions']['n']} questions)",
        "Training",
        "Scoring after training",
        "Exporting",
    ]
    assert {state for state, _ in rec.phases} == {"running", "evaluating"}
    last = rec.progress[-1]
    assert last["step"] == last["total_steps"] and last["eta_s"] == 0
    assert set(last) >= {"step", "total_steps", "loss", "tokens_per_s", "eta_s", "epoch"}
    m = result["metrics"]
    assert m["final_loss"] == last["loss"] and m["tokens_per_s"] > 0 and m["train_seconds"] > 0

    arts = result["artifacts"]
    assert set(arts) == {"adapter", "merged", "gguf-f16", "gguf-q8_0"}
    for path, must in (
        (arts["adapter"], "adapter_model.safetensors"),
        (arts["merged"], "model.safetensors"),
        (arts["gguf-f16"], "model-f16.gguf"),
        (arts["gguf-q8_0"], "Modelfile"),
    ):
        assert Path(path).parent == workdir / "exports"
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            assert must in names and "README.md" in names
            assert ("tokenizer.json" in names) == (not must.endswith((".gguf", "Modelfile")))
            card = zf.read("README.md").decode()
            assert "heron.md" in card and "1" * 64 in card
    stored = json.loads((workdir / "result.json").read_text())["result"]
    assert stored == json.loads(json.dumps(result))
    assert (workdir / "before.json").is_file()


def test_finished_job_returns_its_result(lora_run, tiny_dir):
    workdir, _, result = lora_run
    rec = Recorder()
    again = run_pipeline(DOCS, params(), str(tiny_dir), workdir / "models", workdir, rec.hooks())
    assert again == json.loads(json.dumps(result))
    assert rec.phases == [] and rec.progress == []


def test_cancelled_job_resumes_to_the_same_result(lora_run, tiny_dir, tmp_path):
    """Cancel mid-training, run again in the same workdir: the 'before' score is not redone,
    training resumes from the checkpoint, and everything matches the uninterrupted run."""
    _, _, straight = lora_run
    first = Recorder(cancel_at=3)
    with pytest.raises(Cancelled):
        run_pipeline(DOCS, params(), str(tiny_dir), tmp_path / "models", tmp_path, first.hooks())
    assert json.loads((tmp_path / "checkpoint" / "meta.json").read_text())["step"] == 3
    assert not (tmp_path / "exports").exists()

    second = Recorder()
    result = run_pipeline(
        DOCS, params(), str(tiny_dir), tmp_path / "models", tmp_path, second.hooks()
    )
    assert not any(text.startswith("Scoring before") for _, text in second.phases)
    assert [p["step"] for p in second.progress] == list(range(4, result["metrics"]["steps"] + 1))
    assert result["scores"] == straight["scores"]
    assert result["metrics"]["final_loss"] == straight["metrics"]["final_loss"]


def test_full_fine_tune_exports_merged_model(tiny_dir, tmp_path):
    result = run_pipeline(
        DOCS,
        params(method="full", learning_rate=1e-4, max_steps=2),
        str(tiny_dir),
        tmp_path / "models",
        tmp_path,
    )
    assert list(result["artifacts"]) == ["merged", "gguf-f16", "gguf-q8_0"]
    assert Path(result["artifacts"]["merged"]).is_file()
    assert result["metrics"]["steps"] == result["params"]["total_steps"] == 2


def test_no_usable_text_is_refused_in_words(tiny_dir, tmp_path):
    empty = [SourceDoc(name="blank.pdf", sha256="3" * 64, text="  \n ")]
    with pytest.raises(ValueError, match="No usable text"):
        run_pipeline(empty, params(), str(tiny_dir), tmp_path / "models", tmp_path)


def test_bad_settings_are_refused(tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="epochs"):
        run_pipeline(DOCS, params(epochs=500), str(tiny_dir), tmp_path / "models", tmp_path)


def test_documents_without_facts_still_get_a_score_card_that_says_why(tiny_dir, tmp_path):
    from app.contract.verdict import verdict

    plain = [
        SourceDoc(
            name="musings.txt",
            sha256="4" * 64,
            text="\n\n".join(
                "the weather was pleasant and everyone enjoyed a quiet walk by the river, "
                "talking about nothing much at all until the light began to fade."
                for _ in range(4)
            ),
        )
    ]
    result = run_pipeline(
        plain, params(max_steps=1, generated_qa=2), str(tiny_dir), tmp_path / "models", tmp_path
    )
    after = result["scores"]["after"]
    assert after["n_probes"] == 0 and after["questions"]["n"] == 0
    assert after["general"]["perplexity"] > 1  # the other scores are still there
    assert result["dataset"]["n_train_generated_qa"] == 0
    assert any("no recall score" in n for n in result["dataset"]["notes"])
    v = verdict(result["scores"]["before"], after, result["params"])
    assert v.level == "unmeasured" and "could not be measured" in v.headline
    assert "merged" in result["artifacts"]


def test_replay_adds_the_base_models_own_answers(tiny_dir, tmp_path):
    result = run_pipeline(
        DOCS, params(max_steps=1, replay=3), str(tiny_dir), tmp_path / "models", tmp_path
    )
    stats = result["dataset"]
    assert stats["n_train_replay"] == 3
    assert any("everyday questions" in n for n in stats["notes"])
    pairs = json.loads((tmp_path / "replay.json").read_text())["pairs"]
    assert len(pairs) == 3


def test_a_retrain_reuses_the_base_models_scores_and_another_base_does_not(
        tiny_dir, tmp_path, smol_tokenizer):
    """The "before" scores are filed under the dataset and the base model's weights: a second
    job on the same documents with other training settings takes them from the cache instead
    of scoring the base model again; another base model is scored."""
    from tests.worker.models import save_tiny_model

    cache = tmp_path / "before-scores"
    first, second, other = Recorder(), Recorder(), Recorder()
    a = run_pipeline(DOCS, params(), str(tiny_dir), tmp_path / "models", tmp_path / "a",
                     first.hooks(), scores_cache=cache)
    b = run_pipeline(DOCS, params(epochs=3, learning_rate=1e-3), str(tiny_dir),
                     tmp_path / "models", tmp_path / "b", second.hooks(), scores_cache=cache)
    scoring = [t for _s, t in first.phases if t.startswith("Scoring before training")]
    assert scoring and not [t for _s, t in second.phases
                            if t.startswith("Scoring before training")]
    assert any("the same as an earlier job's" in t for _s, t in second.phases)
    assert b["scores"]["before"] == a["scores"]["before"]
    assert len(list(cache.glob("*.json"))) == 1

    smol_tokenizer.save_pretrained(tmp_path / "tok")
    other_base = save_tiny_model(tmp_path / "other-base", tokenizer_dir=tmp_path / "tok", seed=9)
    run_pipeline(DOCS, params(), str(other_base), tmp_path / "models", tmp_path / "c",
                 other.hooks(), scores_cache=cache)
    assert [t for _s, t in other.phases if t.startswith("Scoring before training")]
    assert len(list(cache.glob("*.json"))) == 2
