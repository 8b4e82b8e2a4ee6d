"""offload/ is an independent library: torch, xxhash and the standard library only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import offload

PKG = Path(offload.__file__).parent


# The benchmark command (the package offload/bench/) builds real models to measure the engine
# with: it may import these inside its functions, never at module level, so the library and
# `import offload.bench` (worker/training/machine_profile.py uses its disk_bench) stay torch-only.
BENCH_ONLY = {"transformers", "peft"}


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0:
        return [node.module or ""]
    return []


# xxhash: the KV cache's per-layer checksums (offload/kvcache/_blockfile.py); zlib's crc32
# took 0.05 s more of a 4k-token restore's 0.12 s on 2 cores (the data fresh from the disk,
# not in the CPU's cache: xxh3 reads it at memory speed, crc32 at 1-2 GB/s).
def test_offload_imports_only_torch_xxhash_and_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"torch", "xxhash", "offload", "__future__"}
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        in_functions: set[int] = set()
        if PKG / "bench" in path.parents:
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    in_functions |= {id(n) for n in ast.walk(fn)}
        for node in ast.walk(tree):
            ok = allowed | BENCH_ONLY if id(node) in in_functions else allowed
            for name in _imports(node):
                assert name.split(".")[0] in ok, f"{path.name} imports {name}"


def test_import_offload_bench_loads_neither_transformers_nor_peft():
    code = (
        "import sys; from offload.bench import disk_bench; "
        "print(sorted(m for m in ('transformers', 'peft') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PKG.parent
    )
    assert out.stdout.strip() == "[]"


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
