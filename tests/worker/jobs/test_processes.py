"""A job trained on two data-parallel processes (torchrun, gloo) gives the one-process job's
result bit for bit, stops when cancelled, and after a lost process says so and goes on.
Full fine-tuning on several ranks is bitwise too: tests/offload/test_data_parallel.py."""

from __future__ import annotations

import os
import re
import signal

import psutil
import pytest

from tests.worker.conftest_training import tiny_model_dir
from tests.worker.jobs.test_pipeline import DOCS, Recorder, params
from worker.jobs.pipeline import Cancelled, run_pipeline

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

# Two micro-batches per step: one process runs them one after the other, two ranks one
# each, and the sum of two gradients is the same float in either order. Epochs enough for
# the ranks to be still training when the job's process (polling each second) cancels or
# kills one at step 3 (at 6 epochs, 24 steps, a fast CPU once finished first, 2026-12-05).
TWO_MICRO = {"batch_size": 2, "grad_accum": 2, "epochs": 12}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smol_tokenizer):
    return tiny_model_dir(tmp_path_factory, smol_tokenizer)


def _run(tiny_dir, workdir, rec, processes, parallel="data", **overrides):
    result = run_pipeline(DOCS, params(**TWO_MICRO, **overrides), str(tiny_dir),
                          workdir / "models", workdir, rec.hooks(), processes=processes,
                          parallel=parallel)
    return result | {"losses": {p["step"]: p["loss"] for p in rec.progress}}


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory):
    return _run(tiny_dir, tmp_path_factory.mktemp("one"), Recorder(), 1)


def _same_training(a: dict, b: dict) -> None:
    """The same weights: the same scores after training (perplexities to the last bit) and
    the same number of steps; the losses of every step this run reported equal to float32
    rounding. On an AMD EPYC every loss was the same bits too; on an Intel Xeon a step's
    reported loss depends on the thread count (the job's process computes with 2, each rank
    with 1; one process alone at 1 and at 2 threads: 7 of 24 steps' losses differ in the
    last bits, 2026-12-05) while the scores after training are the same bits; with
    OMP_NUM_THREADS=1 for both, every loss is equal too. With NEFTune's noise on the
    embeddings (the default LoRA job's; each row's noise is the same in any batch,
    tests/worker/test_noise.py) 3 of 39 steps' losses differed in the last bits on an AMD
    EPYC (2026-12-08) and the perplexity after by 8e-7 of itself; the other scores are the
    same."""
    assert b["losses"] and [pytest.approx(a["losses"][s], rel=1e-6) for s in b["losses"]] == [
        b["losses"][s] for s in b["losses"]]
    assert a["metrics"]["steps"] == b["metrics"]["steps"]
    after_a, after_b = dict(a["scores"]["after"]), dict(b["scores"]["after"])
    assert after_b.pop("perplexity") == pytest.approx(after_a.pop("perplexity"), rel=1e-6)
    assert after_a == after_b


def test_cancel_stops_the_processes_and_a_rerun_finishes_the_same(tiny_dir, tmp_path,
                                                                 one_process):
    cancel = Recorder(cancel_at=3)
    with pytest.raises(Cancelled, match="Cancelled at step"):
        _run(tiny_dir, tmp_path, cancel, 2)
    assert ("running", "Training on 2 processes") in cancel.phases
    assert cancel.progress[-1]["step"] < cancel.progress[-1]["total_steps"]
    assert (tmp_path / "checkpoint" / "meta.json").is_file()
    assert not _ranks_alive()
    rerun = Recorder()
    result = _run(tiny_dir, tmp_path, rerun, 2)
    _same_training(one_process, result)  # bit for bit, LoRA on two ranks
    assert rerun.progress[0]["step"] > 1  # from the checkpoint
    assert rerun.progress[-1]["loss"] == result["metrics"]["final_loss"]


def _ranks_alive() -> list[psutil.Process]:
    """This test process's live rank processes (other tests may leave zombies behind)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "worker.distributed.rank" in " ".join(
                    p.cmdline()):
                found.append(p)
        except psutil.Error:  # gone, or a zombie, meanwhile
            pass
    return found


class KillRank(Recorder):
    """At step `at`, SIGKILLs rank 1: a process (or its machine) lost mid-job."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.killed = at, None

    def hooks(self):
        hooks = super().hooks()
        record = hooks.on_progress

        def on_progress(info):
            record(info)
            if self.killed is None and info["step"] >= self.at:
                rank1 = [p for p in _ranks_alive() if p.environ().get("RANK") == "1"]
                assert rank1, f"rank 1 was gone at step {info['step']} of {info['total_steps']}"
                os.kill(rank1[0].pid, signal.SIGKILL)
                self.killed = rank1[0].pid

        hooks.on_progress = on_progress
        return hooks


@pytest.mark.parametrize("parallel", ["data", "pipeline"])
def test_a_lost_process_is_said_in_words_and_the_job_goes_on_from_its_checkpoint(
        tiny_dir, tmp_path, one_process, parallel):
    """Rank 1 killed at step 3: the job says so and starts the ranks again from the last
    checkpoint (a pipeline with its two stages again: here, both on this machine)."""
    rec = KillRank(at=3)
    result = _run(tiny_dir, tmp_path, rec, 2, parallel=parallel)
    assert rec.killed is not None and not _ranks_alive()
    said = [text for _, text in rec.phases if "lost" in text]
    assert len(said) == 1 and re.fullmatch(
        r"A training process or machine was lost during step \d+ of \d+: continuing from "
        r"the last checkpoint on this machine", said[0]), said
    _same_training(one_process, result)
    steps = [p["step"] for p in rec.progress]
    assert steps.count(1) == 1  # it went on from a checkpoint, not from the start
    assert set(steps) == set(range(1, result["metrics"]["steps"] + 1))


def test_a_pipeline_of_two_processes_trains_as_one_process(tiny_dir, tmp_path, one_process):
    """DOCTUNE_TRAIN_PARALLEL=pipeline: each process one stage (half of the blocks, paged by
    its own engine), GPipe between them; the job's own process takes the trained weights
    back from the checkpoint the stages wrote, scores and exports as after one process."""
    rec = Recorder()
    result = _run(tiny_dir, tmp_path, rec, 2, parallel="pipeline")
    assert ("running", "Training on 2 processes, a pipeline of 2 stages") in rec.phases
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir() if p.is_dir()) == [
        "stage0", "stage1"]
    assert rec.progress[-1]["telemetry"]["pipeline_parallel"] is True
    _same_training(one_process, result)
