"""The boundary oracle: what every module call's record must hold, from plain autograd.

One oracle forward runs with every module instrumented at once (the root included). Each
module's ``forward`` is wrapped (for calls made through ``module(...)``, so that other
forward hooks, e.g. Hugging Face's output-capturing hooks, still see the arguments as passed
and the outputs as returned):

* each tensor argument that requires grad is replaced by ``keep.clone()``, where
  ``keep = arg.clone()`` is private to that call and argument path (so the same tensor
  passed as two arguments gets two);
* every parameter under the module is shifted by a zero leaf ``z`` while the call runs
  (``p -> p + z``, one ``z`` per parameter object, so tied weights share it; a nested call
  shifts again, so an outer call's ``z`` also sees its children's uses);
* each tensor output that requires grad is replaced by ``keep.clone()``, with
  ``keep = out.clone()`` private to that call and output path.

Clones and zero shifts are the identity in value and in gradient, so the loss and every
gradient are the plain model's (``test_oracle.py`` checks the loss and ``p.grad``); they only
add named places where autograd can be asked for a gradient. One
``torch.autograd.grad(loss, [every keep and z], allow_unused=True)`` then gives, per call:

* ``grad_outputs[k] = dL/d keep_out_k``. ``keep_out_k`` is used only through the clone the
  call returned, so this is the gradient from the uses of output ``k`` after the call
  returned: uses inside the call read the original tensor (excluded); a later in-place change
  writes into the returned clone (so this is the gradient w.r.t. the value the call
  returned); two output paths holding one tensor have two keeps (each path's own gradient).
  Boundary gradients compose: a clone at one module changes no gradient anywhere else, so
  instrumenting every module in one run is the same as one run per module.
* ``grad_inputs[k] = dL/d keep_in_k``: the gradient that reaches the argument through this
  call's uses of it only (every later use of the caller's tensor reads the caller's tensor).
* ``param_grads[p] = dL/dz_p``: the contribution of the uses of ``p`` during this call
  (children's included) to ``p.grad``. For the root this is ``p.grad``.

Without side channels (nothing made in the call reaching the loss other than through its
outputs) the last two equal the vector-Jacobian product of the call with ``grad_outputs``
as cotangents. The oracle also computes that VJP explicitly, as
``torch.autograd.grad([keep_out], [keep_in] + [z], grad_outputs=grad_outputs)`` (walking
back from the call's own output keeps, autograd reaches only nodes made by the call: the
input keeps and the shifts cut it off from everything earlier), in ``vjp_inputs`` and
``vjp_params``. The two differ where a call's intermediate tensors leave it by another way
than its return value, e.g. Hugging Face models collecting ``hidden_states`` with forward
hooks on the layers: an encoder's layer outputs then reach the loss without passing through
the encoder's outputs. The suite checks records against the contribution (the definition
under which the outermost calls' ``param_grads`` sum to ``p.grad``) and names such calls in
its failure messages.

Keys follow the record naming rules: arguments by the forward signature's names
(``*varargs`` as ``<name>.<i>``, keyword arguments as passed, nested parts joined by
``.``); outputs ``output`` for a lone tensor, else tuple indices and mapping keys joined by
``.``. Every tensor leaf has a key; a slot with no gradient holds ``None``.

Only calls made with grad enabled outside backward count (an activation-checkpoint
recomputation runs the same wrappers, so the recomputed graph matches, but records
nothing). A call must have a record when some output received a gradient.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

Slots = dict[str, "Tensor | None"]


@dataclass
class Call:
    """One module call as the oracle saw it, and the gradients it computed for it."""

    name: str
    index: int  # this module's call number, as ``GradRecord.call``
    parent: Call | None  # the innermost enclosing call (of any module)
    param_names: list[str]
    input_keys: list[str] = field(default_factory=list)
    output_keys: list[str] = field(default_factory=list)
    in_keep: dict[str, Tensor] = field(default_factory=dict)
    out_keep: dict[str, Tensor] = field(default_factory=dict)
    zeros: dict[str, Tensor] = field(default_factory=dict)  # param name -> its zero leaf
    grad_inputs: Slots = field(default_factory=dict)
    grad_outputs: Slots = field(default_factory=dict)
    param_grads: Slots = field(default_factory=dict)
    vjp_inputs: Slots = field(default_factory=dict)
    vjp_params: Slots = field(default_factory=dict)

    @property
    def reached(self) -> bool:
        """Some output received a gradient: the call must have a record."""
        return any(g is not None for g in self.grad_outputs.values())

    @property
    def outermost(self) -> bool:
        """No enclosing call other than the root's."""
        return self.parent is not None and self.parent.parent is None


@dataclass
class OracleResult:
    loss: Tensor
    calls: list[Call]

    def of(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]


