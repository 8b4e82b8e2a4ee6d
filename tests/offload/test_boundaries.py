"""offload/ is an independent library: torch and the standard library only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import offload

PKG = Path(offload.__file__).parent


def test_offload_imports_only_torch_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"torch", "offload", "__future__"}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_front_door_exports():
    for name in offload.__all__:
        assert hasattr(offload, name), name
    assert {
        "OffloadEngine",
        "OffloadConfig",
        "AdamWConfig",
        "plan",
        "Plan",
        "OffloadDiskFullError",
        "probe_o_direct",
    } <= set(offload.__all__)
