#!/usr/bin/env bash
# The offload engine's CUDA checks, for a machine with a GPU (well under 5 minutes).
#
#   scripts/cuda_check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# Runs tests/offload/test_cuda.py (the engine on the GPU against plain torch on the GPU,
# peak GPU memory under a budget the training state exceeds, bytes moved) and
# tests/offload/test_device.py (the same control flow on the CPU, bit for bit), and
# tests/worker/jobs/test_cuda_job.py (whole jobs with DOCTUNE_DEVICE=cuda against the CPU; it
# needs the project's dependencies and the embedded model's wheel, else it is reported as
# a collection error while the engine's checks still run). The pytest
# output goes to stderr; stdout gets one JSON line: pass/fail/skip counts, the failures,
# the GPU, and what each CUDA test measured; "ok" only when all of it ran (a GPU) and
# passed. Exit status: pytest's, or 3 when the interpreter lacks what the tests import.
#
# The worker tests read SmolLM2's tokenizer from pytest's cache (.pytest_cache/d/, written by
# any local test run), so the cache provider stays on. On a GPU machine with torch but not
# the project's other dependencies, install their wheels first (PYTHONPATH), as was done for
# the first run on an NVIDIA H200 (2026-12-04: offload/README.md, "On a GPU").
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

if ! "$PY" -c "import torch, transformers, peft, pytest" 2>"$WORK/import.err"; then
  "$PY" - "$WORK/import.err" <<'PYEOF' || echo '{"ok": false, "error": "no usable python"}'
import json, sys
print(json.dumps({"ok": False, "error": "missing imports: " + open(sys.argv[1]).read()[-500:]}))
PYEOF
  exit 3
fi

export OFFLOAD_CUDA_REPORT="$WORK/measured.jsonl"
START=$(date +%s)
timeout 280 "$PY" -m pytest -q -o addopts="" -rfEs --continue-on-collection-errors \
  --junitxml="$WORK/junit.xml" tests/offload/test_cuda.py tests/offload/test_device.py tests/worker/jobs/test_cuda_job.py >&2
RC=$?
END=$(date +%s)

"$PY" - "$WORK" "$RC" "$((END - START))" <<'PYEOF'
import json, os, sys
import xml.etree.ElementTree as ET

import torch

work, rc, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = {
    "ok": rc == 0,
    "pytest_exit": rc,
    "seconds": seconds,
    "torch": torch.__version__,
    "transformers": __import__("transformers").__version__,
    "cuda_available": torch.cuda.is_available(),
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
}
counts = {"passed": 0, "failed": 0, "skipped": 0}
failures = []
try:
    for case in ET.parse(os.path.join(work, "junit.xml")).getroot().iter("testcase"):
        name = case.get("classname", "").rsplit(".", 1)[-1] + "::" + case.get("name", "")
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append({"test": name, "message": (bad.get("message") or "")[:400]})
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
except (OSError, ET.ParseError) as exc:
    out["error"] = f"no junit report ({exc}); timed out?" if rc == 124 else str(exc)
out.update(counts)
out["ok"] = rc == 0 and out["cuda_available"] and counts["skipped"] == 0  # all of it ran
out["failures"] = failures
measured = os.path.join(work, "measured.jsonl")
if os.path.exists(measured):
    out["measured"] = [json.loads(line) for line in open(measured) if line.strip()]
print(json.dumps(out))
PYEOF
exit $RC
