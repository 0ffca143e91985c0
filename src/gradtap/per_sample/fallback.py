"""Generic per-sample gradients for a module without a rule, built on ``torch.func``.

The module's call is replayed per sample under ``vmap(grad(...))`` with ``functional_call``:
sample n's gradient is the gradient of ``<module(x_n), go_n>`` w.r.t. the parameters, where
``go_n`` is its (scaled) output gradient from the record. This is exact for any module whose
forward treats samples independently and is deterministic; it costs a second forward and
backward of the module, per sample, vectorized.

Limitations (all raise a clear error or are documented): forward arguments that are not
tensors are not seen by the record, so the replay uses their defaults; random ops (dropout in
training mode) cannot be replayed identically and raise.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from gradtap.errors import UnsupportedModuleError
from gradtap.record import flatten_tensors

__all__ = ["grad_fallback", "quiet_vmap"]


@contextmanager
def quiet_vmap() -> Iterator[None]:
    """Silence torch's warning about ops that ``vmap`` runs as a loop (no batching rule).

    Being slower than a dedicated rule is what the generic path is known for, not news to
    the user, and it fires inside backward where it cannot be acted on.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*performance drop.*batching rule")
        yield


def _nest(flat: dict[str, Tensor]) -> dict[str, Any]:
    """Rebuild nested arguments from record keys (``"hx.0"``, ``"hx.1"`` -> a tuple ``hx``)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = tree
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: build(v) for k, v in node.items()}
        if items and all(k.isdigit() for k in items):
            return tuple(items[k] for k in sorted(items, key=int))
        return items

    return {k: build(v) for k, v in tree.items()}


def _bind(module: nn.Module, name: str, inputs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments that reproduce the recorded call."""
    args: list[Any] = []
    kwargs = dict(inputs)
    params = list(inspect.signature(module.forward).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
    star = kwargs.pop(varargs, ()) if varargs else ()
    # Arguments before the last positional one present (or before *args) go by position.
    present = [i for i, p in enumerate(positional) if p.name in kwargs]
    last = len(positional) - 1 if star else (present[-1] if present else -1)
    for p in positional[: last + 1]:
        if p.name in kwargs:
            args.append(kwargs.pop(p.name))
        elif p.default is not p.empty:
            args.append(p.default)
        else:
            raise UnsupportedModuleError(
                f"per-sample fallback for module {name!r} ({type(module).__name__}) cannot replay "
                f"its call: argument {p.name!r} was not a tensor, and the record keeps only "
                "tensor arguments; register a per-sample rule for this type "
                "(gradtap.per_sample.table.GRAD) or leave it out of select="
            )
    return [*args, *star], kwargs


def grad_fallback(
    module: nn.Module,
    name: str,
    inputs: dict[str, Tensor],
    grad_outputs: dict[str, Tensor | None],
    names: frozenset[str],
    batch_dim: int,
    scale: float,
    samples: slice | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients ``[N, *param.shape]`` of the parameters ``names`` of ``module``.

    Args:
        module: the module whose call is replayed.
        name: its qualified name (for error messages).
        inputs: the record's forward inputs (tensor arguments by record key).
        grad_outputs: the record's output gradients (by output path).
        names: parameter names relative to ``module`` to differentiate.
        batch_dim: the sample dim of every input and output.
        scale: factor turning ``grad_outputs`` into per-sample output gradients.
        samples: only these samples (a chunk), default all.

    Returns:
        ``{name: [n, *param.shape]}`` for the chosen samples.
    """
    n = next(iter(inputs.values())).shape[batch_dim]

    def take(t: Tensor) -> Tensor:
        return t if samples is None else t.narrow(batch_dim, samples.start, samples.stop - samples.start)

    def batched(t: Tensor) -> bool:
        return t.dim() > batch_dim and t.shape[batch_dim] == n

    xs = {k: take(v) if batched(v) else v for k, v in inputs.items()}
    x_dims = {k: batch_dim if batched(v) else None for k, v in inputs.items()}
    gs = {k: take(v) * scale for k, v in grad_outputs.items() if v is not None}
    for k, v in gs.items():
        if not batched(grad_outputs[k]):  # type: ignore[arg-type]
            raise UnsupportedModuleError(
                f"per-sample fallback for module {name!r}: output {k!r} has shape "
                f"{tuple(v.shape)}, with no sample dim {batch_dim} of size {n}"
            )
    everything = {k: v.detach() for k, v in module.named_parameters()}
    diff = {k: everything.pop(k) for k in names}
    fixed = {**everything, **dict(module.named_buffers())}

    def sample_loss(p: dict[str, Tensor], x: dict[str, Tensor], g: dict[str, Tensor]) -> Tensor:
        x = {k: v.unsqueeze(batch_dim) if x_dims[k] is not None else v for k, v in x.items()}
        args, kwargs = _bind(module, name, _nest(x))
        out = functional_call(module, (p, fixed), tuple(args), kwargs, strict=False)
        total = torch.zeros((), dtype=next(iter(p.values())).dtype, device=next(iter(p.values())).device)
        for path, o in flatten_tensors(out, "output"):
            if path in g:
                total = total + (o * g[path].unsqueeze(batch_dim)).sum()
        return total

    g_dims = dict.fromkeys(gs, batch_dim)
    try:
        with quiet_vmap():
            return vmap(grad(sample_loss), in_dims=(None, x_dims, g_dims), randomness="error")(
                diff, xs, gs
            )
    except RuntimeError as err:
        if "randomness" not in str(err):
            raise
        raise UnsupportedModuleError(
            f"per-sample fallback for module {name!r} ({type(module).__name__}) replays its "
            "forward, which draws random numbers (dropout in training mode?): the replay would "
            "not see the same randomness; call .eval() on the random submodules or register a "
            "per-sample rule for this type"
        ) from err
