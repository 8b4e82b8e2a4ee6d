"""A job on a base model larger than its memory budget, through the real `doctune train`.

Builds a Llama-shaped model with random weights and SmolLM2's tokenizer (`--hidden`,
`--layers`), saves it as a normal Hugging Face folder, and runs `doctune train` on the
Northwind fixture corpus (tests/fixtures/docs.py) in a fresh data dir with
DOCTUNE_STREAM_BASE_MODEL=always and DOCTUNE_OFFLOAD_BUDGET_MB=`--budget-mb`, in a child
process whose peak RSS is read from the kernel (its VmHWM, reported as it exits). Prints the figures, a JSON
line last. The model's random weights learn nothing: this measures memory and time, the
scores are only there to show every phase ran.

    .venv/bin/python -m scripts.experiments.streamed_job --method full --max-steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# `doctune train` in a child that reports its own peak RSS (VmHWM) when it exits. Not the
# parent's ru_maxrss for children: a child forked from this process (which built the model)
# starts out counting the parent's pages, so that figure holds the parent's size.
_REPORT_PEAK = """
import atexit, runpy, sys
def _report():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write("DOCTUNE_VMHWM " + line.split()[1] + "\\n")
atexit.register(_report)
sys.argv = ["doctune"] + sys.argv[1:]
runpy.run_module("worker.cli", run_name="__main__")
"""


def build_model(out: Path, hidden: int, layers: int) -> Path:
    """A random Llama `hidden` wide and `layers` deep (the tests' tiny model factory, scaled
    up) with SmolLM2's tokenizer, saved to `out`."""
    from tests.worker.models import save_tiny_model

    return save_tiny_model(
        out,
        seed=0,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=4,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--budget-mb", type=int, default=512)
    ap.add_argument("--method", choices=["lora", "full"], default="full")
    ap.add_argument("--max-steps", type=int, default=2)
    ap.add_argument("--stream", choices=["always", "never"], default="always")
    args = ap.parse_args()

    from tests.fixtures.docs import write_sample_corpus
    from worker.training.base_model import fp32_load_bytes

    root = Path(tempfile.mkdtemp(prefix="doctune-streamed-"))
    started = time.perf_counter()
    model_dir = build_model(root / "model", args.hidden, args.layers)
    weights = fp32_load_bytes(model_dir)
    docs = root / "docs"
    docs.mkdir()
    write_sample_corpus(docs)
    env = os.environ | {
        "DOCTUNE_DATA_DIR": str(root / "data"),
        "DOCTUNE_BASE_MODEL": str(model_dir),
        "DOCTUNE_STREAM_BASE_MODEL": args.stream,
        "DOCTUNE_OFFLOAD_BUDGET_MB": str(args.budget_mb),
    }
    cmd = [
        sys.executable,
        "-c",
        _REPORT_PEAK,
        "train",
        str(docs),
        "--method",
        args.method,
        "--max-steps",
        str(args.max_steps),
        "--json",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    job_s = time.perf_counter() - t0
    peaks = [ln.split()[1] for ln in proc.stderr.splitlines() if ln.startswith("DOCTUNE_VMHWM")]
    peak = int(peaks[-1]) * 1024 if peaks else None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"doctune train failed ({proc.returncode})")
    result = json.loads(lines[-1])
    scores = result.get("scores") or {}
    out = {
        "method": args.method,
        "stream": args.stream,
        "params_m": round(weights / 4 / 1e6, 1),
        "fp32_weights_gb": round(weights / 1e9, 2),
        "training_state_gb": round(weights * (4 if args.method == "full" else 1) / 1e9, 2),
        "budget_mb": args.budget_mb,
        "peak_rss_gb": round(peak / 1e9, 2) if peak else None,
        "job_s": round(job_s, 1),
        "state": result.get("state"),
        "steps": (result.get("params") or {}).get("total_steps"),
        "artifacts": sorted(result.get("artifacts") or {}),
        "general_ppl_before": ((scores.get("before") or {}).get("general") or {}).get("perplexity"),
        "setup_s": round(t0 - started, 1),
    }
    for k, v in out.items():
        print(f"{k:>20}: {v}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