# -- naming -----------------------------------------------------------------------------------


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _map(obj: Any, path: str, fn: Callable[[str, Tensor], Tensor]) -> Any:
    """``obj`` rebuilt with ``fn(path, t)`` for every tensor leaf (same container types).

    Tensors directly under a top-level container get its keys (``"0"``, ``"logits"``); under
    a named argument, ``"<name>.<key>"``.
    """
    if isinstance(obj, Tensor):
        return fn(path, obj)
    if isinstance(obj, Mapping):
        items = {k: _map(v, _join(path, k), fn) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        return items if type(obj) is dict else type(obj)(**items)
    if isinstance(obj, (tuple, list)):
        items = [_map(v, _join(path, i), fn) for i, v in enumerate(obj)]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if isinstance(obj, list) or type(obj) is tuple:
            return type(obj)(items)
        return type(obj)(*items)  # a named tuple
    return obj


def _argument_names(forward: Callable) -> Callable[[int], str]:
    params = inspect.signature(forward).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")
    return lambda i: positional[i] if i < len(positional) else f"{varargs}.{i - len(positional)}"


# -- the oracle -------------------------------------------------------------------------------


def boundary_oracle(model: nn.Module, run: Callable[[], Tensor]) -> OracleResult:
    """Run ``run()`` (forward and scalar loss) once instrumented; see the module docstring."""
    calls: list[Call] = []
    stack: list[Call | None] = []
    recording = [True]
    counts: dict[str, int] = {}
    undo: list[Callable[[], None]] = []

    def attach(name: str, module: nn.Module) -> None:
        # Resolved once, from the model as built: every (owner module, slot) holding a
        # parameter under this module, and that parameter's name (its first, if tied).
        first = {id(p): n for n, p in module.named_parameters()}
        param_names = list(first.values())
        slots = [(sub, slot, p, first[id(p)]) for sub in module.modules()
                 for slot, p in sub._parameters.items() if p is not None]
        forward = module.forward
        arg_name = _argument_names(forward)
        armed = [0]  # calls entered through module(...) whose forward has not started yet

        def pre_hook(mod: nn.Module, args: tuple) -> None:
            armed[0] += 1

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not armed[0]:  # forward called directly, not a module call
                return forward(*args, **kwargs)
            armed[0] -= 1
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            call = None
            if recording[0]:
                index = counts.get(name, 0)
                counts[name] = index + 1
                parent = next((c for c in reversed(stack) if c is not None), None)
                call = Call(name, index, parent, param_names)
                calls.append(call)

            def keep(store: dict[str, Tensor] | None, keys: list[str] | None):
                def fn(path: str, t: Tensor) -> Tensor:
                    if keys is not None:
                        keys.append(path)
                    if not t.requires_grad:
                        return t
                    kept = t.clone()
                    if store is not None:
                        store[path] = kept
                    return kept.clone()
                return fn

            keep_in = keep(None, None) if call is None else keep(call.in_keep, call.input_keys)
            args = tuple(_map(a, arg_name(i), keep_in) for i, a in enumerate(args))
            kwargs = {k: _map(v, k, keep_in) for k, v in kwargs.items()}
            zeros: dict[str, Tensor] = {}
            restore = []
            for sub, slot, p, pname in slots:
                if p.requires_grad:
                    if pname not in zeros:
                        zeros[pname] = torch.zeros_like(p, requires_grad=True)
                    current = sub._parameters[slot]
                    restore.append((sub, slot, current))
                    sub._parameters[slot] = current + zeros[pname]
            if call is not None:
                call.zeros = zeros
            stack.append(call)
            try:
                output = forward(*args, **kwargs)
            finally:
                stack.pop()
                for sub, slot, value in reversed(restore):
                    sub._parameters[slot] = value
            keep_out = keep(None, None) if call is None else keep(call.out_keep, call.output_keys)
            if isinstance(output, Tensor):
                return keep_out("output", output)
            return _map(output, "", keep_out)

        handle = module.register_forward_pre_hook(pre_hook)
        module.forward = wrapped
        undo.append(handle.remove)
        undo.append(lambda: delattr(module, "forward"))

    for name, module in model.named_modules():
        attach(name, module)
    try:
        loss = run()
        recording[0] = False
        _gradients(loss, calls)
    finally:
        for fn in undo:
            fn()
    return OracleResult(loss.detach(), calls)


def _gradients(loss: Tensor, calls: list[Call]) -> None:
    leaves = [t for c in calls
              for t in [*c.out_keep.values(), *c.in_keep.values(), *c.zeros.values()]]
    grads = iter(torch.autograd.grad(loss, leaves, allow_unused=True, retain_graph=True)
                 if leaves else ())
    for c in calls:
        c.grad_outputs = dict.fromkeys(c.output_keys)
        c.grad_inputs = dict.fromkeys(c.input_keys)
        c.param_grads = dict.fromkeys(c.param_names)
        for slots, kept in ((c.grad_outputs, c.out_keep), (c.grad_inputs, c.in_keep),
                            (c.param_grads, c.zeros)):
            for key in kept:
                slots[key] = next(grads)
    for c in calls:
        c.vjp_inputs = dict.fromkeys(c.input_keys)
        c.vjp_params = dict.fromkeys(c.param_names)
        cotangents = [(c.out_keep[k], g) for k, g in c.grad_outputs.items() if g is not None]
        targets = [*c.in_keep.values(), *c.zeros.values()]
        if not cotangents or not targets:
            continue
        vjp = torch.autograd.grad([t for t, _ in cotangents], targets,
                                  grad_outputs=[g for _, g in cotangents],
                                  allow_unused=True, retain_graph=True)
        n_in = len(c.in_keep)
        for key, g in zip(c.in_keep, vjp[:n_in]):
            c.vjp_inputs[key] = g
        for key, g in zip(c.zeros, vjp[n_in:]):
            c.vjp_params[key] = g
