"""The one place gradtap installs hooks: per-call gradient capture and a small hook set.

How a call is captured, without changing the autograd graph or any gradient:

* The forward pre-hook notes, for every tensor argument that requires grad, the graph edge it
  flows back along (its ``grad_fn`` and output number, or its gradient accumulator if it is a
  leaf), and the autograd sequence number, so nodes created by this call can be told apart.
* The forward hook walks back from the outputs through the nodes created during the call. A
  node with an edge into an argument's edge, or into the ``AccumulateGrad`` of a parameter
  under the module, gets one post-hook; so do the nodes that produced the outputs.
* In backward those node hooks see exactly "the gradient this call sent to that input or
  parameter" and "the gradient w.r.t. the output as produced", even when an in-place op later
  rewrote the output, when the module is itself in place, or when the module is called twice.
  A call's record is finished when all its hooked nodes ran, or at the end of the backward.

Nothing is written onto modules or parameters, and removing the tap leaves no hook behind.
Node hooks already attached to a recorded graph check an ``enabled`` flag, because they can
still fire after removal while that graph is alive.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils.hooks import RemovableHandle

from gradtap._types import KeepLiteral, Selector
from gradtap.record import GradRecord, flatten_tensors, map_tensors
from gradtap.select import select_modules

__all__ = ["HookSet", "Tap", "argument_tensors", "at_end_of_backward", "legacy_backward_grads",
           "replaying", "tap"]

_next_sequence_nr = torch._C._autograd._get_sequence_nr
_graph_task_id = torch._C._current_graph_task_id
_AccumulateGrad = torch._C._functions.AccumulateGrad
_INPUT, _PARAM, _INPUT_REGION = 0, 1, 2
_set_versions = torch._C._autograd._unsafe_set_version_counter

RecordCallback = Callable[[GradRecord], None]
ForwardCallback = Callable[[str, int, nn.Module, dict[str, Tensor], dict[str, Tensor]], None]
RewriteSlot = Callable[[str, str, Tensor], "Tensor | None"]
RewriteParam = Callable[[str, int, str, Tensor], "Tensor | None"]


class _Replay:
    """Set by :func:`replaying`: the one tap whose hooks run, and the backward (graph task) in
    which forward calls still count as real calls (-1: none, the usual case)."""

    owner: Tap | None = None
    task: int = -1


def _standing_aside(tap: Tap) -> bool:
    """Whether ``tap``'s hooks must do nothing because another tap replays a step."""
    return _Replay.owner is not None and _Replay.owner is not tap


@contextmanager
def replaying(owner: Tap) -> Iterator[None]:
    """Run a model's forward and backward again, seen by ``owner`` alone.

    Inside the block, every other tap's hooks and every :class:`HookSet` hook do nothing, so
    stateful consumers (a transform's EWMA, a Monitor) never see the rerun. Forward calls made
    inside the backward now running (a replay started at its end) count as real calls for
    ``owner``; forward calls inside the replay's own backward (activation checkpoint
    recomputation) still do not. Not reentrant.
    """
    if _Replay.owner is not None:
        raise RuntimeError("a replay is already running; replays do not nest")
    _Replay.owner, _Replay.task = owner, _graph_task_id()
    try:
        yield
    finally:
        _Replay.owner, _Replay.task = None, -1


class _Boundary(torch.autograd.Function):
    """An identity marked as an in-place op on its input: the tensor keeps its identity (and,
    put back by the caller, its version), while every later use goes through this node, whose
    backward hands the gradient to ``sink`` (which may return a replacement)."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, sink: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.sink = sink
        ctx.mark_dirty(t)
        return t

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return ctx.sink(g), None


class _Alias(torch.autograd.Function):
    """A view of ``t`` for a second output path (or a leaf returned as is), whose backward
    hands the gradient to ``sink``. Made inside a Function, so autograd refuses in-place ops
    on it instead of routing their gradient around this node."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, sink: Callable[[Tensor], Tensor]) -> Tensor:
        ctx.sink = sink
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return ctx.sink(g), None


class _Region:
    """Where a view lies in its base's storage, to cut a gradient w.r.t. the base to the
    gradient w.r.t. the view."""

    __slots__ = ("size", "stride", "offset", "base_size", "base_stride", "whole")

    def __init__(self, view: Tensor, base: Tensor) -> None:
        self.size, self.stride = view.shape, view.stride()
        self.offset = view.storage_offset() - base.storage_offset()
        self.base_size, self.base_stride = base.shape, base.stride()
        self.whole = view.numel() == base.numel()

    def of(self, g: Tensor) -> Tensor:
        """The view's part of ``g``, a gradient w.r.t. the base (copied out unless it is the
        whole of ``g``, so a small region does not keep a large gradient alive)."""
        if g.shape != self.base_size:
            g = g.expand(self.base_size)
        if g.stride() != self.base_stride:
            g = torch.empty_strided(self.base_size, self.base_stride, dtype=g.dtype,
                                    device=g.device).copy_(g)
        part = g.as_strided(self.size, self.stride, g.storage_offset() + self.offset)
        return part if self.whole else part.clone()

    def replaced(self, g: Tensor, part: Tensor) -> Tensor:
        """A copy of ``g`` (a gradient w.r.t. the base) with the view's region set to ``part``."""
        out = torch.empty_strided(self.base_size, self.base_stride, dtype=g.dtype,
                                  device=g.device).copy_(g)
        out.as_strided(self.size, self.stride, out.storage_offset() + self.offset).copy_(part)
        return out


