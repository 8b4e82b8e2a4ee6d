"""The downloads a finished job can offer: the worker makes them, the web app serves them.
`Job.artifacts` and `Job.export_errors` are keyed by these kinds."""

from __future__ import annotations

ADAPTER = "adapter"  # the LoRA adapter (LoRA jobs only)
MERGED = "merged"  # the whole model with the training built in
GGUF_F16 = "gguf-f16"
GGUF_Q8_0 = "gguf-q8_0"

# In the order the worker makes them.
KINDS = (ADAPTER, MERGED, GGUF_F16, GGUF_Q8_0)

