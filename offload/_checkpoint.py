"""Checkpoints: copies of the swap files, the resident state, and a manifest naming them.

Atomicity comes from the manifest: every data file is written under a new generation
name, fsynced, and only then does manifest.json (written to a temp file, fsynced,
renamed over the old one) start pointing at it. A crash or a full disk before that
rename leaves the old manifest and the old files untouched; the new files are removed
(or, after a crash, swept by the next save). Old generations are deleted only after the
new manifest is durable.

Layout of a checkpoint directory:
  manifest.json                 format, generation, step, layout signature, file list
  weight.000003.bin             copy of the weights swap file (full fine-tuning)
  exp_avg.000003.bin            Adam m, exp_avg_sq.000003.bin Adam v
  resident.000003.bin           resident trainable parameters and their Adam m and v,
                                and the CPU RNG state, back to back (offsets in manifest)
"""

from __future__ import annotations

import errno
import json
import os
from typing import TYPE_CHECKING

import torch

from ._io import OffloadDiskFullError, OffloadError, byte_view, is_disk_full
from ._layout import EXP_AVG, EXP_AVG_SQ, WEIGHT

if TYPE_CHECKING:
    from .engine import OffloadEngine

FORMAT = 1
MANIFEST = "manifest.json"
_COPY_FALLBACK = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        n = os.write(fd, data[done:])
        if n == 0:
            raise OSError(errno.ENOSPC, "write made no progress")
        done += n


def _copy_range(src: str, dst_fd: int, nbytes: int) -> None:
    """Copy the first `nbytes` of `src` into dst_fd at offset 0 (in-kernel when possible)."""
    sfd = os.open(src, os.O_RDONLY)
    try:
        off = 0
        use_kernel = hasattr(os, "copy_file_range")
        while off < nbytes:
            if use_kernel:
                try:
                    n = os.copy_file_range(sfd, dst_fd, nbytes - off, off, off)
                except OSError as exc:
                    if exc.errno in _COPY_FALLBACK and off == 0:
                        use_kernel = False
                        continue
                    raise
            else:
                chunk = os.pread(sfd, min(1 << 20, nbytes - off), off)
                n = os.pwrite(dst_fd, chunk, off) if chunk else 0
            if n == 0:
                raise OffloadError(f"{src} is shorter than expected")
            off += n
    finally:
        os.close(sfd)


