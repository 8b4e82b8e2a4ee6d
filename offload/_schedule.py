"""The order a pass pins pages in, and where a block's weights are bound while it runs.

A pass (a step's forward and backward, or a no-grad forward) starts by writing down every
region it will pin, in order; `demand` pins the next one and keeps prefetch walking
ahead along that list (strictly in order: see _pager.py's deadlock rule). A block's
weights are bound to its host page (CPU), or to the GPU slot its page was copied into
(CUDA, _device.py), for exactly as long as the block computes.
"""

from __future__ import annotations

import contextlib

import torch

from ._io import OffloadError
from ._layout import EXP_AVG, EXP_AVG_SQ, GRAD, WEIGHT
from ._pager import Key
from ._state import EngineState

_PAGE_REF = object()  # marks a saved tensor kept as a place in a weight page (page_refs)


def start_schedule(st: EngineState, training: bool, forward: bool = True,
                   backward: bool = True) -> None:
    """Every region this pass will pin, in order ((key, read) pairs; read False: a
    page the engine fills itself). Prefetch walks ahead of the demands along it.

    A pipeline stage (_pipeline.py) runs every micro-batch's forward before the first
    backward: its passes are scheduled apart (`forward` or `backward` alone)."""
    st.pager.cancel_prefetches()
    if st.dev is not None:
        settle_device(st)
    n = len(st.layouts)
    sched: list[tuple[Key, bool]] = [((i, WEIGHT), True) for i in range(n)] if forward else []
    if training and backward:
        final, acc = st.final, st.micro > 0
        for i in reversed(range(n)):
            sched.append(((i, WEIGHT), True))
            if not st.layouts[i].trainable:
                continue
            if acc:
                sched.append(((i, GRAD), True))
            if final and not st.clip:
                sched += [((i, EXP_AVG), True), ((i, EXP_AVG_SQ), True)]
            elif not acc:
                sched.append(((i, GRAD), False))  # the spill page
        if final and st.clip:
            for i in range(n):
                if st.layouts[i].trainable:
                    sched += [((i, k), True) for k in (WEIGHT, GRAD, EXP_AVG, EXP_AVG_SQ)]
    st.schedule = sched
    st.sched_pos = 0


def abandon_pass(st: EngineState) -> None:
    """After a failure part-way through a pass: nothing scheduled, queued or pinned, every
    block unbound, no gradients. The training state is then only good in a checkpoint."""
    stop_schedule(st)
    if st.dev is not None:
        with contextlib.suppress(Exception):  # a broken CUDA context must not hide the error
            st.dev.reset()  # no copy reads a host page past this point
    for layout in st.layouts:
        layout.unbind()
    for key, page in list(st.pinned.items()):
        st.pager.discard(page)
        del st.pinned[key]
    for _, p in st.named:
        p.grad = None
    st.norms.clear()
    st.has_grad.clear()


def stop_schedule(st: EngineState) -> None:
    """No pass in progress: nothing prefetched, nothing scheduled."""
    st.schedule = []
    st.pager.cancel_prefetches()


def demand(st: EngineState, key: Key, read: bool = True):
    """Pin `key`'s page, prefetching in schedule order what comes next."""
    pos = st.sched_pos
    while pos < len(st.schedule) and st.schedule[pos][0] != key:
        pos += 1
    if pos < len(st.schedule):
        st.sched_pos = pos + 1
        for k, r in st.schedule[pos : pos + 1 + st.prefetch_pages]:
            if not st.pager.prefetch(k, r):
                break  # strictly in order: see _pager.py's deadlock rule
    return st.pager.get(key, read)


def pin(st: EngineState, key: Key, read: bool = True):
    """demand(), and keep the page in `pinned` until it is released."""
    page = demand(st, key, read)
    st.pinned[key] = page
    return page


def bind_host(st: EngineState, i: int) -> None:
    """Pin block i's weights page and bind its parameters there."""
    st.layouts[i].bind(pin(st, (i, WEIGHT)).tensor)


