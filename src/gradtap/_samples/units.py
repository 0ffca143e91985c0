"""Calls of enclosing modules ("units"), kept for a replay, and the check that catches a wrong split.

Some parameters cannot get per-sample gradients from their own module's call: its input is
shared by all samples and its output gradient is already summed over them (a position
embedding called on ``[1, T]``), its samples are folded with other rows (attention windows
in the batch dim), it is called on one sample at a time (``h[i:i+1]``), or its recorded output
gradient cannot be trusted. The split then has to come from a call further out whose output
gradient does have one row per sample: ``per_sample`` keeps the arguments of the calls of
every module that encloses an owner of a selected parameter, and replays the innermost one
that works (:func:`gradtap._samples.fallback.replay_call`).

Which calls are kept: during the forward every enclosing call is noted (its arguments by
reference); when the outermost one returns, only the outermost calls and the calls that
enclose a use of a parameter already known to need a replay are kept; their output gradients
are kept until the end of that backward.

The check: after each backward, the per-sample gradients of every parameter must reduce
(mean or sum) to what that backward added to its ``.grad``. That increment is seen by a hook
on the parameter (held by reference until the end of the backward); the norms of the
differences are taken with the ``torch._foreach`` kernels and read in one host copy.
"""

from __future__ import annotations

import enum
import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._samples.fallback import CannotReplay, replay_call
from gradtap._samples.layout import CallSplit, split_call
from gradtap.capture import AutocastState, HookSet, made_since, mark_boundary, sequence_mark
from gradtap.record import flatten_tensors

__all__ = ["MAX_OUTER_CALLS", "Frame", "candidates", "frames_of", "innermost_around",
           "largest_norm", "mismatches", "replay_frames", "tolerance", "watch_outputs"]

#: Outermost calls kept per forward group (forwards since the last backward); a group that
#: runs more forwards than this without a backward starts over, so nothing piles up.
MAX_OUTER_CALLS = 64


class Frame:
    """One call of an enclosing module: its arguments, and later its output gradients."""

    __slots__ = ("name", "module", "args", "kwargs", "versions", "start", "autocast", "grads",
                 "keep", "outer", "settled", "chain", "index_outputs", "members")

    def __init__(self, name: str, module: nn.Module, args: tuple, kwargs: dict[str, Any],
                 outer: bool, around: tuple[Frame, ...] = (),
                 members: list[bool] | None = None) -> None:
        self.name, self.module, self.outer = name, module, outer
        self.chain: tuple[Frame, ...] = (*around, self)  # the calls around it, outermost first
        self.args: tuple | None = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.versions = [(t, t._version) for _, t in flatten_tensors((args, kwargs), "a")]
        self.start = sequence_mark()
        self.autocast = AutocastState.capture()
        self.grads: dict[str, Tensor] = {}
        # The integer tensors it returned (a packed output's batch sizes and order), by path.
        self.index_outputs: dict[str, Tensor] = {}
        # Whether each argument was computed from the batch (``membership``), if followed.
        self.members = members
        self.keep = False
        self.settled = False

    def owns_output(self, t: Tensor) -> bool:
        """Whether output ``t`` was made by this call (not an argument passed through)."""
        return t.requires_grad and made_since(t, self.start)

    def changed(self) -> str | None:
        """Why a replay of this call would not see what the call saw, or ``None``."""
        if self.args is None:
            return "its call was not kept"
        for t, version in self.versions:
            if t._version != version:
                return f"an argument of shape {tuple(t.shape)} was modified in place after the call"
        opaque = _opaque((self.args, self.kwargs))
        if opaque is not None:
            return (f"an argument of type {opaque} may hold state that a replay would change "
                    "(a cache)")
        return None

    def split(self, n: int, batch_dim: int,
              outputs: dict[str, Tensor] | None = None) -> CallSplit | None:
        """The call's arguments split into samples (``None`` once dropped); ``outputs``: its
        outputs by path, where they are known (``layout.split_call``)."""
        if self.args is None or self.kwargs is None:
            return None
        return split_call(self.module, self.args, self.kwargs, n, batch_dim, outputs,
                          self.members)

    def drop(self) -> None:
        self.args = self.kwargs = None
        self.versions = []
        self.grads = {}
        self.keep = False


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.Size, enum.Enum, slice, range, type, nn.Module, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType, functools.partial)


def _opaque(obj: Any) -> str | None:
    """The type name of the first argument leaf that is not a tensor or a plain value."""
    if isinstance(obj, (Tensor, *_PLAIN)):
        return None
    if isinstance(obj, (tuple, list)):
        return next((o for o in map(_opaque, obj) if o is not None), None)
    if isinstance(obj, dict) and type(obj) is dict:
        return next((o for o in map(_opaque, obj.values()) if o is not None), None)
    return type(obj).__name__


