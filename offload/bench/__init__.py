"""python -m offload.bench: the disk's own limits, and what the engine makes of them.

Sections, in one run (--only picks some; --skip-headline drops the long one):
  disk        sequential write, then read, of a --disk-gib GiB file through the engine's
              own I/O path (O_DIRECT when the directory allows it; 1 MiB pwritev/preadv
              from 8 and from 16 threads), --disk-repeats times each, at the start and
              again at the end of the run: the limits are the best of all of them.
  lora        LoRA (rank 16 on every projection, the recipe's default) of SmolLM2-135M
              (--model-dir; a random model of its shape without one): plain peft in memory
              against the engine with the frozen base streamed from model.safetensors.
  full        full fine-tune of the same model: in memory against the engine with every
              block streamed (weights, Adam m and v, spilled gradients in the swap).
  checkpoint  save_checkpoint and load_checkpoint of that full fine-tune's state (on the
              swap's filesystem: the swap files are renamed into the checkpoint), and the
              copy a save makes to another filesystem.
  headline    a ~2B-parameter Llama-shaped model built from a config on the meta device
              and created block by block in the swap (random weights, never whole in
              memory), fully fine-tuned (AdamW, fp32) under a 4 GiB budget for a few
              steps, in a fresh process so its peak RSS is its own. Its swap files are
              removed afterwards, on failure and Ctrl-C too; it writes no checkpoint.

Both sides of a comparison use the recipe's arithmetic (AdamW, clipping at 1.0, 1-D
parameters not decayed) on the same batches, and their losses are compared bit for bit.
Timing: in-memory and engine steps alternate (A B A B ...), so both see the same load on
a shared machine; the first pair is a warm-up; ratios are medians over the other pairs.
I/O rates are bytes over the time transfers were in flight ("while streaming").

Prints a table, then one JSON line with every figure (the last line).

transformers and peft are imported inside the functions that build models: they are
this command's dependencies, not the library's (offload/ imports torch and the standard
library only, see tests/offload/test_boundaries.py), so `import offload.bench` (the
machine profile's disk_bench) stays torch-only.

Modules: disk (the disk's limits), compare (in memory against the engine, checkpoints),
headline (the 2B model, in its own process), report (the table and targets), common (what
they share), __main__ (the arguments and the run).
"""

from .disk import disk_bench

__all__ = ["disk_bench"]