def release(st: EngineState, key: Key, dirty: bool = False) -> None:
    st.pager.release(st.pinned.pop(key), dirty=dirty)


def discard(st: EngineState, key: Key) -> None:
    st.pager.discard(st.pinned.pop(key))


# -- the forward (called by the block hooks) ---------------------------------------------------


def forward_enter(st: EngineState, i: int) -> None:
    if not st.schedule:  # a no-grad call from outside step()/evaluate()
        start_schedule(st, training=False)
    if st.dev is not None:
        bind_on_device(st, i, keep_host=False)
        return
    bind_host(st, i)


def forward_exit(st: EngineState, i: int) -> None:
    st.layouts[i].unbind()
    if st.dev is not None:
        st.dev.release(i)
        if i + 1 < len(st.layouts):
            load_to_device(st, i + 1)  # copied while the GPU computes block i
    else:
        release(st, (i, WEIGHT))
    if i == len(st.layouts) - 1 and not st.in_step:
        st.schedule = []


def page_refs(st: EngineState, i: int):
    """saved_tensors_hooks for block i's kept graph: a saved tensor inside the pool
    (block i's weights, bound in its page) is stored as its place in that page and
    rebuilt from whichever page holds block i's weights when the backward runs. On
    CUDA the same holds for the device slots block i's weights are bound in."""
    arena = st.pool.storage if st.dev is None else st.dev.arena
    pool = arena.untyped_storage().data_ptr()

    def bound() -> torch.Tensor:  # the buffer holding block i's weights just now
        if st.dev is not None:
            return st.dev.slot_of(i)
        return st.pinned[(i, WEIGHT)].tensor

    def pack(t: torch.Tensor):
        if t.device != arena.device or t.untyped_storage().data_ptr() != pool:
            return t
        page = bound()
        off = t.data_ptr() - page.data_ptr()
        if not 0 <= off < page.numel():
            raise OffloadError(f"block {i} saved a tensor of another block's page")
        return (_PAGE_REF, off // t.element_size(), tuple(t.shape), t.stride(), t.dtype)

    def unpack(v):
        if not (isinstance(v, tuple) and v and v[0] is _PAGE_REF):
            return v
        _, off, shape, stride, dtype = v
        flat = bound().view(dtype)
        return flat.as_strided(shape, stride, flat.storage_offset() + off)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# -- the CUDA path's bindings (the transfers themselves: _device.py) -------------------------


def load_to_device(st: EngineState, i: int) -> None:
    """Pin block i's host page (read from the swap if needed), start its copy to the GPU."""
    key = (i, WEIGHT)
    if key not in st.pinned:
        pin(st, key)
    st.dev.load(i, st.pinned[key].tensor, st.layouts[i].region_bytes[WEIGHT])


def bind_on_device(st: EngineState, i: int, keep_host: bool) -> None:
    """Bind block i's parameters to its GPU copy. keep_host: its host page stays pinned
    (the block's step updates it there); otherwise it goes back once copied."""
    load_to_device(st, i)
    st.layouts[i].bind(st.dev.acquire(i))
    if not keep_host:
        st.dev.wait_copied(i)
        release(st, (i, WEIGHT))


def grads_to_host(st: EngineState, i: int, grads: list[torch.Tensor | None]) -> list:
    """Block i's gradients GPU -> pinned staging; the block is bound to its host page
    again, where AdamW steps it (its GPU copy is stale from then on)."""
    layout = st.layouts[i]
    host = st.dev.to_host(grads, layout.state_views(st.staging))
    st.dev.wait_copied(i)  # (done: the compute stream waited for it)
    st.dev.invalidate(i)
    layout.bind(st.pinned[(i, WEIGHT)].tensor)
    return host


def settle_device(st: EngineState) -> None:
    """Before a new pass: let queued copies finish, give back host pages held for them,
    and forget which blocks the GPU holds."""
    st.dev.reset()
    for key in [k for k in st.pinned if k[1] == WEIGHT]:
        release(st, key)