def watch_outputs(frame: Frame, output: Any, hooks: HookSet,
                  seen: Callable[[Frame, str, Tensor], None]) -> None:
    """Call ``seen(frame, path, grad)`` with the gradient of each output made by the call
    from its uses after the call returned: uses inside the call (a hidden state the call also
    turned into logits) are not part of it, as for a record's ``grad_outputs``. A view, which
    cannot carry a boundary node, is watched at its own node. A tensor returned at several
    paths (a last hidden state also in the tuple of all of them) is watched at its first
    path only: its gradient is that of every use, and a replay gives the cotangent to that
    path alone, so it is not counted once per path."""
    seen_ids: set[int] = set()
    flat = flatten_tensors(output, "output")
    frame.index_outputs = {p: t for p, t in flat
                           if not (t.is_floating_point() or t.is_complex())}
    for path, t in flat:
        if not frame.owns_output(t) or id(t) in seen_ids:
            continue
        seen_ids.add(id(t))

        def sink(g: Tensor, path: str = path) -> Tensor:
            seen(frame, path, g)
            return g

        # A view of a tensor made before the call (a slice of an argument) keeps its node.
        inside = not t._is_view() or (t._base is not None and made_since(t._base, frame.start))
        if not inside or not mark_boundary(t, sink):
            hooks.gradient(t, functools.partial(seen, frame, path))


def innermost_around(names: list[str], frames: list[Frame]) -> list[Frame]:
    """The kept calls of the innermost module that encloses every one of ``names`` (modules
    none of whose calls was seen: a table read through ``.weight`` by a parent), or ``[]``."""
    if not names:
        return []
    common = [".".join(p) for p in _common_prefixes([n.split(".") if n else [] for n in names])]
    for name in reversed(common):
        found = [f for f in frames if f.name == name and f.args is not None]
        if found:
            return found
    return []


def _common_prefixes(parts: list[list[str]]) -> list[list[str]]:
    """Every proper ancestor shared by all the dotted names, outermost first (the root ``[]``
    included)."""
    shortest = min(len(p) for p in parts)
    out: list[list[str]] = [[]]
    for i in range(shortest - 1 if any(len(p) == shortest for p in parts) else shortest):
        if len({p[i] for p in parts}) != 1:
            break
        out.append(parts[0][: i + 1])
    return out


def candidates(calls: list[tuple[Frame, ...]]) -> list[str]:
    """Names of the modules whose calls enclose every one of ``calls``, innermost first.

    ``calls`` holds, for each call that uses a parameter, the enclosing frames, outermost first.
    """
    if not calls:
        return []
    common = set.intersection(*({f.name for f in frames} for frames in calls))
    return list(dict.fromkeys(f.name for f in reversed(calls[0]) if f.name in common))


def frames_of(name: str, calls: list[tuple[Frame, ...]]) -> list[Frame]:
    """The outermost call of module ``name`` around each of ``calls``, each once."""
    found: dict[int, Frame] = {}
    for frames in calls:
        f = next((f for f in frames if f.name == name), None)
        if f is not None:
            found.setdefault(id(f), f)
    return list(found.values())


def replay_frames(frames: list[Frame], params: dict[str, Tensor], batch_dim: int, n: int,
                  scale: float) -> dict[str, Tensor]:
    """Per-sample gradients ``[N, *shape]`` of ``params`` (qualified name -> parameter) from
    replays of the kept calls ``frames`` of one module, summed over the calls.

    Raises:
        CannotReplay: a call's arguments changed since it ran, or its replay fails.
    """
    module, name = frames[0].module, frames[0].name
    under: dict[int, str] = {}
    for rel, p in module.named_parameters(remove_duplicate=False):
        under.setdefault(id(p), rel)
    keys = {q: under.get(id(p), q) for q, p in params.items()}
    by_key = {keys[q]: p for q, p in params.items()}
    total: dict[str, Tensor] = {}
    for frame in frames:
        why = frame.changed()
        if why is not None:
            raise CannotReplay(why)
        if not frame.grads:
            continue
        assert frame.args is not None and frame.kwargs is not None  # kept frames keep them
        out = replay_call(module, name, frame.args, frame.kwargs, frame.grads, by_key,
                          batch_dim, n, scale, autocast=frame.autocast,
                          outputs=frame.index_outputs, members=frame.members)
        for k, g in out.items():
            total[k] = g if k not in total else total[k] + g
    return {q: total[keys[q]].detach() if keys[q] in total else p.new_zeros((n, *p.shape))
            for q, p in params.items()}


def tolerance(param: Tensor) -> float:
    """Relative tolerance of the check for a parameter's dtype and device.

    Not tighter for float64: a model may compute in lower precision inside (``.float()``),
    and the errors this check is for (a use left out, a wrong split) are large.
    """
    if param.dtype in (torch.float16, torch.bfloat16):
        return 5e-2
    reduced = torch.get_float32_matmul_precision() != "highest" or (
        param.device.type == "cuda"
        and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32))
    return 2e-2 if reduced else 1e-3


