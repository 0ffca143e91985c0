"""Replaying a step the screen found bad, for the per-call watch alone, to find its origin.

:func:`replay` runs this step's top-level calls (of the model, or of its children called
outside it) again, in order, with the same arguments,
RNG and autocast state, and for the calls of that backward the backward too, with the very
gradients that reached the model's outputs. Buffers (BatchNorm's running statistics) and RNG
state are restored afterwards, parameter ``.grad`` is not touched (the replay uses
``torch.autograd.grad``), and under :func:`gradtap.capture.replaying` no other consumer sees
it: a replay is not a training step (a Monitor's statistics, a transform's state and a
per-sample result do not move).

What a replay cannot reproduce (a forward that depends on state other than buffers and RNG,
non-deterministic kernels, a gradient entering the model other than through its outputs) is
still reported, from the screen's own evidence, with a note saying so.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from gradtap._detect._screen import RootCall, Screen
from gradtap.capture import Listener, RngState, buffers_restored, replaying
from gradtap.record import flatten_tensors, map_tensors

__all__ = ["replay"]


def replay(screen: Screen, owner: Listener, backward: list[RootCall]) -> None:
    """Run the step ``screen`` kept again, seen by ``owner`` alone; for the calls in
    ``backward``, their backward too, from the gradients that reached their outputs.

    Parameter ``.grad`` is left alone, and buffers and RNG state are restored afterwards.
    """
    in_backward = {id(c) for c in backward}
    # Top-level calls of the model's children (a model used through its methods) feed each
    # other: all forwards first, then their backwards in reverse order, as the step ran them.
    # Calls of the model itself are independent: each one's backward right after it.
    chained = any(call.name for call in screen.calls)
    with ExitStack() as stack:
        stack.enter_context(replaying(owner))
        stack.enter_context(buffers_restored(screen.model))
        stack.callback(RngState(screen.cuda).restore)
        waiting: list[tuple[RootCall, Any, Any]] = []
        for call in screen.calls:
            if call.args is None:
                continue
            call.rng.restore()
            args, kwargs = _detached((call.args, call.kwargs))
            with call.autocast.entered(), torch.enable_grad():
                output = call.module(*args, **kwargs)
            if id(call) not in in_backward or not call.grads:
                continue
            if chained:
                waiting.append((call, output, (args, kwargs)))
            else:
                _backward(screen, call, output, (args, kwargs))
        for call, output, inputs in reversed(waiting):
            _backward(screen, call, output, inputs)


def _backward(screen: Screen, call: RootCall, output: Any, inputs: Any) -> None:
    """The replayed call's backward, from the gradients that reached its outputs."""
    outs = dict(flatten_tensors(output, "output"))
    pairs = [(outs[k], g) for k, g in call.grads.items()
             if k in outs and outs[k].requires_grad and outs[k].shape == g.shape]
    if not pairs:
        return
    leaves: list[Tensor] = [p for p in screen.model.parameters() if p.requires_grad]
    leaves += [t for _, t in flatten_tensors(inputs, "a") if t.requires_grad]
    with torch.enable_grad():
        if leaves:  # autograd.grad: nothing is accumulated into .grad
            torch.autograd.grad([o for o, _ in pairs], leaves, [g for _, g in pairs],
                                allow_unused=True)
        else:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _detached(obj: Any) -> Any:
    """The same structure with every tensor detached (its ``requires_grad`` kept), so a replay's
    backward stops at the call's arguments. A tensor passed twice stays one tensor."""
    memo: dict[int, Tensor] = {}

    def detach(t: Tensor) -> Tensor:
        new = memo.get(id(t))
        if new is None:
            new = memo[id(t)] = t.detach().requires_grad_(t.requires_grad)
        return new

    return map_tensors(obj, detach)
