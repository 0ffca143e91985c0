"""GradRecord: what one call of one module saw in backward, under readable names.

Also the slot-naming rules shared by capture and its consumers: how forward arguments and
(nested) outputs are turned into keys like ``"input"``, ``"args.0"``, ``"output"``, ``"0"``,
``"logits"``, ``"hidden.1"``.
"""

from __future__ import annotations

import html
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

    def __repr__(self) -> str:
        """One line per slot kind, each tensor as its shape, dtype and norm (never its values).

        Example:
            >>> import torch
            >>> rec = GradRecord("fc", "Linear", 0, {"input": None},
            ...                  {"output": torch.ones(2, 3)}, {"weight": torch.zeros(3, 4)})
            >>> rec
            GradRecord(Linear 'fc' call 0,
              grad_outputs={output: 2x3 float32 norm 2.449},
              grad_inputs={input: None},
              param_grads={weight: 3x4 float32 norm 0})
        """
        parts = [f"{self.module_type} {self.module_name!r} call {self.call}"]
        for slot in ("grad_outputs", "grad_inputs", "param_grads", "inputs", "outputs"):
            tensors = getattr(self, slot)
            if tensors or slot.startswith("grad") or slot == "param_grads":
                parts.append(f"{slot}={{{', '.join(f'{k}: {_brief(t)}' for k, t in tensors.items())}}}")
        if self.notes:
            parts.append(f"notes={list(self.notes)!r}")
        return "GradRecord(" + ",\n  ".join(parts) + ")"

    def _repr_html_(self) -> str:
        """The :meth:`describe` table as HTML, for notebooks."""
        rows = [describe_row(role, key, grad) for role, key, grad in self.slots()]
        head = "".join(f"<th>{h}</th>" for h in ("slot", "role", "shape", "dtype", "norm",
                                                   "meaning"))
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
                       for row in rows)
        notes = "".join(f"<p>note: {html.escape(n)}</p>" for n in self.notes)
        title = html.escape(f"{self.module_type} {self.module_name!r} call {self.call}")
        return f"<b>{title}</b><table><tr>{head}</tr>{body}</table>{notes}"

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


def _brief(t: Tensor | None) -> str:
    """A tensor in a few words: shape, dtype and norm."""
    if t is None:
        return "None"
    shape = "x".join(str(s) for s in t.shape) or "scalar"
    if not t.is_floating_point() and not t.is_complex():
        return f"{shape} {str(t.dtype).removeprefix('torch.')}"
    norm = float(torch.linalg.vector_norm(t.detach().double()))
    return f"{shape} {str(t.dtype).removeprefix('torch.')} norm {format_number(norm)}"


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


def short_meaning(role: str, key: str, grad: Tensor | None) -> str:
    """What :func:`meaning` says, in a few words (a table that explains the roles once)."""
    text = {"output": f"dL/d {key}, from its uses after the call",
            "input": f"dL/d {key} via this call only"}.get(role, f"this call's share of dL/d {key}")
    return text + (" (none)" if grad is None else "")


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
