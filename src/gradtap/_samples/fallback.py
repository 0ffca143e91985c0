"""Generic per-sample gradients by replaying a call, built on ``torch.func``.

A call of a module is replayed per sample: sample n's gradient is the gradient, w.r.t. the
parameters, of ``<module(x_n), go_n>``, where ``x_n`` is sample n's part of every argument
that has one and ``go_n`` its (scaled) output gradient; where each argument and output holds
the samples is :mod:`gradtap._samples.layout`'s business (rows along the sample dim by
default, an argument without them shared by all samples; a 0-dim output reduced over the
batch keeps its gradient as the cotangent of every sample's value). This is exact for any
call whose forward treats samples independently and is deterministic. Two ways, the first
that works:

* ``vmap(grad(...))`` over samples with ``functional_call``: one vectorized forward and
  backward of the call;
* a loop over samples with ``torch.autograd.grad``, where ``vmap`` cannot run the forward
  (data-dependent shapes such as boolean-mask indexing, ``.item()``, control flow on values),
  or the samples are ragged (packed sequences, bags), or an output holds the whole batch on one
  sample's replay (a call whose argument is the batch size: cut to that sample's rows).

Used for a module without a rule (its arguments as passed; from its record's tensor arguments,
with defaults for the others, when the call was not kept) and, by
:mod:`gradtap._samples.api`, for a whole enclosing call when no rule can map a parameter.

Random ops (dropout in training mode) cannot be replayed identically: ``vmap`` refuses them,
and the loop notices that the random number generator moved; both raise.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from gradtap._samples.fallback_errors import CannotReplay
from gradtap._samples.layout import CallSplit, Dim, Scalar, Slot, restore, split_call
from gradtap.capture import AutocastState, RngState, buffers_restored
from gradtap.errors import UnsupportedModuleError
from gradtap.record import flatten_tensors

__all__ = ["CannotReplay", "grad_fallback", "quiet_vmap", "replay_call"]


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
            raise CannotReplay(
                f"argument {p.name!r} of module {name!r} ({type(module).__name__}) was not a "
                "tensor, and its record keeps only tensor arguments"
            )
    return [*args, *star], kwargs


def _random_error(name: str, module: nn.Module) -> UnsupportedModuleError:
    return UnsupportedModuleError(
        f"per-sample fallback for module {name!r} ({type(module).__name__}) replays its "
        "forward, which draws random numbers (dropout in training mode?): the replay would "
        "not see the same randomness; call .eval() on the random submodules or register a "
        "per-sample rule for this type"
    )


def replay_call(
    module: nn.Module,
    name: str,
    args: tuple | list,
    kwargs: dict[str, Any],
    grad_outputs: dict[str, Tensor],
    params: dict[str, Tensor],
    batch_dim: int,
    n: int,
    scale: float,
    samples: slice | None = None,
    autocast: AutocastState | None = None,
    outputs: dict[str, Tensor] | None = None,
    members: list[bool] | None = None,
) -> dict[str, Tensor]:
    """Per-sample gradients ``[n, *shape]`` of ``params`` through one call of ``module``.

    Args:
        module: the module whose call is replayed.
        name: its qualified name (for messages).
        args, kwargs: the call's arguments, as passed (tensors are detached for the replay).
        grad_outputs: gradients w.r.t. the call's outputs, by output path (``"output"``,
            ``"0"``, ``"last_hidden_state"``...); each holds the ``n`` samples where the
            call's layout says (``_samples.layout``), or is 0-dim.
        params: the parameters to differentiate, by name relative to ``module``. A name not
            under ``module`` (a parameter it receives some other way) is differentiated too,
            by the loop only.
        batch_dim: the sample dim of arguments and outputs.
        n: the number of samples; an argument with another size along ``batch_dim`` (or
            without that dim) is shared by all samples.
        scale: factor turning ``grad_outputs`` into per-sample output gradients.
        samples: only these samples (a chunk), default all.
        autocast: the autocast settings of the original call.
        outputs: the call's integer outputs by path, where known (a packed output's batch
            sizes: ``layout.CallSplit.note_outputs``).
        members: whether each argument was computed from the batch, where known
            (``layout.split_call``).

    Returns:
        ``{name: [len(samples), *param.shape]}``.

    Raises:
        CannotReplay: an output gradient has no row per sample, or the replay failed.
        UnsupportedModuleError: the forward draws random numbers.
    """
    split = split_call(module, args, kwargs, n, batch_dim, outputs, members)
    slots = {path: split.output_slot(path, g) for path, g in grad_outputs.items()}
    sl = samples or slice(0, n)
    # The cotangent of each output on one sample: d s_n / d output; a 0-dim output (a value
    # reduced over the batch) keeps its gradient as is.
    scales = {path: 1.0 if isinstance(slot, Scalar) else scale for path, slot in slots.items()}
    own = {k for k, _ in module.named_parameters(remove_duplicate=False)}
    with buffers_restored(module), torch.enable_grad(), \
            autocast.entered() if autocast is not None else nullcontext():
        if all(k in own for k in params) and split.vmappable and all(
                s.vmappable for s in slots.values()):
            try:
                return _vmapped(module, split, grad_outputs, slots, scales, params, sl)
            except UnsupportedModuleError:
                raise
            except Exception as err:  # noqa: BLE001 - vmap cannot run every forward: loop
                if "randomness" in str(err):
                    raise _random_error(name, module) from err
        try:
            return _looped(module, name, split, grad_outputs, slots, scales, params, sl)
        except (UnsupportedModuleError, CannotReplay):
            raise
        except Exception as err:  # noqa: BLE001 - say which call, keep the cause
            raise CannotReplay(f"its replay failed: {type(err).__name__}: {err}") from err


class _OtherShape(Exception):  # noqa: N818 - internal signal: vmap cannot narrow, loop
    """An output on one sample has another shape than its gradient's part."""


