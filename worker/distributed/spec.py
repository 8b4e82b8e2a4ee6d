"""What a job hands its training ranks: one JSON file the parent writes and every rank reads.

The ranks rebuild the very model and recipe the parent would have trained in-process: the
same model folder loaded the same way, the same examples (written next to the spec), the
same TrainConfig and start weights. Rank 0's checkpoint in `workdir` is the hand-back: the
parent resumes from it at the last step (worker/jobs/pipeline.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from worker.files import write_json_atomic


@dataclass
class RankSpec:
    model_dir: str  # loaded whole in every rank (a streamed base trains in one process)
    weights_files: list[str]  # its *.safetensors: LoRA streams the frozen base from them
    device: str  # "cpu" | "cuda" (each rank takes the GPU of its LOCAL_RANK)
    config: dict  # TrainConfig.to_dict()
    pad_token_id: int
    workdir: str  # the job's folder: the checkpoint, shared by the ranks
    swap_root: str  # each rank pages under swap_root/rank<N> (local disk)
    budget_bytes: int  # memory each rank's engine may use
    threads: int  # torch threads per rank
    # "data" or "pipeline" (worker/training/pipelined.py), and for a pipeline how many ranks
    # every machine that joins runs (the stages are fixed for the run: its checkpoint has
    # one part per stage).
    parallel: str = "data"
    node_ranks: int = 0
    start_adapter: str | None = None
    start_model: str | None = None
    # The job's process: when it is gone (its worker was killed), rank 0 (on that machine)
    # stops the ranks at the next step, after a checkpoint, instead of training on for nobody.
    parent_host: str | None = None
    parent_pid: int | None = None

    @property
    def folder(self) -> Path:
        return Path(self.workdir) / "ranks"

    @property
    def examples_path(self) -> Path:
        return self.folder / "examples.json"

    @property
    def progress_path(self) -> Path:
        """Rank 0's progress, one JSON object per optimizer step."""
        return self.folder / "progress.jsonl"

    @property
    def cancel_path(self) -> Path:
        """Present: the job was cancelled; rank 0 sees it before the next step."""
        return self.folder / "cancel"

    def write(self, examples: list[dict]) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in (self.progress_path, self.cancel_path):
            stale.unlink(missing_ok=True)
        rows = [{"input_ids": list(ex["input_ids"]), "labels": list(ex["labels"])}
                for ex in examples]
        write_json_atomic(self.examples_path, rows)
        path = self.folder / "spec.json"
        write_json_atomic(path, asdict(self))
        return path

    @classmethod
    def read(cls, path: Path) -> RankSpec:
        return cls(**json.loads(Path(path).read_text()))

    def examples(self) -> list[dict]:
        return json.loads(self.examples_path.read_text())
