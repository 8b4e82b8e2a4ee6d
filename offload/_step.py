"""A block's backward, and the optimizer steps: per block during the backward, or, when
clipping by global norm, after it; the resident group last (see engine.py's design).

AdamW and the norms are torch's own code, run piecewise (_optim.py): each block is
stepped by a real torch.optim.AdamW whose state entries are views into the pages holding
that block's m and v, so the bits are those of plain torch.
"""

from __future__ import annotations

import torch

from ._device import replay_rng
from ._layout import EXP_AVG, EXP_AVG_SQ, GRAD, WEIGHT
from ._optim import tensor_norms, total_norm
from ._parallel import sum_across_ranks
from ._pipeline import gather_norms
from ._schedule import bind_host, bind_on_device, discard, grads_to_host, load_to_device, pin
from ._schedule import release as release_page
from ._state import EngineState


def set_lr(st: EngineState, lr: float) -> None:
    """Set the learning rate of every parameter (for a schedule, before a step)."""
    st.optim.lr = lr
    for opt in [*st.optimizers.blocks, st.optimizers.resident]:
        if opt is not None:
            for g in opt.param_groups:
                g["lr"] = lr


def backward_block(st: EngineState, i, fn, hidden, args, kwargs, rng, grad_out, need_x, graph=None):
    """Block i's gradients: from its kept graph (x, out), or by recomputing it."""
    layout = st.layouts[i]
    streamed = layout.trainable
    if st.dev is not None:  # its host page stays pinned when the block is stepped
        bind_on_device(st, i, keep_host=bool(streamed))
    else:
        bind_host(st, i)
    resident = st.block_resident[i]
    if graph is not None:
        x, out = graph
        del graph
    else:
        x = hidden.detach().requires_grad_(need_x)
        with torch.enable_grad(), replay_rng(rng, st.device):
            out = fn(x, *args, **kwargs)
    inputs = ([x] if need_x else []) + streamed + resident
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True) if inputs else ()
    del out
    nx = 1 if need_x else 0
    grad_x = grads[0] if need_x else None
    block_grads = list(grads[nx : nx + len(streamed)])
    for p, g in zip(resident, grads[nx + len(streamed) :]):
        if g is not None:  # as AccumulateGrad would: set, or add when already there
            p.grad = g if p.grad is None else p.grad + g
    del grads
    if st.dev is not None:
        st.dev.release(i)
        if streamed:
            block_grads = grads_to_host(st, i, block_grads)
    if streamed:
        block_grads_ready(st, i, block_grads)
    else:
        layout.unbind()
        if st.dev is None:
            release_page(st, (i, WEIGHT))
    if st.dev is not None and i > 0:
        load_to_device(st, i - 1)  # copied while the GPU finishes block i
    return grad_x


def step_block(st: EngineState, i: int, grads: list[torch.Tensor | None]) -> None:
    """AdamW on block i (weights bound) with `grads`; then page everything out."""
    layout = st.layouts[i]
    m = pin(st, (i, EXP_AVG))
    v = pin(st, (i, EXP_AVG_SQ))
    opt = st.optimizers.blocks[i]
    stepped = []
    for p, g, mv, vv in zip(
        layout.trainable, grads, layout.state_views(m.tensor), layout.state_views(v.tensor)
    ):
        if g is None:
            continue
        p.grad = g
        opt.state[p] = {"step": st.optimizers.steps[id(p)], "exp_avg": mv, "exp_avg_sq": vv}
        stepped.append(p)
    opt.step()
    for p in stepped:
        p.grad = None
        del opt.state[p]
    layout.unbind()
    for kind in (WEIGHT, EXP_AVG, EXP_AVG_SQ):
        release_page(st, (i, kind), dirty=True)


def _spilled(st: EngineState, i: int, page) -> list[torch.Tensor | None]:
    """Block i's gradients as spilled in `page` (None where a parameter has none)."""
    layout = st.layouts[i]
    return [
        view if st.has_grad.get(id(p)) else None
        for p, view in zip(layout.trainable, layout.state_views(page.tensor))
    ]