def _write_file(path: str, writer) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        writer(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _resident_entries(engine: OffloadEngine) -> list[tuple[str, str, torch.Tensor]]:
    """(name, what, tensor) for everything resident that a checkpoint must hold."""
    out = []
    opt = engine._resident_opt
    for name, p in engine._resident_trainable:
        out.append((name, "param", p.data))
        state = opt.state.get(p, {}) if opt is not None else {}
        for what in ("exp_avg", "exp_avg_sq"):
            if what in state:
                out.append((name, what, state[what]))
    out.append(("torch", "rng", torch.get_rng_state()))
    return out


def _signature(engine: OffloadEngine) -> dict:
    return {
        "mode": engine.mode,
        "blocks": [
            [[s.name, list(s.param.shape), str(s.param.dtype)] for s in layout.weight_slots]
            for layout in engine._layouts
        ],
        "resident": [[n, list(p.shape), str(p.dtype)] for n, p in engine._resident_trainable],
        "regions": {k: f.sizes for k, f in engine._store.files.items()},
    }


def _steps(engine: OffloadEngine) -> dict[str, float]:
    out = {}
    for layout in engine._layouts:
        for n, p in zip(layout.trainable_names, layout.trainable):
            out[n] = float(engine._steps[id(p)])
    opt = engine._resident_opt
    for n, p in engine._resident_trainable:
        if opt is not None and "step" in opt.state.get(p, {}):
            out[n] = float(opt.state[p]["step"])
    return out


def read_manifest(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def save(engine: OffloadEngine, directory: str, extra: dict) -> None:
    engine._pager.flush()  # the swap files are now current
    os.makedirs(directory, exist_ok=True)
    old = read_manifest(directory)
    gen = (old["generation"] + 1) if old else 1
    kinds = [
        k
        for k in (WEIGHT, EXP_AVG, EXP_AVG_SQ)
        if k in engine._store.files and engine.mode == "full"
    ]
    created: list[str] = []
    committed = False
    try:
        files = {}
        for kind in kinds:
            f = engine._store.files[kind]
            name = f"{kind}.{gen:06d}.bin"
            path = os.path.join(directory, name)
            created.append(path)
            _write_file(path, lambda fd, f=f: _copy_range(f.path, fd, f.nbytes))
            files[kind] = {"name": name, "bytes": f.nbytes}

        entries, off = [], 0
        tensors = _resident_entries(engine)
        for n, what, t in tensors:
            nb = t.numel() * t.element_size()
            entries.append(
                {
                    "name": n,
                    "what": what,
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "offset": off,
                    "bytes": nb,
                }
            )
            off += nb
        rname = f"resident.{gen:06d}.bin"
        rpath = os.path.join(directory, rname)
        created.append(rpath)

        def write_resident(fd: int) -> None:
            for _, _, t in tensors:
                if t.numel():
                    _write_all(fd, byte_view(t.detach().contiguous()))

        _write_file(rpath, write_resident)
        files["resident"] = {"name": rname, "bytes": off}

        manifest = {
            "format": FORMAT,
            "generation": gen,
            "step": engine.step_count,
            "lr": engine.optim.lr,
            "optimizer": engine.optim.to_dict(),
            "signature": _signature(engine),
            "files": files,
            "resident": entries,
            "steps": _steps(engine),
            "extra": extra,
        }
        tmp = os.path.join(directory, MANIFEST + ".tmp")
        created.append(tmp)
        _write_file(tmp, lambda fd: _write_all(fd, memoryview(json.dumps(manifest).encode())))
        os.replace(tmp, os.path.join(directory, MANIFEST))
        committed = True
        _fsync_dir(directory)
    except BaseException as exc:
        if not committed:
            for path in created:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if is_disk_full(exc):
            raise OffloadDiskFullError(
                directory, detail="The previous checkpoint there is unchanged."
            ) from exc
        raise
    keep = {f["name"] for f in files.values()} | {MANIFEST}
    for name in os.listdir(directory):
        if name not in keep and name.endswith((".bin", ".tmp")):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def load(engine: OffloadEngine, directory: str) -> dict:
    manifest = read_manifest(directory)
    if manifest is None:
        raise OffloadError(f"no checkpoint in {directory} (missing {MANIFEST})")
    if manifest.get("format") != FORMAT:
        raise OffloadError(f"checkpoint format {manifest.get('format')} is not supported")
    if manifest["signature"] != json.loads(json.dumps(_signature(engine))):
        raise OffloadError("the checkpoint was written for a different model or configuration")
    files = manifest["files"]
    for name in files.values():
        path = os.path.join(directory, name["name"])
        if os.path.getsize(path) != name["bytes"]:
            raise OffloadError(f"{path} has the wrong size: the checkpoint is damaged")

    pager = engine._pager
    pager.reset()
    for kind, f in engine._store.files.items():
        if kind not in files:
            continue
        fd = os.open(f.path, os.O_WRONLY)
        try:
            _copy_range(os.path.join(directory, files[kind]["name"]), fd, f.nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    by_name = dict(engine._resident_trainable)
    opt = engine._resident_opt
    if opt is not None:
        opt.state.clear()
    with open(os.path.join(directory, files["resident"]["name"]), "rb") as fh:
        for e in manifest["resident"]:
            fh.seek(e["offset"])
            data = bytearray(fh.read(e["bytes"]))
            dtype = getattr(torch, e["dtype"])
            t = (
                torch.frombuffer(data, dtype=dtype).reshape(e["shape"]).clone()
                if data
                else (torch.empty(e["shape"], dtype=dtype))
            )
            if e["what"] == "rng":
                torch.set_rng_state(t)
            elif e["what"] == "param":
                by_name[e["name"]].data.copy_(t)
            else:
                p = by_name[e["name"]]
                opt.state.setdefault(p, {})[e["what"]] = t
    steps = manifest["steps"]
    if opt is not None:
        for n, p in engine._resident_trainable:
            if p in opt.state:
                st = engine._fresh_step()
                st.fill_(steps[n])
                opt.state[p]["step"] = st
    for layout in engine._layouts:
        for n, p in zip(layout.trainable_names, layout.trainable):
            engine._steps[id(p)].fill_(steps.get(n, 0.0))
    engine.step_count = manifest["step"]
    engine.set_lr(manifest["lr"])
    return manifest["extra"]