def _sum_products(out: Any, gs: dict[str, Tensor], slots: dict[str, Slot], n: int,
                  i: int | None) -> Tensor | None:
    """``sum_k <out_k, gs_k>`` over the output paths with a gradient. An output that still
    holds the whole batch along its slot (a call whose only argument is the batch size) is
    cut to sample ``i``'s part (``None`` inside ``vmap``: refused, the loop does it)."""
    total: Tensor | None = None
    for path, o in flatten_tensors(out, "output"):
        g = gs.get(path)
        if g is None:
            continue
        slot = slots[path]
        if o.shape != g.shape:
            if i is None:
                raise _OtherShape(path)
            if isinstance(slot, Dim) and slot.rows(o) == n:
                o = slot.take(o, i)
            if o.shape != g.shape:
                raise CannotReplay(
                    f"its output {path!r} on one sample has shape {tuple(o.shape)}, but its "
                    f"gradient's part for that sample has shape {tuple(g.shape)}")
        term = (o * g).sum()
        total = term if total is None else total + term
    return total


def _vmapped(module: nn.Module, split: CallSplit, grad_outputs: dict[str, Tensor],
             slots: dict[str, Slot], scales: dict[str, float], params: dict[str, Tensor],
             sl: slice) -> dict[str, Tensor]:
    xs = split.stacked(sl)
    n = split.n
    gs = {k: slots[k].stacked(g, n)[sl] * scales[k] for k, g in grad_outputs.items()
          if not isinstance(slots[k], Scalar)}
    shared = {k: g for k, g in grad_outputs.items() if isinstance(slots[k], Scalar)}
    diff = {k: v.detach() for k, v in params.items()}

    def sample_loss(p: dict[str, Tensor], x: list[Tensor], g: dict[str, Tensor]) -> Tensor:
        a, k = split.rebuild(x)
        out = functional_call(module, p, tuple(a), k, strict=False)
        total = _sum_products(out, {**g, **shared}, slots, n, None)
        if total is None:
            return sum(v.sum() * 0 for v in p.values())  # type: ignore[return-value]
        return total

    with quiet_vmap():
        out = vmap(grad(sample_loss), in_dims=(None, 0, 0), randomness="error")(diff, xs, gs)
    # The module's other parameters took part as constants of grad's function, not of ours.
    return {k: v.detach() for k, v in out.items()}


def _looped(module: nn.Module, name: str, split: CallSplit, grad_outputs: dict[str, Tensor],
            slots: dict[str, Slot], scales: dict[str, float], params: dict[str, Tensor],
            sl: slice) -> dict[str, Tensor]:
    names = list(params)
    leaves = [params[k] for k in names]
    out: dict[str, list[Tensor]] = {k: [] for k in names}
    rng = RngState([leaf.device for leaf in leaves if leaf.device.type == "cuda"][:1])
    for i in range(sl.start, sl.stop):
        a, k = split.one(i)
        result = module(*a, **k)
        g_i = {p: slots[p].take(g, i) * scales[p] for p, g in grad_outputs.items()}
        total = _sum_products(result, g_i, slots, split.n, i)
        grads: tuple[Tensor | None, ...] = (None,) * len(leaves)
        if total is not None and total.requires_grad:
            grads = torch.autograd.grad(total, leaves, allow_unused=True)
        for key, leaf, g in zip(names, leaves, grads, strict=True):
            out[key].append(torch.zeros_like(leaf) if g is None else g)
    if rng.moved():
        raise _random_error(name, module)
    return {k: torch.stack(v) if v else leaf.new_zeros((0, *leaf.shape))
            for (k, v), leaf in zip(out.items(), leaves, strict=True)}


def grad_fallback(
    module: nn.Module,
    name: str,
    inputs: dict[str, Tensor],
    grad_outputs: dict[str, Tensor | None],
    names: frozenset[str],
    batch_dim: int,
    scale: float,
    samples: slice | None = None,
    n: int | None = None,
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
        n: the batch size; default: the first input's size along ``batch_dim``.

    Returns:
        ``{name: [n, *param.shape]}`` for the chosen samples.

    Raises:
        CannotReplay: see :func:`replay_call`; also a non-tensor argument without a default.
        UnsupportedModuleError: the forward draws random numbers.
    """
    if n is None:
        n = next(iter(inputs.values())).shape[batch_dim]
    args, kwargs = _bind(module, name, restore(module, _nest(inputs)))
    every: dict[str, Tensor] = dict(module.named_parameters())
    params = {k: every[k] for k in names}
    gs = {k: g for k, g in grad_outputs.items() if g is not None}
    return replay_call(module, name, args, kwargs, gs, params, batch_dim, n, scale, samples)