def block_grads_ready(st: EngineState, i: int, grads: list[torch.Tensor | None]) -> None:
    """Block i's gradients for this micro-batch exist (weights still bound).

    Earlier micro-batches' gradients are in the swap: read and add (as AccumulateGrad
    adds). Last micro-batch without clipping: step the block now. Otherwise (more
    micro-batches, or clipping needs the global norm first): write them back, keeping
    per-tensor norms when they are final."""
    layout = st.layouts[i]
    gp = None
    if st.micro > 0:
        gp = pin(st, (i, GRAD))
        for p, g, view in zip(layout.trainable, grads, layout.state_views(gp.tensor)):
            if g is None:
                continue
            if st.has_grad.get(id(p)):
                view.add_(g)
            else:
                view.copy_(g)
                st.has_grad[id(p)] = True
        grads = _spilled(st, i, gp)
    if st.final and st.parallel:  # final here: the sum over every rank's share
        sum_across_ranks([g for g in grads if g is not None], st.reduced)
    if st.final and not st.clip:
        step_block(st, i, grads)
        if gp is not None:
            discard(st, (i, GRAD))
        return
    if st.final:  # clipping: per-tensor norms of the finished gradients
        present = [(p, g) for p, g in zip(layout.trainable, grads) if g is not None]
        norms = tensor_norms([g for _, g in present], st.optim.foreach)
        for (p, _), norm in zip(present, norms):
            st.norms[id(p)] = norm
    if gp is None:
        gp = pin(st, (i, GRAD), read=False)
        for p, g, view in zip(layout.trainable, grads, layout.state_views(gp.tensor)):
            st.has_grad[id(p)] = g is not None
            if g is not None:
                view.copy_(g)
    del grads
    release_page(st, (i, GRAD), dirty=True)
    layout.unbind()
    release_page(st, (i, WEIGHT))


def sum_resident_grads(st: EngineState) -> None:
    """Data parallel: the resident group's gradients, summed over the ranks, before any
    norm is taken (the blocks' were summed as each one finished)."""
    sum_across_ranks([p.grad for _, p in st.resident_trainable if p.grad is not None],
                     st.reduced)


def clip_and_step_blocks(st: EngineState) -> None:
    """The global norm from every kept per-tensor norm, in clip_grad_norm_'s order; then
    each trainable block read again (weights, spilled gradients), clipped and stepped."""
    res = [(p, p.grad) for _, p in st.resident_trainable if p.grad is not None]
    for (p, _), n in zip(res, tensor_norms([g for _, g in res], st.optim.foreach)):
        st.norms[id(p)] = n
    norms = [st.norms[id(p)] for p in st.norm_order
             if id(p) in st.norms and id(p) not in st.uncounted]
    if st.pipelined:  # the whole model's norm: every stage's, in stage order
        norms = gather_norms(norms, st.reduced)
    st.total_norm = total_norm(norms)
    st.last_grad_norm = float(st.total_norm)
    max_norm = float(st.optim.max_grad_norm)
    for i, layout in enumerate(st.layouts):
        if not layout.trainable:
            continue
        bind_host(st, i)
        grads = _spilled(st, i, pin(st, (i, GRAD)))
        with_grad = [(p, gv) for p, gv in zip(layout.trainable, grads) if gv is not None]
        for p, gv in with_grad:
            p.grad = gv
        torch.nn.utils.clip_grads_with_norm_(
            [p for p, _ in with_grad], max_norm, st.total_norm, foreach=st.optim.foreach
        )
        for p, _ in with_grad:
            p.grad = None
        step_block(st, i, grads)
        discard(st, (i, GRAD))


def step_resident(st: EngineState) -> None:
    """Clip (with the step's global norm) and step the resident group by its own AdamW."""
    params = [p for _, p in st.resident_trainable if p.grad is not None]
    if st.clip and params:
        torch.nn.utils.clip_grads_with_norm_(
            params, float(st.optim.max_grad_norm), st.total_norm, foreach=st.optim.foreach
        )
    if st.optimizers.resident is not None:
        st.optimizers.resident.step()
    for _, p in st.resident_trainable:
        p.grad = None
