"""explain: answer "what are grad_input and grad_output of this layer?" with a table."""

from __future__ import annotations

import shutil
import textwrap
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._text import format_table
from gradtap._types import Selector
from gradtap.capture import buffers_restored, compiled_feature, legacy_backward_grads, session, tap
from gradtap.record import GradRecord, describe_row, flatten_tensors, meaning, short_meaning

__all__ = ["Explanation", "explain"]

_HEADER = ["slot", "role", "shape", "dtype", "norm", "meaning"]


@dataclass(frozen=True)
class Explanation:
    """The result of :func:`explain`: records plus, with ``legacy=True``, legacy indices.

    Attributes:
        records: one :class:`GradRecord` per module call, in the order backward finished them.
        legacy: ``{(module_name, call): {slot_key: "i" | "i (transposed)" | "-"}}`` where ``i``
            is the index of that slot in the legacy ``register_backward_hook``'s ``grad_input``;
            empty unless ``legacy=True``.
    """

    records: list[GradRecord]
    legacy: dict[tuple[str, int], dict[str, str]] = field(default_factory=dict)

    def table(self, record: GradRecord) -> list[str]:
        """Return the table lines of one record (header first)."""
        header = list(_HEADER)
        rows = []
        legacy = self.legacy.get((record.module_name, record.call)) if self.legacy else None
        for role, key, grad in record.slots():
            row = describe_row(role, key, grad)
            row[-1] = short_meaning(role, key, grad)
            if legacy is not None:
                row.insert(-1, legacy.get(f"{role}:{key}", "-"))
            rows.append(row)
        if legacy is not None:
            header.insert(-1, "legacy")
        return format_table(header, rows)

    def __str__(self) -> str:
        return self.render(shutil.get_terminal_size().columns)

    def render(self, width: int | None = None) -> str:
        """The tables of every record and a legend. With ``width``, table rows are cut to it
        (with ``...``) and the legend and notes wrapped; titles stay whole. ``str()`` uses the
        terminal's width (``COLUMNS`` where set)."""

        def fit(lines: list[str]) -> list[str]:
            if not width:
                return lines
            return [line if len(line) <= width else line[:max(width - 3, 1)] + "..."
                    for line in lines]

        def wrap(text: str) -> str:
            return "\n".join(textwrap.wrap(text, width)) if width else text

        blocks = []
        for rec in self.records:
            title = f"{rec.module_type} {rec.module_name or '(root)'!r} call {rec.call}"
            lines = [title, *fit(self.table(rec)), *(wrap(f"note: {n}") for n in rec.notes)]
            blocks.append("\n".join(lines))
        legend = (
            "Each row is one gradient the backward of that call touched: 'output' rows are "
            "what flowed back into this call through that output (from its uses after the "
            "call returned), 'input' rows the gradient this call sent to that forward "
            "argument, 'parameter' rows this call's share of p.grad."
        )
        if self.legacy:
            legend += (" 'legacy' is the index of that gradient in grad_input of the legacy "
                       "module.register_backward_hook ('-': not there).")
        return "\n\n".join([*blocks, wrap(legend)])

    def to_dict(self) -> dict[str, Any]:
        """The explanation as plain JSON-ready values (the form ``gradtap explain --json``
        prints): ``{"format": "gradtap.explain", "version": 1, "records": [...]}``, one entry
        per record in backward order with ``module_name``, ``module_type``, ``call``, ``notes``
        and ``slots``: per gradient touched, ``key``, ``role`` (``output``, ``input`` or
        ``parameter``), ``shape`` (``None`` for no gradient), ``dtype``, ``norm`` (float64 L2
        norm), ``meaning`` and, with ``legacy=True``, ``legacy``.

        Example:
            >>> import torch, gradtap as gt
            >>> d = gt.explain(torch.nn.Sequential(torch.nn.Linear(3, 2)), torch.randn(4, 3)).to_dict()
            >>> [(s["key"], s["role"], s["shape"]) for s in d["records"][0]["slots"]]
            [('output', 'output', [4, 2]), ('input', 'input', None), ('weight', 'parameter', [2, 3]), ('bias', 'parameter', [2])]
        """
        records = []
        for rec in self.records:
            legacy = self.legacy.get((rec.module_name, rec.call)) if self.legacy else None
            slots = []
            for role, key, grad in rec.slots():
                slot: dict[str, Any] = {
                    "key": key, "role": role,
                    "shape": None if grad is None else list(grad.shape),
                    "dtype": None if grad is None else str(grad.dtype).removeprefix("torch."),
                    "norm": None if grad is None else float(
                        torch.linalg.vector_norm(grad.detach().double())),
                    "meaning": meaning(role, key, grad)}
                if legacy is not None:
                    slot["legacy"] = legacy.get(f"{role}:{key}", "-")
                slots.append(slot)
            records.append({"module_name": rec.module_name, "module_type": rec.module_type,
                            "call": rec.call, "notes": list(rec.notes), "slots": slots})
        return {"format": "gradtap.explain", "version": 1, "records": records}

    def _repr_html_(self) -> str:
        """Every record's table as HTML, for notebooks."""
        return "".join(rec._repr_html_() for rec in self.records)