class HookSet:
    """Handles of hooks that are not tied to a module call; removed together.

    Every hook added through a ``HookSet`` checks ``enabled`` first, so a hook that outlives
    :meth:`remove` (for example on a graph still alive) does nothing.
    """

    def __init__(self) -> None:
        self.enabled = True
        self._handles: list[RemovableHandle] = []
        self._params: list[Tensor] = []
        self._cleanups: list[Callable[[], None]] = []

    def post_accumulate_grad(self, param: Tensor, fn: Callable[[Tensor], None]) -> None:
        """Run ``fn(param)`` after ``param.grad`` was accumulated in a backward."""

        def hook(p: Tensor) -> None:
            if self.enabled and _Replay.owner is None:
                fn(p)

        self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self._params.append(param)

    def optimizer_step_pre(self, optimizer: torch.optim.Optimizer, fn: Callable[..., None]) -> None:
        """Run ``fn(optimizer, args, kwargs)`` right before ``optimizer.step()``."""

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self.enabled and _Replay.owner is None:
                fn(opt, args, kwargs)

        self._handles.append(optimizer.register_step_pre_hook(hook))

    def module_calls(self, module: nn.Module, before: Callable[[tuple, dict], None] | None,
                     after: Callable[[Any], None]) -> None:
        """Run ``before(args, kwargs)`` and ``after(output)`` around each call of ``module``
        (``after`` only when the call returns)."""
        if before is not None:

            def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
                if self.enabled and _Replay.owner is None:
                    before(args, kwargs)

            self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))

        def forward_hook(mod: nn.Module, args: tuple, output: Any) -> None:
            if self.enabled and _Replay.owner is None:
                after(output)

        self._handles.append(module.register_forward_hook(forward_hook))

    def gradient(self, t: Tensor, fn: Callable[[Tensor], None]) -> RemovableHandle | None:
        """Run ``fn(grad)`` with the gradient w.r.t. ``t`` as it is now, in each backward that
        computes it. On a non-leaf the hook lives as long as ``t``'s graph and ``None`` is
        returned. A leaf outlives any graph (an input tensor reused every step), so its hook's
        handle is returned: the caller removes it when the backward it waits for is over."""

        node, nr = t.grad_fn, t.output_nr
        if node is None:  # a leaf: its own hook (slower, but leaves are rare here)

            def leaf_hook(g: Tensor) -> None:
                if self.enabled and _Replay.owner is None:
                    fn(g)

            return t.register_hook(leaf_hook)

        # A pre-hook on the node that made t (what Tensor.register_hook installs too, minus
        # the Python bookkeeping, which costs more than the rest of a light hook).
        def prehook(grad_outputs: tuple) -> None:
            if self.enabled and _Replay.owner is None:
                g = grad_outputs[nr]
                if g is not None:
                    fn(g)

        node.register_prehook(prehook)
        return None

    def add(self, handle: RemovableHandle) -> None:
        """Adopt a handle registered elsewhere in this module."""
        self._handles.append(handle)

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on :meth:`remove`, after the handles are removed."""
        self._cleanups.append(fn)

    def remove(self) -> None:
        """Remove every hook; safe to call more than once."""
        self.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._params:
            # register_post_accumulate_grad_hook leaves an empty dict behind; restore None.
            if not p._post_accumulate_grad_hooks:
                p._post_accumulate_grad_hooks = None
        self._params.clear()
        for fn in self._cleanups:
            fn()
        self._cleanups.clear()

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _ModuleInfo:
    """What a tap needs to know about one selected module, resolved once."""

    __slots__ = ("name", "type_name", "param_names", "param_by_id", "positional", "varargs",
                 "clone_inputs", "calls", "module_ref", "empty_param_grads")

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module_ref = weakref.ref(module)
        self.type_name = type(module).__name__
        named = list(module.named_parameters())
        self.param_names = [n for n, _ in named]
        self.param_by_id = {id(p): n for n, p in named}
        self.empty_param_grads: dict[str, Tensor | None] = dict.fromkeys(self.param_names)
        self.positional, self.varargs = _argument_names(module)
        # An in-place module overwrites its input: a kept input must be copied before the call.
        self.clone_inputs = bool(getattr(module, "inplace", False))
        self.calls = 0

    def arg_name(self, index: int) -> str:
        if index < len(self.positional):
            return self.positional[index]
        return f"{self.varargs or 'args'}.{index - len(self.positional)}"


def _argument_names(module: nn.Module) -> tuple[list[str], str | None]:
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return [], "args"
    positional, varargs = [], None
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            varargs = p.name
    return positional, varargs


class _Call:
    """Mutable state of one module call until its record is finished."""

    __slots__ = ("info", "index", "grad_inputs", "grad_outputs", "param_grads", "inputs",
                 "outputs", "input_edges", "input_bases", "input_ids", "start", "expected", "remaining",
                 "touched", "last_fire", "out_versions", "fwd_inputs")

    def __init__(self, info: _ModuleInfo, index: int) -> None:
        self.info = info
        self.index = index
        self.grad_inputs: dict[str, Tensor | None] = {}
        self.grad_outputs: dict[str, Tensor | None] = {}
        self.param_grads: dict[str, Tensor | None] = info.empty_param_grads.copy()
        self.inputs: dict[str, Tensor] = {}
        self.outputs: dict[str, Tensor] = {}
        self.input_edges: dict[tuple[Any, int], str] = {}
        # Edge of the base of a view argument -> (argument key, where the view lies in it).
        self.input_bases: dict[tuple[Any, int], tuple[str, _Region]] = {}
        self.input_ids: dict[int, str] = {}  # id of each argument tensor -> its key
        self.start = 0
        self.expected = 0
        self.remaining = 0
        self.touched = False
        self.last_fire = 0
        self.out_versions: list[tuple[str, weakref.ref[Tensor], int]] = []
        self.fwd_inputs: dict[str, Tensor] = {}


class Tap:
    """Live capture of per-call gradient records; see :func:`tap`."""

    def __init__(
        self,
        model: nn.Module,
        select: Selector = "*",
        keep: Iterable[KeepLiteral] = (),
        to: torch.device | str | None = None,
        *,
        on_record: RecordCallback | None = None,
        store: bool = True,
        on_forward: ForwardCallback | None = None,
        rewrite_grad_output: RewriteSlot | None = None,
        rewrite_grad_input: RewriteSlot | None = None,
        rewrite_param_grad: RewriteParam | None = None,
    ) -> None:
        keep = (keep,) if isinstance(keep, str) else tuple(keep)
        unknown = sorted(set(keep) - {"inputs", "outputs"})
        if unknown:
            raise ValueError(f"keep= accepts 'inputs' and 'outputs'; got {unknown}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"tap() needs an nn.Module; got {type(model).__name__}")
        self.records: list[GradRecord] = []
        self._keep_inputs = "inputs" in keep
        self._keep_outputs = "outputs" in keep
        self._to = torch.device(to) if to is not None else None
        self._on_record = on_record
        self._store = store
        self._on_forward = on_forward
        self._rewrite_out = rewrite_grad_output
        self._rewrite_in = rewrite_grad_input
        self._rewrite_param = rewrite_param_grad
        self._enabled = True
        self._hooks = HookSet()
        self._touched: list[_Call] = []
        self._queued_task: int | None = None
        self._fires = itertools.count()
        self._infos: list[_ModuleInfo] = []
        self.modules = select_modules(model, select)
        try:
            for name, module in self.modules:
                self._attach(name, module)
        except BaseException:
            self.remove()
            raise

    # -- public -----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """Qualified names of the tapped modules, in ``named_modules()`` order."""
        return [name for name, _ in self.modules]

    def find(self, name: str) -> list[GradRecord]:
        """Return the records of module ``name``, one per call, in call order."""
        if name not in self.names:
            raise KeyError(_unknown_name(name, self.names))
        return sorted((r for r in self.records if r.module_name == name), key=lambda r: r.call)

    def clear(self) -> None:
        """Drop the records and restart every module's call count at 0."""
        self.records = []
        for info in self._infos:
            info.calls = 0

    def remove(self) -> None:
        """Remove every hook; the model is left exactly as it was. Safe to call twice."""
        self._enabled = False
        self._hooks.remove()

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self._enabled else "removed"
        return f"<Tap {state}: {len(self.modules)} modules, {len(self.records)} records>"

    # -- forward side -----------------------------------------------------------------------

    def _attach(self, name: str, module: nn.Module) -> None:
        info = _ModuleInfo(name, module)
        self._infos.append(info)
        open_calls: list[_Call | None] = []  # a stack: a module may call itself recursively

        def pre_hook(mod: nn.Module, args: tuple, kwargs: dict) -> Any:
            # Cheapest guards first. Forward calls made while a backward runs are activation
            # checkpoint recomputations: their graph is only used to refill saved tensors.
            if (not (self._enabled and torch.is_grad_enabled()) or _graph_task_id() != _Replay.task
                    or _standing_aside(self)):
                open_calls.append(None)
                return None
            call = _Call(info, info.calls)
            info.calls += 1
            replaced = self._note_inputs(call, args, kwargs)
            call.start = _next_sequence_nr()
            open_calls.append(call)
            return replaced

        def forward_hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            call = open_calls.pop() if open_calls else None
            if call is None:
                return None
            return self._note_outputs(call, mod, output)

        self._hooks.add(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        self._hooks.add(
            module.register_forward_hook(forward_hook, with_kwargs=True, always_call=True)
        )

    def _note_inputs(self, call: _Call, args: tuple, kwargs: dict) -> tuple | None:
        info = call.info
        flat = _flat_arguments(info, args, kwargs)
        replaced = None
        if len(flat) > 1 and len({id(t) for _, t in flat}) < len(flat):
            # The same tensor passed twice: give each later occurrence its own alias node so
            # each argument's gradient can be told apart.
            seen: set[int] = set()

            def alias_repeat(t: Tensor) -> Tensor:
                if id(t) in seen and t.requires_grad:
                    return t.view_as(t)
                seen.add(id(t))
                return t

            args, kwargs = map_tensors(args, alias_repeat), map_tensors(kwargs, alias_repeat)
            replaced = (args, kwargs)
            flat = _flat_arguments(info, args, kwargs)
        if self._on_forward is not None:
            call.fwd_inputs = dict(flat)
        grad_inputs, input_edges = call.grad_inputs, call.input_edges
        input_ids = call.input_ids
        for path, t in flat:
            grad_inputs[path] = None
            if t.requires_grad:
                input_ids.setdefault(id(t), path)
                fn = t.grad_fn
                if fn is not None:
                    input_edges[(fn, t.output_nr)] = path
                else:
                    edge = get_gradient_edge(t)
                    input_edges[(edge.node, edge.output_nr)] = path
        # A view argument modified in place inside the call sends its gradient to the base's
        # edge (through a CopySlices node), not to the view's own edge: note the base's edge
        # and where the view lies in it.
        # (A view of a leaf that requires grad cannot be modified in place.)
        for path, t in flat:
            if t.requires_grad and t._is_view():
                base = t._base
                if base.grad_fn is not None:
                    edge = (base.grad_fn, base.output_nr)
                    if edge not in input_edges:
                        call.input_bases[edge] = (path, _Region(t, base))
        if self._keep_inputs:
            for path, t in flat:
                kept = t.detach().clone() if info.clone_inputs else t.detach()
                call.inputs[path] = kept if self._to is None else kept.to(self._to)
        return replaced

    def _note_outputs(self, call: _Call, module: nn.Module, output: Any) -> Any:
        """Find how each output's boundary gradient will be seen, and hook the call's nodes.

        ``grad_outputs[k]`` is what flows back into the call through output ``k`` from the uses
        after the call returned. Each output gets the cheapest way that sees exactly that:

        * made by the call, not a view, not used inside the call: its own node (a later
          in-place op still sends its gradient there);
        * a view made by the call of a base made by the call, neither used elsewhere inside
          the call: the base's node, cut to the view's region (a later in-place op on the view
          sends its gradient there through a CopySlices node);
        * otherwise (used inside the call, returned as it came in, a view of a tensor made
          before the call): a boundary node, an identity marked as an in-place op on the very
          tensor returned (its version counter is put back, so saved tensors stay valid), so
          uses after the call, and later in-place ops, go through it and uses inside do not;
        * the same tensor under a second output path, or a leaf returned as is: a view alias
          of its own (a leaf cannot be modified in place, so the alias is never bypassed).
        """
        start = call.start
        outs = flatten_tensors(output, "output")
        made: list[tuple[str, Tensor]] = []   # outputs made by this call
        boundary: list[tuple[str, Tensor, Any]] = []  # (path, tensor, what it bypasses)
        aliased: set[int] = set()             # indices into outs that get an alias
        first: set[int] = set()
        repeated: set[int] = set()           # ids of tensors under more than one path
        watched: dict[tuple[Any, int], None] = {}
        for i, (path, t) in enumerate(outs):
            call.grad_outputs[path] = None
            if self._keep_outputs:
                kept = t.detach()
                call.outputs[path] = kept if self._to is None else kept.to(self._to)
            if not t.requires_grad:
                continue
            if id(t) in first:
                aliased.add(i)
                repeated.add(id(t))
                continue
            first.add(id(t))
            fn = t.grad_fn
            if fn is None:
                aliased.add(i)
            elif fn._sequence_nr() < start:
                # Returned as it came in: the boundary node's gradient is also what the call
                # sends to that input.
                boundary.append((path, t, call.input_ids.get(id(t))))
            else:
                made.append((path, t))
                watched[(fn, t.output_nr)] = None
                base = t._base if t._is_view() else None
                if base is not None and base.grad_fn is not None:
                    watched[(base.grad_fn, base.output_nr)] = None

        edges, users = self._walk(call, [t.grad_fn for _, t in made], watched)

        out_nodes: dict[Any, list[tuple[int, str]]] = {}
        base_nodes: dict[Any, list[tuple[int, str, _Region]]] = {}
        for path, t in made:
            fn = t.grad_fn
            internal = not t._is_view()
            if not internal:
                base = t._base
                bfn = base.grad_fn
                internal = bfn is not None and bfn._sequence_nr() >= start
            if internal and (users.get((fn, t.output_nr)) or id(t) in repeated):
                # Used inside the call, or its node also feeds the aliases of its other paths.
                boundary.append((path, t, None))
            elif not t._is_view():
                out_nodes.setdefault(fn, []).append((t.output_nr, path))
            elif internal:
                if self._rewrite_out is None and users.get((bfn, base.output_nr)) == [fn]:
                    base_nodes.setdefault(bfn, []).append((base.output_nr, path, _Region(t, base)))
                else:
                    boundary.append((path, t, None))
            else:
                # A view of a tensor made before the call (x[:, :3], a flatten): the boundary
                # node goes on the view and the view's own node is bypassed, so its gradient
                # is sent to the call's inputs by calling that node, when it leads to them
                # directly; otherwise the view's own node is watched.
                keys = [call.input_edges.get(e) for e in fn.next_functions]
                if not users.get((fn, t.output_nr)) and id(t) not in repeated and all(
                        k is not None or e[0] is None for k, e in zip(keys, fn.next_functions)):
                    boundary.append((path, t, (fn, keys)))
                else:
                    out_nodes.setdefault(fn, []).append((t.output_nr, path))
                    call.out_versions.append((path, weakref.ref(t), t._version))

        returned = None
        hooked = 0
        if aliased:
            # Aliases first, so they hang on the original node, not on a boundary node. An
            # alias is a view made inside an autograd Function: its own node records the
            # gradient and autograd refuses an in-place op on it (rather than send that
            # gradient elsewhere); a leaf cannot be modified in place anyway.
            count = itertools.count()
            infos = iter([(path, t) for i, (path, t) in enumerate(outs) if i in aliased])

            def alias(t: Tensor) -> Tensor:
                if next(count) not in aliased:
                    return t
                path, original = next(infos)
                key = call.input_ids.get(id(original))
                credit: Any = key
                if key is None and original.grad_fn is None:
                    name = call.info.param_by_id.get(id(original))
                    credit = None if name is None else (_PARAM, name)
                return _Alias.apply(t, self._boundary_sink(call, path, credit))

            output = map_tensors(output, alias)
            returned = output
            hooked += len(aliased)

        for path, t, bypassed in boundary:
            if self._boundary(call, path, t, bypassed):
                hooked += 1
            elif t.grad_fn is not None and t.grad_fn._sequence_nr() >= start:
                # Not markable (e.g. a view made by a multi-output op, which cannot be
                # modified in place either): its own node.
                out_nodes.setdefault(t.grad_fn, []).append((t.output_nr, path))
                call.out_versions.append((path, weakref.ref(t), t._version))
        hooked += self._install_node_hooks(call, out_nodes, base_nodes, edges)
        call.expected = call.remaining = hooked
        call.input_edges = {}  # the walk is done; do not keep graph nodes alive through it
        call.input_bases = {}
        call.input_ids = {}

        if self._on_forward is not None:
            self._on_forward(call.info.name, call.index, module, call.fwd_inputs, dict(outs))
            call.fwd_inputs = {}
        return returned

    def _boundary(self, call: _Call, path: str, t: Tensor, bypassed: Any) -> bool:
        """Put a boundary node on ``t`` (the tensor itself, as an in-place identity); False
        where autograd does not allow an in-place op on it (then nothing changed).

        ``bypassed`` is what the gradient no longer passes through, to be credited to the
        call's inputs by the boundary node: an input key (``t`` is that input), or the view
        node of ``t`` with the input key of each of its edges.
        """
        version = t._version
        try:
            _Boundary.apply(t, self._boundary_sink(call, path, bypassed))
        except RuntimeError:
            return False
        finally:
            _set_versions((t,), (version,))
        return True

    def _walk(self, call: _Call, starts: list[Any], watched: dict[tuple[Any, int], None],
              ) -> tuple[dict[Any, list[tuple[int, int, Any]]], dict[tuple[Any, int], list[Any]]]:
        """Walk the nodes this call created, back from its outputs.

        Returns the nodes with edges into the call's inputs, the bases of its view inputs or
        its parameters (``{node: [(edge index, kind, key)]}``), and for each watched edge
        the nodes of this call that use it (``{edge: [node]}``).
        """
        start, param_by_id = call.start, call.info.param_by_id
        input_edges, input_bases = call.input_edges, call.input_bases
        current: dict[int, str] | None = None
        stack = [n for n in dict.fromkeys(starts)
                 if n._sequence_nr() >= start and type(n) is not _AccumulateGrad]
        seen = set(stack)
        found: dict[Any, list[tuple[int, int, Any]]] = {}
        users: dict[tuple[Any, int], list[Any]] = {}
        while stack:
            node = stack.pop()
            for i, edge in enumerate(node.next_functions):
                nxt = edge[0]
                if nxt is None:
                    continue
                if edge in watched:
                    users.setdefault(edge, []).append(node)
                key = input_edges.get(edge)
                if key is not None:
                    found.setdefault(node, []).append((i, _INPUT, key))
                elif edge in input_bases:
                    found.setdefault(node, []).append((i, _INPUT_REGION, input_bases[edge]))
                elif type(nxt) is _AccumulateGrad:
                    name = param_by_id.get(id(nxt.variable))
                    if name is None:
                        # Parameters swapped in for this call (torch.func.functional_call,
                        # reparametrizations): look at what the module holds right now.
                        if current is None:
                            module = call.info.module_ref()
                            current = {} if module is None else {
                                id(p): n for n, p in module.named_parameters() if p is not None}
                        name = current.get(id(nxt.variable))
                    if name is not None:
                        found.setdefault(node, []).append((i, _PARAM, name))
                elif nxt not in seen and nxt._sequence_nr() >= start:
                    seen.add(nxt)
                    stack.append(nxt)
        return found, users

    def _install_node_hooks(self, call: _Call, out_nodes: dict, base_nodes: dict,
                            edges: dict) -> int:
        rewrite_outputs = self._rewrite_out is not None
        count = 0
        if rewrite_outputs:
            for node, entries in out_nodes.items():
                node.register_prehook(self._output_prehook(call, entries))
                count += 1
        for node, entries in base_nodes.items():
            node.register_prehook(self._base_prehook(call, entries))
            count += 1
        for node in set(edges) | (set() if rewrite_outputs else set(out_nodes)):
            out_entries = () if rewrite_outputs else tuple(out_nodes.get(node, ()))
            node.register_hook(self._node_posthook(call, out_entries, tuple(edges.get(node, ()))))
            count += 1
        return count

    # -- backward side ----------------------------------------------------------------------

    def _output_prehook(self, call: _Call, entries: list[tuple[int, str]]) -> Callable:
        tap_ref = weakref.ref(self)

        def prehook(grad_outputs: tuple) -> tuple | None:
            tap = tap_ref()
            if tap is None or not tap._enabled or _standing_aside(tap):
                return None
            tap._touch(call)
            new = list(grad_outputs)
            for nr, path in entries:
                g = grad_outputs[nr]
                if g is not None:
                    r = tap._rewrite_out(call.info.name, path, g)  # type: ignore[misc]
                    if r is not None:
                        _check_like(r, g, f"rewrite of grad_output {path!r} of {call.info.name!r}")
                        new[nr] = g = r
                call.grad_outputs[path] = _accumulate(call.grad_outputs[path], g)
            tap._fired(call)
            return tuple(new)

        return prehook

    def _base_prehook(self, call: _Call, entries: list[tuple[int, str, _Region]]) -> Callable:
        tap_ref = weakref.ref(self)

        def prehook(grad_outputs: tuple) -> None:
            tap = tap_ref()
            if tap is None or not tap._enabled or _standing_aside(tap):
                return
            tap._touch(call)
            for nr, path, region in entries:
                g = grad_outputs[nr]
                if g is not None:
                    call.grad_outputs[path] = _accumulate(call.grad_outputs[path], region.of(g))
            tap._fired(call)

        return prehook

    def _boundary_sink(self, call: _Call, path: str, credit: Any) -> Callable[[Tensor], Tensor]:
        """The backward of a boundary node or alias of output ``path``. ``credit`` is what
        the call also sent that gradient to, as the node now stands in its way: an input key,
        ``(_PARAM, name)``, or a bypassed view node with the input key of each of its edges."""
        tap_ref = weakref.ref(self)
        name = call.info.name

        def sink(g: Tensor) -> Tensor:
            tap = tap_ref()
            if tap is None or not tap._enabled or _standing_aside(tap):
                return g
            tap._touch(call)
            if tap._rewrite_out is not None:
                r = tap._rewrite_out(name, path, g)
                if r is not None:
                    _check_like(r, g, f"rewrite of grad_output {path!r} of {name!r}")
                    g = r
            call.grad_outputs[path] = _accumulate(call.grad_outputs[path], g)
            if isinstance(credit, str):
                call.grad_inputs[credit] = _accumulate(call.grad_inputs[credit], g)
            elif credit is not None and credit[0] == _PARAM:
                call.param_grads[credit[1]] = _accumulate(call.param_grads[credit[1]], g)
            elif credit is not None:
                node, keys = credit
                grads = node(g)
                for key, gi in zip(keys, (grads,) if isinstance(grads, Tensor) else grads):
                    if key is not None:
                        call.grad_inputs[key] = _accumulate(call.grad_inputs[key], gi)
            tap._fired(call)
            return g

        return sink

    def _node_posthook(self, call: _Call, out_entries: tuple, edge_entries: tuple) -> Callable:
        tap_ref = weakref.ref(self)
        name = call.info.name

        def posthook(grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
            tap = tap_ref()
            if tap is None or not tap._enabled or _standing_aside(tap):
                return None
            tap._touch(call)
            for nr, path in out_entries:
                call.grad_outputs[path] = _accumulate(call.grad_outputs[path], grad_outputs[nr])
            new = None
            for i, kind, key in edge_entries:
                g = grad_inputs[i]
                if g is None:
                    continue
                if kind == _PARAM:
                    if tap._rewrite_param is not None:
                        r = tap._rewrite_param(name, call.index, key, g)
                        if r is not None:
                            _check_like(r, g, f"rewrite of parameter {key!r} of {name!r}")
                            new = new or list(grad_inputs)
                            new[i] = g = r
                    call.param_grads[key] = _accumulate(call.param_grads[key], g)
                    continue
                region = None
                if kind == _INPUT_REGION:  # the base of a view argument modified in place
                    key, region = key
                    part = region.of(g)
                else:
                    part = g
                if tap._rewrite_in is not None:
                    r = tap._rewrite_in(name, key, part)
                    if r is not None:
                        _check_like(r, part, f"rewrite of grad_input {key!r} of {name!r}")
                        new = new or list(grad_inputs)
                        new[i] = r if region is None else region.replaced(g, r)
                        part = r
                call.grad_inputs[key] = _accumulate(call.grad_inputs[key], part)
            tap._fired(call)
            return tuple(new) if new is not None else None

        return posthook

    def _touch(self, call: _Call) -> None:
        if call.touched:
            return
        call.touched = True
        self._touched.append(call)
        task = _graph_task_id()
        if task != self._queued_task:
            # Calls whose hooked nodes do not all run in this backward (an unused output, a
            # branch cut by the loss) are finished when the backward ends.
            self._queued_task = task
            at_end_of_backward(self._end_of_backward)

    def _fired(self, call: _Call) -> None:
        call.last_fire = next(self._fires)
        call.remaining -= 1
        if call.remaining <= 0:
            self._finish(call)

    def _end_of_backward(self) -> None:
        self._queued_task = None
        pending = sorted((c for c in self._touched if c.touched), key=lambda c: c.last_fire)
        self._touched = []
        for call in pending:
            self._finish(call)

    def _finish(self, call: _Call) -> None:
        if not call.touched:
            return
        notes: list[str] = []
        for path, ref, version in call.out_versions:
            t = ref()
            if t is not None and t._version != version and t._base is not None:
                notes.append(
                    f"output {path!r} is a view that was modified in place after the call; "
                    "gradient that reached it through that change bypassed this record")
        to = self._to
        rec = GradRecord(
            module_name=call.info.name,
            module_type=call.info.type_name,
            call=call.index,
            grad_inputs=_moved(call.grad_inputs, to),
            grad_outputs=_moved(call.grad_outputs, to),
            param_grads=_moved(call.param_grads, to),
            inputs=call.inputs,
            outputs=call.outputs,
            notes=tuple(notes),
        )
        # Ready for another backward through the same graph (retain_graph=True); the record
        # owns the old slot dicts.
        call.touched = False
        call.remaining = call.expected
        call.grad_inputs = dict.fromkeys(call.grad_inputs)
        call.grad_outputs = dict.fromkeys(call.grad_outputs)
        call.param_grads = call.info.empty_param_grads.copy()
        if self._store:
            self.records.append(rec)
        if self._on_record is not None:
            self._on_record(rec)


def tap(
    model: nn.Module,
    select: Selector = "*",
    keep: Iterable[KeepLiteral] = (),
    to: torch.device | str | None = None,
    *,
    on_record: RecordCallback | None = None,
    store: bool = True,
    on_forward: ForwardCallback | None = None,
    rewrite_grad_output: RewriteSlot | None = None,
    rewrite_grad_input: RewriteSlot | None = None,
    rewrite_param_grad: RewriteParam | None = None,
) -> Tap:
    """Record, per module call, every gradient its backward touched, under readable names.

    Gradients are always kept; forward tensors only when ``keep`` asks. The graph and every
    gradient are left unchanged (bit for bit), in-place ops before or after the module are
    fine, and activation-checkpoint recomputations add no records.

    Args:
        model: the model to tap.
        select: which modules (see :mod:`gradtap.select`); ``"*"`` is every submodule.
        keep: ``"inputs"`` and/or ``"outputs"`` to keep forward tensors in the records.
        to: a device to move everything the records hold to (e.g. ``"cpu"``).
        on_record: called with each record as it completes (possibly inside backward).
        store: keep records in ``.records``; ``False`` only passes them to ``on_record``.
        on_forward: ``(name, call, module, inputs, outputs)`` after each tapped forward call
            (``call`` as in the records; ``outputs`` is empty for a call that returned None).
        rewrite_grad_output: ``(name, path, grad) -> grad | None``: replace dL/d(output) as it
            enters the module's backward.
        rewrite_grad_input: ``(name, key, grad) -> grad | None``: replace what the call sends
            to an input.
        rewrite_param_grad: ``(name, call, param, grad) -> grad | None``: replace the call's
            contribution to a parameter before accumulation.

    Returns:
        A :class:`Tap`; use it as a context manager or call ``.remove()``.

    Raises:
        SelectionError: ``select`` matched no module.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> with gt.tap(net) as t:
        ...     net(torch.randn(2, 3)).sum().backward()
        >>> [(r.module_name, sorted(r.param_grads)) for r in t.records]
        [('2', ['bias', 'weight']), ('1', []), ('0', ['bias', 'weight'])]
    """
    return Tap(model, select, keep, to, on_record=on_record, store=store, on_forward=on_forward,
               rewrite_grad_output=rewrite_grad_output, rewrite_grad_input=rewrite_grad_input,
               rewrite_param_grad=rewrite_param_grad)


def at_end_of_backward(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once, when the backward now running has finished.

    Only valid inside a backward (from a node or tensor hook); consumers use it to do one
    check per backward instead of one per record.
    """
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def legacy_backward_grads(modules: Iterable[tuple[str, nn.Module]]) -> tuple[HookSet, dict[str, list[tuple]]]:
    """Install the legacy ``register_backward_hook`` on ``modules`` to see its ``grad_input``.

    Used by ``explain(legacy=True)`` to tell users which index each slot had in the old API.
    Returns the hook set (remove it when done) and ``{name: [grad_input tuple per firing]}``.
    """
    import warnings

    seen: dict[str, list[tuple]] = {}
    hooks = HookSet()
    for name, module in modules:
        seen[name] = []

        def hook(mod: nn.Module, grad_input: tuple, grad_output: tuple, _name: str = name) -> None:
            if hooks.enabled:
                seen[_name].append(tuple(g.detach() if g is not None else None for g in grad_input))

        previous = module._is_full_backward_hook
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hooks.add(module.register_backward_hook(hook))
        # register_backward_hook flips this flag; put it back so no trace is left.
        hooks.add_cleanup(lambda m=module, v=previous: setattr(m, "_is_full_backward_hook", v))
    return hooks, seen


def argument_tensors(module: nn.Module) -> Callable[[tuple, dict], list[tuple[str, Tensor]]]:
    """A function of a call's ``(args, kwargs)`` to ``module`` giving ``(name, tensor)`` for
    every tensor argument, named as the records name them (the forward signature's names)."""
    return functools.partial(_flat_arguments, _ModuleInfo("", module))


def _flat_arguments(info: _ModuleInfo, args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    """``(name, tensor)`` for every tensor in a call's arguments, named as in the records."""
    if not kwargs and all(isinstance(a, Tensor) for a in args):  # the common case, fast
        return [(info.arg_name(i), a) for i, a in enumerate(args)]
    flat = [(path, t) for i, a in enumerate(args)
            for path, t in flatten_tensors(a, info.arg_name(i), under_prefix=True)]
    flat += [(path, t) for k, v in kwargs.items()
             for path, t in flatten_tensors(v, k, under_prefix=True)]
    return flat


def _passes_through(t: Tensor, start: int) -> bool:
    if not t.requires_grad:
        return False
    fn = t.grad_fn
    return fn is None or fn._sequence_nr() < start


def _accumulate(current: Tensor | None, grad: Tensor | None) -> Tensor | None:
    if grad is None:
        return current
    # Keep the very tensor autograd passed (not a detached alias): holding it stops autograd
    # from stealing its storage into .grad and accumulating into it in place later.
    if grad.requires_grad:
        grad = grad.detach()
    return grad if current is None else current + grad


def _moved(slots: dict[str, Tensor | None], to: torch.device | None) -> dict[str, Tensor | None]:
    if to is None:
        return slots
    return {k: (v.to(to) if v is not None else None) for k, v in slots.items()}


def _check_like(new: Any, old: Tensor, what: str) -> None:
    if not isinstance(new, Tensor):
        raise TypeError(f"{what} returned {type(new).__name__}; expected a Tensor or None")
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise ValueError(
            f"{what} returned shape {tuple(new.shape)}, {new.dtype}, {new.device}; expected "
            f"shape {tuple(old.shape)}, {old.dtype}, {old.device} like the gradient it replaces"
        )


def _unknown_name(name: str, names: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, names, n=5)
    hint = f"; closest tapped modules: {', '.join(close)}" if close else ""
    return f"{name!r} is not a tapped module{hint}"
