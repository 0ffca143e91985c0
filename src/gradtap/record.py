"""GradRecord: what one call of one module saw in backward, under readable names.

Also the slot-naming rules shared by capture and its consumers: how forward arguments and
(nested) outputs are turned into keys like ``"input"``, ``"args.0"``, ``"output"``, ``"0"``,
``"logits"``, ``"hidden.1"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from gradtap._text import format_number, format_table

__all__ = ["GradRecord", "flatten_tensors", "map_tensors"]

Slots = dict[str, "Tensor | None"]


@dataclass(frozen=True, slots=True)
class GradRecord:
    """Everything one call of a module touched in backward, keyed by readable names.

    Attributes:
        module_name: qualified name from ``named_modules()``, e.g. ``"layer1.0.conv1"``.
        module_type: class name, e.g. ``"Conv2d"``.
        call: 0 for this module's first call since the tap started or was cleared, 1, 2, ...
        grad_inputs: forward argument name -> dL/d(that input) via this call only; ``None`` for
            an input that does not require grad or received no gradient.
        grad_outputs: output path (``"output"``, ``"0"``, dict key, nested ``"a.0"``) -> what
            flowed back into this call through that output: the gradient w.r.t. the value the
            call returned, from its uses after the call returned (uses inside the call are not
            part of it, as with ``register_full_backward_hook``); ``None`` when nothing after
            the call used it.
        param_grads: parameter name relative to the module (``"weight"``, ``"0.bias"``) -> this
            call's contribution to its gradient; ``None`` if the call did not use it.
        inputs: forward inputs under the ``grad_inputs`` keys, when kept, else empty.
        outputs: forward outputs under the ``grad_outputs`` keys, when kept, else empty.
        notes: plain-language remarks where a gradient could not be attributed to this call.
    """

    module_name: str
    module_type: str
    call: int
    grad_inputs: Slots
    grad_outputs: Slots
    param_grads: Slots
    inputs: dict[str, Tensor] = field(default_factory=dict)
    outputs: dict[str, Tensor] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def slots(self) -> Iterator[tuple[str, str, Tensor | None]]:
        """Yield ``(role, key, gradient)`` for every slot: outputs, inputs, then parameters."""
        for key, grad in self.grad_outputs.items():
            yield "output", key, grad
        for key, grad in self.grad_inputs.items():
            yield "input", key, grad
        for key, grad in self.param_grads.items():
            yield "parameter", key, grad

    def describe(self) -> str:
        """Return a readable table of this record: slot, role, shape, dtype, norm, meaning.

        Example:
            >>> import torch, gradtap as gt
            >>> lin = torch.nn.Linear(3, 2)
            >>> with gt.tap(lin, select="") as t:
            ...     lin(torch.randn(4, 3)).sum().backward()
            >>> print(t.records[0].describe().splitlines()[0])
            Linear '' call 0
        """
        title = f"{self.module_type} {self.module_name!r} call {self.call}"
        rows = [describe_row(role, key, grad) for role, key, grad in self.slots()]
        lines = [title, *format_table(["slot", "role", "shape", "dtype", "norm", "meaning"], rows)]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def describe_row(role: str, key: str, grad: Tensor | None) -> list[str]:
    """One row of :meth:`GradRecord.describe` (also used by ``explain``)."""
    slot = key
    if grad is None:
        return [slot, role, "-", "-", "-", meaning(role, key, None)]
    norm = float(torch.linalg.vector_norm(grad.detach().double()))
    return [
        slot,
        role,
        "x".join(str(s) for s in grad.shape) or "scalar",
        str(grad.dtype).removeprefix("torch."),
        format_number(norm),
        meaning(role, key, grad),
    ]


def meaning(role: str, key: str, grad: Tensor | None) -> str:
    """Explain in words what the gradient in one slot is."""
    if role == "output":
        text = (f"dL/d {key}: what flowed back into this call through output '{key}' "
                "(its uses after the call returned)")
    elif role == "input":
        text = f"dL/d {key}: gradient of the loss w.r.t. input '{key}' via this call only"
    else:
        text = f"dL/d {key}: gradient of the loss w.r.t. this layer's {key}, this call's share"
    if grad is None:
        return text + " (none: does not require grad or got no gradient)"
    return text


def flatten_tensors(obj: Any, prefix: str, *, under_prefix: bool = False) -> list[tuple[str, Tensor]]:
    """Return ``(path, tensor)`` for every tensor leaf of a nested output or argument.

    Paths follow docs/semantics.md ("Records"): a lone tensor gets ``prefix``, tuple and list items their index,
    mappings (dicts, ``ModelOutput``) their keys, nested parts joined by ``"."``. Outputs use
    ``prefix="output"`` (a tuple output gives ``"0"``, ``"1"``); arguments use their name with
    ``under_prefix=True`` (a tuple argument ``hx`` gives ``"hx.0"``, ``"hx.1"``). Non-tensor
    leaves are skipped.
    """
    if isinstance(obj, Tensor):  # the common case: a module returning one tensor
        return [(prefix, obj)]
    out: list[tuple[str, Tensor]] = []
    _flatten(obj, prefix, out, top=not under_prefix)
    return out


def _flatten(obj: Any, path: str, out: list[tuple[str, Tensor]], top: bool) -> None:
    if isinstance(obj, Tensor):
        out.append((path, obj))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, _join("" if top else path, str(k)), out, top=False)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _flatten(v, _join("" if top else path, str(i)), out, top=False)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a else b


def map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """Rebuild a nested structure with ``fn`` applied to every tensor leaf.

    Mappings are rebuilt with their own type where it can be constructed from a dict, else
    updated in place (``ModelOutput``-like classes support item assignment).
    """
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: map_tensors(v, fn) for k, v in obj.items()}
        try:
            return cast(Any, type(obj))(items)
        except Exception:  # noqa: BLE001 - fall back to item assignment for exotic mappings
            for k, v in items.items():
                obj[k] = v  # type: ignore[index]
            return obj
    if isinstance(obj, tuple):
        mapped = [map_tensors(v, fn) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*mapped)
        return type(obj)(mapped) if type(obj) is not tuple else tuple(mapped)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    return obj
