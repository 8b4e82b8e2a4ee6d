"""Checkpoints: the swap files, the resident state, and a manifest naming them.

Atomicity comes from the manifest: every data file is written under a new generation
name, fsynced, and only then does manifest.json (written to a temp file, fsynced,
renamed over the old one) start pointing at it. A crash or a full disk before that
rename leaves the old manifest and the old files untouched; the new files are removed
(or, after a crash, swept by the next save). Old generations are deleted only after the
new manifest is durable.

Layout of a checkpoint directory:
  manifest.json                 format, generation, step, layout signature, file list
  weight.000003.bin             the weights swap file as it was (full fine-tuning)
  exp_avg.000003.bin            Adam m, exp_avg_sq.000003.bin Adam v
  resident.000003.bin           resident trainable parameters and their Adam m and v,
                                and the CPU RNG state (and the GPU's on CUDA), back to
                                back (offsets in manifest)

No copies when the checkpoint directory is on the swap's filesystem: a save fsyncs the
swap files and renames them into the checkpoint, fresh preallocated swap files take their
place, and each region is read from the checkpoint file until the next step writes it
(into the new swap file; see SwapStore). A step rewrites every region it trains, so a save
costs an fsync and a few renames instead of a read and a write of the whole training
state. A load points every region at the checkpoint's files the same way. Checkpoint
files are only ever read. Elsewhere (another filesystem) a save copies: O_DIRECT reads of
8 MiB pieces kept several pieces ahead of the writes, by a private thread pool (training
telemetry counts training traffic only), through 64 MiB of staging buffers taken while no
step runs, when the budget's activation share is idle.

save() and load() work on the engine's EngineState (_state.py), not on the engine.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable

import torch

from ._io import (
    CHUNK,
    BufferPool,
    IOExecutor,
    IORequest,
    OffloadDiskFullError,
    OffloadError,
    byte_view,
    is_disk_full,
    probe_o_direct,
)
from ._layout import EXP_AVG, EXP_AVG_SQ, WEIGHT
from ._state import EngineState
from ._step import set_lr

FORMAT = 1
MANIFEST = "manifest.json"
COPY_PIECE = 8 << 20  # bytes per staged read/write of a direct copy
COPY_SLOTS = 8  # staging buffers: half of them reading ahead, half being written


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


Run = tuple[int, int, int, int]  # (source fd, source offset, destination offset, nbytes)


def _copy_runs(runs: Iterable[Run], dst_fd: int, threads: int) -> None:
    """Copy each run's bytes into dst_fd (all offsets and sizes multiples of 4096, so
    either side may be O_DIRECT), in COPY_PIECE pieces, reads kept COPY_SLOTS // 2
    pieces ahead of the writes."""
    pieces = [
        (fd, src + o, dst + o, min(COPY_PIECE, n - o))
        for fd, src, dst, n in runs
        for o in range(0, n, COPY_PIECE)
    ]
    if not pieces:
        return
    staging = BufferPool(min(COPY_SLOTS, len(pieces)), COPY_PIECE)
    slots = staging.n_pages
    io = IOExecutor(threads, CHUNK)
    reads: dict[int, IORequest] = {}
    writes: dict[int, IORequest] = {}

    def start_read(k: int) -> None:
        w = writes.pop(k % slots, None)
        if w is not None:
            w.wait()
        fd, src, _, n = pieces[k]
        reads[k] = io.read(fd, src, staging.views[k % slots][:n], "checkpoint copy")

    try:
        ahead = max(1, slots // 2)
        for k in range(min(ahead, len(pieces))):
            start_read(k)
        for k, (_, _, dst, n) in enumerate(pieces):
            if k + ahead < len(pieces):
                start_read(k + ahead)
            reads.pop(k).wait()
            writes[k % slots] = io.write(dst_fd, dst, staging.views[k % slots][:n], "checkpoint")
        for w in writes.values():
            w.wait()
    finally:
        io.close()  # runs what is queued first: no transfer outlives the staging buffers


def _swap_runs(st: EngineState, kind: str) -> list[Run]:
    """Where the current bytes of the swap file of `kind` are: the swap file itself, except
    regions still read from a checkpoint file."""
    store = st.store
    f = store.files[kind]
    elsewhere = store.unwritten(kind)
    runs, pos = [], 0
    for fd, off, at, n in elsewhere:
        if at > pos:
            runs.append((f.fd, pos, pos, at - pos))
        runs.append((fd, off, at, n))
        pos = at + n
    if f.nbytes > pos:
        runs.append((f.fd, pos, pos, f.nbytes - pos))
    return runs


def _copy_out(st: EngineState, kind: str, path: str) -> None:
    """A new file at `path` holding the current bytes of the swap file of `kind`, fsynced."""
    direct = st.o_direct and probe_o_direct(os.path.dirname(path))
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.posix_fallocate(fd, 0, st.store.files[kind].nbytes)
        _copy_runs(_swap_runs(st, kind), fd, st.config.io_threads)
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_filesystem(a: str, b: str) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def _write_file(path: str, writer) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        writer(fd)
        os.fsync(fd)
    finally:
        os.close(fd)


def _resident_entries(st: EngineState) -> list[tuple[str, str, torch.Tensor]]:
    """(name, what, tensor) for everything resident that a checkpoint must hold."""
    out = []
    opt = st.optimizers.resident
    for name, p in st.resident_trainable:
        out.append((name, "param", p.data))
        state = opt.state.get(p, {}) if opt is not None else {}
        for what in ("exp_avg", "exp_avg_sq"):
            if what in state:
                out.append((name, what, state[what]))
    out.append(("torch", "rng", torch.get_rng_state()))
    if st.device.type == "cuda":  # dropout on the GPU draws from the GPU's generator
        out.append(("torch", "cuda_rng", torch.cuda.get_rng_state(st.device)))
    return out


def _signature(st: EngineState) -> dict:
    return {
        "mode": st.mode,
        "blocks": [
            [[s.name, list(s.param.shape), str(s.param.dtype)] for s in layout.weight_slots]
            for layout in st.layouts
        ],
        "resident": [[n, list(p.shape), str(p.dtype)] for n, p in st.resident_trainable],
        "regions": {k: f.sizes for k, f in st.store.files.items()},
    }


def _steps(st: EngineState) -> dict[str, float]:
    out = {}
    for layout in st.layouts:
        for n, p in zip(layout.trainable_names, layout.trainable):
            out[n] = float(st.optimizers.steps[id(p)])
    opt = st.optimizers.resident
    for n, p in st.resident_trainable:
        if opt is not None and "step" in opt.state.get(p, {}):
            out[n] = float(opt.state[p]["step"])
    return out


def read_manifest(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _swap_files(st: EngineState, directory: str, gen: int, created: list[str]) -> dict:
    """The swap files of full fine-tuning into `directory` under generation `gen`:
    renamed there on the swap's filesystem (fresh swap files take their place), copied
    elsewhere. Appends every file it makes to `created`; returns their manifest entries."""
    store, threads = st.store, st.config.io_threads
    kinds = [k for k in (WEIGHT, EXP_AVG, EXP_AVG_SQ) if k in store.files and st.mode == "full"]
    rename = bool(kinds) and _same_filesystem(store.directory, directory)
    successors: dict[str, tuple[int, str]] = {}
    files = {}
    try:
        if rename:
            for kind in kinds:  # first: a full disk shows here, before anything moved
                successors[kind] = store.prepare_successor(kind)
            for kind in kinds:  # regions still read from an older checkpoint: fill them in
                f = store.files[kind]
                _copy_runs(
                    [(fd, off, at, n) for fd, off, at, n in store.unwritten(kind)], f.fd, threads
                )
                store.forget_unwritten(kind)
            store.sync(kinds)
        for kind in kinds:
            f = store.files[kind]
            name = f"{kind}.{gen:06d}.bin"
            path = os.path.join(directory, name)
            created.append(path)
            files[kind] = {"name": name, "bytes": f.nbytes}
            if rename:
                store.hand_over(kind, path, successors[kind])
                del successors[kind]
            else:
                _copy_out(st, kind, path)
    finally:
        for fd, path in successors.values():  # (only left over when something failed)
            os.close(fd)
            os.unlink(path)
    return files


def _write_resident(
    st: EngineState, directory: str, gen: int, created: list[str]
) -> tuple[dict, list[dict]]:
    """resident.<gen>.bin: the resident trainable state and the RNG, back to back.
    Returns its manifest entry and where each tensor lies in it."""
    entries, off = [], 0
    tensors = _resident_entries(st)
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
            if t.numel():  # .cpu(): on the CUDA path resident tensors are on the GPU
                _write_all(fd, byte_view(t.detach().cpu().contiguous()))  # view keeps it

    _write_file(rpath, write_resident)
    return {"name": rname, "bytes": off}, entries


def _remove(paths: Iterable[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def save(st: EngineState, directory: str, extra: dict) -> None:
    st.pager.flush()  # the swap files are now current
    os.makedirs(directory, exist_ok=True)
    old = read_manifest(directory)
    gen = (old["generation"] + 1) if old else 1
    created: list[str] = []
    committed = False
    try:
        files = _swap_files(st, directory, gen, created)
        files["resident"], entries = _write_resident(st, directory, gen, created)
        manifest = {
            "format": FORMAT,
            "generation": gen,
            "step": st.step_count,
            "lr": st.optim.lr,
            "optimizer": st.optim.to_dict(),
            "signature": _signature(st),
            "files": files,
            "resident": entries,
            "steps": _steps(st),
            "extra": extra,
        }
        tmp = os.path.join(directory, MANIFEST + ".tmp")
        created.append(tmp)
        _write_file(tmp, lambda fd: _write_all(fd, memoryview(json.dumps(manifest).encode())))
        os.replace(tmp, os.path.join(directory, MANIFEST))
        committed = True
        _fsync_dir(directory)
    except BaseException as exc:
        if not committed:  # (a handed-over file stays readable through the store's fd)
            _remove(created)
        if is_disk_full(exc) or isinstance(exc, OffloadDiskFullError):
            raise OffloadDiskFullError(
                directory, detail="The previous checkpoint there is unchanged."
            ) from exc
        raise
    keep = {f["name"] for f in files.values()} | {MANIFEST}
    _remove(
        os.path.join(directory, name)
        for name in os.listdir(directory)
        if name not in keep and name.endswith((".bin", ".tmp"))
    )


def load(st: EngineState, directory: str) -> dict:
    manifest = read_manifest(directory)
    if manifest is None:
        raise OffloadError(f"no checkpoint in {directory} (missing {MANIFEST})")
    if manifest.get("format") != FORMAT:
        raise OffloadError(f"checkpoint format {manifest.get('format')} is not supported")
    if manifest["signature"] != json.loads(json.dumps(_signature(st))):
        raise OffloadError("the checkpoint was written for a different model or configuration")
    files = manifest["files"]
    for name in files.values():
        path = os.path.join(directory, name["name"])
        if os.path.getsize(path) != name["bytes"]:
            raise OffloadError(f"{path} has the wrong size: the checkpoint is damaged")

    pager = st.pager
    pager.reset()
    direct = st.o_direct and probe_o_direct(directory)
    for kind in st.store.files:
        if kind not in files:
            continue
        src = os.path.join(directory, files[kind]["name"])
        fd = os.open(src, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        st.store.read_from(kind, fd, src)  # read there until written: no copy

    by_name = dict(st.resident_trainable)
    opt = st.optimizers.resident
    if opt is not None:
        opt.state.clear()
    with open(os.path.join(directory, files["resident"]["name"]), "rb") as fh:
        for e in manifest["resident"]:
            fh.seek(e["offset"])
            t = torch.empty(e["shape"], dtype=getattr(torch, e["dtype"]))
            if e["bytes"] and fh.readinto(byte_view(t)) != e["bytes"]:  # straight into t
                raise OffloadError(f"{fh.name} ends early: the checkpoint is damaged")
            if e["what"] == "rng":
                torch.set_rng_state(t)
            elif e["what"] == "cuda_rng":
                torch.cuda.set_rng_state(t, st.device)
            elif e["what"] == "param":
                by_name[e["name"]].data.copy_(t)
            else:
                p = by_name[e["name"]]
                opt.state.setdefault(p, {})[e["what"]] = t.to(p.device)
    steps = manifest["steps"]
    if opt is not None:
        for n, p in st.resident_trainable:
            if p in opt.state:
                step = st.optimizers.fresh_step()
                step.fill_(steps[n])
                opt.state[p]["step"] = step
    for layout in st.layouts:
        for n, p in zip(layout.trainable_names, layout.trainable):
            st.optimizers.steps[id(p)].fill_(steps.get(n, 0.0))
    st.step_count = manifest["step"]
    set_lr(st, manifest["lr"])
    return manifest["extra"]
