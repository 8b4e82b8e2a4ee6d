"""The worker side: Celery tasks and everything they run, one folder per stage, in the order
data flows through a job.

- `extract/`  one reader per document format (PDF, Word, mail, ...), behind `extract()`
- `dataset/`  chunks, hold-out split, training examples, probes, practice questions, replay
- `training/` the recipe, its engines (in memory and through `offload/`), the base model,
              streamed base models, continued versions, the machine profile
- `scoring/`  the before/after measurements of the score card
- `export/`   the downloads: model card, adapter / merged zips, GGUF, tensor sources
- `jobs/`     one job from start to end: its inputs, its phases, its database row
- `cli/`      the `doctune` command and headless runs

`tasks.py` names the Celery tasks, `celery_app.py` configures the worker, `ingest.py` turns
an uploaded file into a document row's text, `reconcile.py` requeues orphaned jobs.
"""

import os

# transformers (5.x) kernelizes a model loaded with its defaults when it is put in training
# mode on a GPU, fetching "hub kernels" (compiled code) from the Hugging Face Hub: DocTune
# never downloads at run time, and offline that fetch fails the job. Found by
# scripts/cuda_check.sh on an H200; a user who wants them can set USE_HUB_KERNELS=YES.
os.environ.setdefault("USE_HUB_KERNELS", "NO")
