"""app.contract is what both sides import: it pulls in neither side's heavy parts."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import app.contract
from tests.conftest import ROOT

FORBIDDEN = ("app.services", "app.routes", "app.models", "app.db", "worker", "offload", "torch",
             "transformers", "sqlalchemy", "fastapi", "celery")  # fmt: skip


def test_the_contract_imports_nothing_of_either_side():
    modules = [f"app.contract.{m.name}" for m in pkgutil.iter_modules(app.contract.__path__)]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True)  # fmt: skip
    loaded = json.loads(out.stdout)
    assert len(modules) >= 7
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