def mismatches(rows: Mapping[str, tuple[Tensor, Tensor, Tensor | None]],
               params: Mapping[str, Tensor], c: float, largest: Callable[[], float]) -> set[str]:
    """Names whose per-sample sum is not their gradient increment, in one host copy per device.

    ``rows[name] = (per-sample sum, increment, per-sample gradients or None)``, where the sum
    is ``c`` times the sum over samples (``c = 1/N`` for a mean loss). The tolerance
    is relative to the size of the increment and of the sum, with a floor of ``1e-2`` of it
    times ``largest()``, the largest gradient norm in the model (gradients that vanish
    mathematically, like a key bias before a softmax, are rounding noise on both sides, and
    so are gradients many orders below the others in float32). A name that fails is checked
    again with the floor and the size of its per-sample gradients (when given) added, so sums
    that cancel are not taken for errors: that costs a pass over them, only then.
    """
    # A parameter used once has its call's contribution passed on as its increment: the
    # very same tensor, nothing to compare.
    rows = {k: r for k, r in rows.items() if not _same(r[0], r[1])}
    if not rows:
        return set()
    values = _norms({k: (a, _dense(i)) for k, (a, i, _) in rows.items()})

    def fails(name: str, allowance: float) -> bool:
        diff, inc, own = values[name]
        if not math.isfinite(inc):
            return False  # a non-finite gradient is detect's business, not a wrong split
        return not diff <= tolerance(params[name]) * (inc + own + allowance)

    bad = {k for k in values if fails(k, 0.0)}
    if not bad:
        return bad
    floor = 1e-2 * largest()
    grads = {k: g for k in bad if (g := rows[k][2]) is not None}
    sizes = _host({k: torch.linalg.vector_norm(g, dtype=torch.float32 if g.dtype in _HALF
                                               else None).reshape(1)
                   for k, g in grads.items()}) if grads else {}
    # sum_n |g_n| <= sqrt(N) |G|
    return {k for k in bad if fails(k, floor + (sizes[k][0] * math.sqrt(grads[k].shape[0]) * c
                                                if k in grads else 0.0))}


_HALF = (torch.float16, torch.bfloat16)


def _norms(pairs: dict[str, tuple[Tensor, Tensor]]) -> dict[str, list[float]]:
    """``[norm(a - i), norm(i), norm(a)]`` per name, with foreach kernels, one copy per device."""
    groups: dict[tuple[torch.device, bool], list[str]] = {}
    for k, (a, _) in pairs.items():
        groups.setdefault((a.device, a.dtype in _HALF), []).append(k)
    out: dict[str, list[float]] = {}
    for (_, half), names in groups.items():
        sums = [pairs[k][0] for k in names]
        incs = [pairs[k][1] for k in names]
        dtype = torch.float32 if half else None
        diff = torch._foreach_norm(torch._foreach_sub(sums, incs), 2, dtype=dtype)
        inc = torch._foreach_norm(incs, 2, dtype=dtype)
        own = torch._foreach_norm(sums, 2, dtype=dtype)
        flat = torch.stack([t.to(diff[0].dtype) for t in (*diff, *inc, *own)]).tolist() \
            if len({t.dtype for t in (*diff, *inc, *own)}) > 1 \
            else torch.stack([*diff, *inc, *own]).tolist()
        m = len(names)
        out.update((k, flat[i::m]) for i, k in enumerate(names))
    return out


def _host(tensors: dict[str, Tensor]) -> dict[str, list[float]]:
    """Every tensor's values as floats, one host copy per device."""
    by_device: dict[torch.device, list[str]] = {}
    for k, t in tensors.items():
        by_device.setdefault(t.device, []).append(k)
    out: dict[str, list[float]] = {}
    for names in by_device.values():
        flat = torch.cat([tensors[k].reshape(-1).double() for k in names]).tolist()
        i = 0
        for k in names:
            m = tensors[k].numel()
            out[k], i = flat[i:i + m], i + m
    return out


def largest_norm(grads: list[Tensor]) -> float:
    """The largest norm among ``grads`` (finite ones), one host copy per device."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(_dense(g))
    largest = 0.0
    for group in by_device.values():
        half = any(g.dtype in _HALF for g in group)
        norms = torch.stack([n.float() for n in torch._foreach_norm(
            group, 2, dtype=torch.float32 if half else None)])
        norms = norms.nan_to_num(0.0, 0.0, 0.0)
        largest = max(largest, float(norms.max()))
    return largest


def _same(a: Tensor, b: Tensor) -> bool:
    return a is b or (a.layout == b.layout == torch.strided and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def _dense(t: Tensor) -> Tensor:
    return t if t.layout == torch.strided else t.to_dense()