def explain(
    model: nn.Module,
    inputs: Tensor | tuple[Any, ...] | Mapping[str, Any],
    *,
    loss: Callable[[Any], Tensor] | None = None,
    select: Selector | None = None,
    legacy: bool = False,
) -> Explanation:
    """Run one forward and backward and explain every gradient each selected layer saw.

    The model's parameters' ``.grad`` and its buffers (e.g. BatchNorm running statistics) are
    restored afterwards, so explaining a model in the middle of training changes nothing.

    Args:
        model: the model.
        inputs: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
        loss: ``loss(output) -> scalar``; by default the sum of every floating tensor in the output.
        select: which modules to explain; by default every submodule, or the model itself
            (``select=""``) when it has no submodules, e.g. ``explain(nn.Linear(5, 3), x)``.
        legacy: also show each slot's index in ``grad_input`` of the legacy
            ``register_backward_hook``, found by matching values.

    Returns:
        An :class:`Explanation`; ``print()`` it for the table.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Flatten(), torch.nn.Linear(8, 2))
        >>> ex = gt.explain(net, torch.randn(2, 1, 4, 4), legacy=True)
        >>> ex.legacy[("2", 0)]["parameter:weight"]
        '2 (transposed)'
    """
    state = session(model, "explain()")
    if select is None:  # a model without submodules (a bare layer) is explained itself
        select = "*" if next(state.root.children(), None) is not None else ""
    selected = state.modules(select)
    saved_grads = {p: p.grad for p in model.parameters()}
    for p in saved_grads:
        p.grad = None  # backward would otherwise accumulate into the user's tensors in place
    legacy_hooks, legacy_seen = legacy_backward_grads(selected) if legacy else (None, {})
    try:
        with buffers_restored(model), compiled_feature(None), tap(model, select=select) as t, \
                warnings.catch_warnings():
            # The legacy hook warns that it is deprecated; that is why we are here.
            warnings.filterwarnings("ignore", message=".*non-full backward hook.*")
            output = _call(model, inputs)
            value = loss(output) if loss is not None else _sum_outputs(output)
            if not isinstance(value, Tensor) or value.numel() != 1:
                raise ValueError(f"loss must return a scalar tensor; got {_describe(value)}")
            if not value.requires_grad:
                raise ValueError("the loss does not require grad: no parameter or input of the "
                                 "model requires grad, or the forward ran under no_grad")
            value.backward()
        records = list(t.records)
    finally:
        if legacy_hooks is not None:
            legacy_hooks.remove()
        for p, g in saved_grads.items():
            p.grad = g
    legacy_map = {}
    if legacy:
        legacy_map = {(r.module_name, r.call): _match_legacy(r, legacy_seen.get(r.module_name, []))
                      for r in records}
    return Explanation(records=records, legacy=legacy_map)


def _call(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Tensor):
        return model(inputs)
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    raise TypeError(
        f"inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments; got {type(inputs).__name__}"
    )


def _sum_outputs(output: Any) -> Tensor:
    leaves = [t for _, t in flatten_tensors(output, "output") if t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor; pass loss=")
    return sum((t.sum() for t in leaves[1:]), leaves[0].sum())


def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _match_legacy(record: GradRecord, firings: list[tuple]) -> dict[str, str]:
    """Find, by value, the index each slot had in the legacy hook's grad_input."""
    found: dict[str, str] = {}
    for role, key, grad in record.slots():
        if role == "output" or grad is None:
            continue
        for grad_input in firings:
            index = _index_of(grad, grad_input)
            if index is not None:
                found[f"{role}:{key}"] = index
                break
    return found


def _index_of(grad: Tensor, candidates: tuple) -> str | None:
    for i, c in enumerate(candidates):
        if c is None:
            continue
        if c.shape == grad.shape and torch.allclose(c, grad, rtol=1e-5, atol=1e-7):
            return str(i)
        if c.dim() == 2 and c.shape == grad.shape[::-1] and torch.allclose(c.T, grad, rtol=1e-5, atol=1e-7):
            return f"{i} (transposed)"
    return None
