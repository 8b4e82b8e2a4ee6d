"""How the engine gets between a model and its transformer blocks.

Each block's `forward` is replaced (an instance attribute, as accelerate's hooks do; the
module tree and state_dict names stay as they were) by a function that, under autograd,
runs the block through `StreamedBlock`:

- forward: the block's weights are paged in (prefetching the next ones), the block runs
  without building a graph, its weights are paged out; only the block's input is kept
  (activation checkpointing, as torch.utils.checkpoint's reentrant variant).
- backward: the engine pages the block in again, recomputes it from the kept input with
  the RNG states it had in the forward (CPU, and GPU on CUDA: dropout draws the same
  masks), takes the gradients of the block's input and parameters, and hands the latter to
  the optimizer at once: the block is stepped (or its gradients spilled, when clipping)
  and paged out before the next block's backward starts.
- when every block's autograd graph fits the budget's activation share (the state's
  `keep_graphs`, decided per step), the forward builds the block's graph and keeps it,
  and the backward differentiates that graph instead of recomputing the block: a forward
  of every block saved. Saved tensors that point into the block's weight page (the
  weights themselves, or views of them) are kept as (offset, shape, stride) references
  (`_schedule.page_refs`) and rebuilt from the page the backward pins, since the page's
  buffer holds other blocks in between.

Without autograd (torch.no_grad(): evaluation, generation) a block is simply paged in,
run and paged out.

The hooks hold the engine's EngineState (_state.py), not the engine: paging and binding
are _schedule.py's, the backward and the block steps _step.py's.
"""

from __future__ import annotations

from typing import Any

import torch

from ._device import rng_state
from ._io import OffloadError
from ._pipeline import begin_backward, begin_forward
from ._schedule import forward_enter, forward_exit, page_refs
from ._state import EngineState
from ._step import backward_block


class StreamedBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, st: EngineState, index, fn, args, kwargs, anchor, hidden):
        ctx.st, ctx.index, ctx.fn, ctx.args, ctx.kwargs = st, index, fn, args, kwargs
        ctx.graph = None
        keep = st.keep_graphs
        ctx.rng = None if keep else rng_state(st.device)  # the CPU's (and GPU's) generators
        forward_enter(st, index)
        try:
            if keep:
                x = hidden.detach().requires_grad_()
                with torch.enable_grad(), page_refs(st, index):
                    out = fn(x, *args, **kwargs)
            else:
                out = fn(hidden, *args, **kwargs)
        finally:
            forward_exit(st, index)
        if not isinstance(out, torch.Tensor):
            raise TypeError("a streamed block must return a tensor")
        if keep:
            ctx.graph = (x, out)
            return out.detach()
        ctx.save_for_backward(hidden)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.st.pipelined and ctx.index == len(ctx.st.layouts) - 1:
            begin_backward(ctx.st)
        need_x = ctx.needs_input_grad[6]
        if ctx.graph is not None:
            graph, ctx.graph = ctx.graph, None
            grad_x = backward_block(
                ctx.st, ctx.index, None, None, None, None, None, grad_out, need_x, graph=graph
            )
        else:
            (hidden,) = ctx.saved_tensors
            grad_x = backward_block(
                ctx.st, ctx.index, ctx.fn, hidden, ctx.args, ctx.kwargs, ctx.rng, grad_out, need_x
            )
        return None, None, None, None, None, None, grad_x


def patch_block(st: EngineState, index: int, block: torch.nn.Module) -> None:
    original = block.forward

    def forward(*args: Any, **kwargs: Any):
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        if torch.is_grad_enabled():
            _check_training_call(st)
            # A replayed block must not append to a KV cache a second time; in training
            # the cache changes nothing (it starts empty), so drop it, as
            # transformers' own gradient checkpointing does.
            for name in ("cache", "past_key_values", "past_key_value", "layer_past"):
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            for v in list(rest) + list(kwargs.values()):
                _refuse_grad_inputs(v)
            if st.pipelined and index == 0:
                begin_forward(st)
            return StreamedBlock.apply(st, index, original, rest, kwargs, st.anchor, hidden)
        forward_enter(st, index)
        try:
            return original(hidden, *rest, **kwargs)
        finally:
            forward_exit(st, index)

    block.forward = forward


def unpatch_block(block: torch.nn.Module) -> None:
    block.__dict__.pop("forward", None)


def _check_training_call(st: EngineState) -> None:
    if not st.in_step:
        raise OffloadError(
            "this model's blocks are streamed by an OffloadEngine: train with "
            "engine.step(batch), and run inference under torch.no_grad()"
        )


def _refuse_grad_inputs(value: Any) -> None:
    if isinstance(value, torch.Tensor) and value.requires_grad:
        raise NotImplementedError(
            "a streamed block received a second input that needs gradients; only the "
            "hidden states may carry gradients between blocks"
        )
    if isinstance(value, (tuple, list)):
        for v in value:
            _refuse_grad_inputs(v)
