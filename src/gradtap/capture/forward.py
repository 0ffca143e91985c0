"""The forward side of a call: note its arguments' edges, then find how each output's gradient
will be seen and hook the call's nodes.

How a call is captured, without changing the autograd graph or any gradient:

* The forward pre-hook notes, for every tensor argument that requires grad, the graph edge it
  flows back along (its ``grad_fn`` and output number, or its gradient accumulator if it is a
  leaf), and the autograd sequence number, so nodes created by this call can be told apart.
* The forward hook walks back from the outputs through the nodes created during the call. A
  node with an edge into an argument's edge, or into the ``AccumulateGrad`` of a parameter
  under the module, gets one post-hook; so do the nodes that produced the outputs (or a
  boundary node, see :mod:`gradtap.capture.boundary`).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from gradtap.capture import compat
from gradtap.capture.backward import (
    ViewGroup,
    ViewSlot,
    base_prehook,
    boundary_sink,
    guard_sink,
    node_posthook,
    output_prehook,
    view_node_prehook,
    view_sink,
)
from gradtap.capture.boundary import Region, alias, mark_boundary, overlaps_itself
from gradtap.capture.graph import PARAM, walk_call
from gradtap.capture.naming import ModuleInfo, flat_arguments
from gradtap.capture.state import Call, Recorder
from gradtap.record import flatten_tensors, map_tensors

__all__ = ["alias_repeated", "note_inputs", "note_outputs"]


def alias_repeated(info: ModuleInfo, args: tuple, kwargs: dict) -> tuple | None:
    """``(args, kwargs)`` with each later occurrence of a tensor passed twice replaced by an
    alias of it (a view), so that each argument's gradient can be told apart; None when no
    tensor is passed twice.

    The module then sees distinct tensors (``nn.MultiheadAttention`` called as
    ``attn(h, h, h)`` takes its path for separate query, key and value): an activation
    checkpoint's recomputation of the call must get the same aliases (``taps``).
    """
    flat = flat_arguments(info, args, kwargs)
    if len(flat) < 2 or len({id(t) for _, t in flat}) == len(flat):
        return None
    seen: set[int] = set()

    def alias_repeat(t: Tensor) -> Tensor:
        if id(t) in seen and t.requires_grad:
            return t.view_as(t)
        seen.add(id(t))
        return t

    return map_tensors(args, alias_repeat), map_tensors(kwargs, alias_repeat)


def note_inputs(rec: Recorder, call: Call, args: tuple, kwargs: dict) -> tuple | None:
    """Note the call's arguments (keys, graph edges, kept copies); returns replaced
    ``(args, kwargs)`` when a tensor passed twice needs an alias, else None."""
    info = call.info
    replaced = alias_repeated(info, args, kwargs)
    if replaced is not None:
        args, kwargs = replaced
    flat = flat_arguments(info, args, kwargs)
    if rec.on_forward is not None:
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
    base: Any
    for path, t in flat:
        if t.requires_grad and t._is_view():
            base = t._base
            if base.grad_fn is not None:
                base_edge = (base.grad_fn, base.output_nr)
                if base_edge not in input_edges:
                    call.input_bases[base_edge] = (path, Region(t, base))
    if rec.keep_inputs:
        for path, t in flat:
            kept = t.detach().clone() if info.clone_inputs else t.detach()
            call.inputs[path] = kept if rec.to is None else kept.to(rec.to)
    return replaced


def note_outputs(rec: Recorder, call: Call, module: nn.Module, output: Any) -> Any:
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
    * the same tensor under a second output path, a leaf returned as is, or a tensor that
      autograd or the kernels do not let be modified in place (a view of a leaf, an alias,
      an output of an op returning several views, an expanded tensor): a view alias of its
      own. The model cannot modify the tensor in place either, so the alias is never
      bypassed and makes no difference to it.
    """
    start = call.start
    outs = flatten_tensors(output, "output")
    made: list[tuple[int, str, Tensor]] = []   # outputs made by this call
    boundary: list[tuple[int, str, Tensor, Any]] = []  # (index, path, tensor, what it bypasses)
    aliased: set[int] = set()             # indices into outs that get an alias
    first: set[int] = set()
    repeated: set[int] = set()           # ids of tensors under more than one path
    watched: dict[tuple[Any, int], None] = {}
    fn: Any
    base: Any
    for i, (path, t) in enumerate(outs):
        call.grad_outputs[path] = None
        if rec.keep_outputs:
            kept = t.detach()
            call.outputs[path] = kept if rec.to is None else kept.to(rec.to)
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
            boundary.append((i, path, t, call.input_ids.get(id(t))))
        else:
            made.append((i, path, t))
            watched[(fn, t.output_nr)] = None
            base = t._base if t._is_view() else None
            if base is not None and base.grad_fn is not None:
                watched[(base.grad_fn, base.output_nr)] = None

    edges, users = walk_call(call, [t.grad_fn for _, _, t in made], watched)

    out_nodes: dict[Any, list[tuple[int, str]]] = {}
    base_nodes: dict[Any, list[tuple[int, str, Region]]] = {}
    for i, path, t in made:
        fn = t.grad_fn
        internal = not t._is_view()
        if not internal:
            base = t._base
            bfn = base.grad_fn
            internal = bfn is not None and bfn._sequence_nr() >= start
        if internal and (users.get((fn, t.output_nr)) or id(t) in repeated):
            # Used inside the call, or its node also feeds the aliases of its other paths.
            boundary.append((i, path, t, None))
        elif not t._is_view():
            out_nodes.setdefault(fn, []).append((t.output_nr, path))
        elif internal:
            # An expanded view's gradient is not a region of its base's (which sums it).
            if (rec.rewrite_out is None and users.get((bfn, base.output_nr)) == [fn]
                    and not overlaps_itself(t)):
                base_nodes.setdefault(bfn, []).append((base.output_nr, path, Region(t, base)))
            else:
                boundary.append((i, path, t, None))
        else:
            # A view of a tensor made before the call (x[:, :3], a flatten, a permute then
            # a reshape): the boundary node goes on the view and the view ops of the call
            # are bypassed, so its gradient is sent on to the call's inputs by calling those
            # nodes; where the view is used inside the call, the view's own node is watched.
            chain = _view_chain(fn, start)
            if chain is not None and not users.get((fn, t.output_nr)) and id(t) not in repeated:
                last = chain[-1].next_functions
                boundary.append((i, path, t, (chain, [call.input_edges.get(e) for e in last])))
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
        credits: dict[int, Any] = {}
        for i in aliased:
            original = outs[i][1]
            key = call.input_ids.get(id(original))
            credits[i] = key
            if key is None and original.grad_fn is None:
                name = call.info.param_by_id.get(id(original))
                if name is None and call.param_ids is not None:
                    name = call.param_ids.get(id(original))
                credits[i] = None if name is None else (PARAM, name)
        output = returned = _aliases(rec, call, output, outs, credits)
        hooked += len(aliased)

    unmarked: dict[int, Any] = {}
    groups: dict[int, tuple[Tensor, ViewGroup, list[tuple[Tensor, ViewSlot]]]] = {}
    for i, path, t, bypassed in boundary:
        base = _own_base(rec, call, t, bypassed)
        if base is not None:
            _, group, members = groups.setdefault(id(base), (base, ViewGroup(), []))
            slot = ViewSlot(group, Region(t, base))
            sink = view_sink(weakref.ref(rec), call, path, slot, bypassed)
        else:
            sink = boundary_sink(weakref.ref(rec), call, path, bypassed)
        if mark_boundary(t, sink):
            hooked += 1
            if base is not None:
                members.append((t, slot))
        else:
            # Not to be modified in place (a view of a leaf, an alias, an expanded tensor):
            # an alias of its own. Its gradient goes on through the tensor's own nodes, whose
            # hooks credit the call's inputs; only an argument returned as is is credited.
            unmarked[i] = bypassed if isinstance(bypassed, str) else None
    for base, group, members in groups.values():
        _guard(rec, call, base, group, members)
    if unmarked:
        returned = _aliases(rec, call, output, outs, unmarked)
        hooked += len(unmarked)
    hooked += _install_node_hooks(rec, call, out_nodes, base_nodes, edges)
    call.expected = call.remaining = hooked
    call.input_edges = {}  # the walk is done; do not keep graph nodes alive through it
    call.input_bases = {}
    call.input_ids = {}

    if rec.on_forward is not None:
        rec.on_forward(call.info.name, call.index, module, call.fwd_inputs, dict(outs))
        call.fwd_inputs = {}
    return returned


def _aliases(rec: Recorder, call: Call, output: Any, outs: list[tuple[str, Tensor]],
             credits: dict[int, Any]) -> Any:
    """``output`` with the tensor at each index of ``credits`` (into ``outs``, the flattened
    output) replaced by an alias whose gradient goes to its path's slot and to the credit
    (an input key or ``(PARAM, name)``)."""
    count = itertools.count()

    def alias_of(t: Tensor) -> Tensor:
        i = next(count)
        if i not in credits:
            return t
        sink = boundary_sink(weakref.ref(rec), call, outs[i][0], credits[i])
        return alias(t, sink)

    return map_tensors(output, alias_of)


def _own_base(rec: Recorder, call: Call, t: Tensor, bypassed: Any) -> Tensor | None:
    """The base of ``t`` where ``t`` is a view that gets a boundary node of its own, of a
    tensor the call made or (its view ops bypassed) of one made before it: read at the view's
    own node (see :class:`ViewGroup`). None otherwise (with a listener's rewrites, too)."""
    if rec.rewrite_out is not None or not t._is_view() or isinstance(bypassed, str):
        return None
    base: Any = t._base
    fn = base.grad_fn
    if fn is None:
        return None
    return base if bypassed is not None or fn._sequence_nr() >= call.start else None


def _guard(rec: Recorder, call: Call, base: Tensor, group: ViewGroup,
           members: list[tuple[Tensor, ViewSlot]]) -> None:
    """Hook the node later uses of each marked view reach, then put the group's guard node on
    the base (after the views' boundary nodes, which the views' nodes already bypass)."""
    if not members:
        return
    rec_ref = weakref.ref(rec)
    nodes: list[Any] = [t.grad_fn for t, _ in members]
    group.exact = mark_boundary(base, guard_sink(rec_ref, group))
    if not group.exact:
        return
    for node, (_, slot) in zip(nodes, members):
        node.register_prehook(view_node_prehook(rec_ref, slot))
        call.view_slots.append(slot)


def _view_chain(fn: Any, start: int) -> list[Any] | None:
    """The nodes of the view ops a call made from ``fn`` (the node of a view it returns) back
    to the first tensor made before the call, each with a single edge; None where a node on
    the way has several."""
    chain = [fn]
    while True:
        nexts = fn.next_functions
        if len(nexts) != 1 or nexts[0][0] is None:
            return None
        fn = nexts[0][0]
        if fn._sequence_nr() < start or type(fn) is compat.AccumulateGrad:
            return chain
        chain.append(fn)


def _install_node_hooks(rec: Recorder, call: Call, out_nodes: dict, base_nodes: dict,
                        edges: dict) -> int:
    """Hook the call's nodes; returns how many hooks its record waits for."""
    rewrite_outputs = rec.rewrite_out is not None
    count = 0
    if rewrite_outputs:
        for node, entries in out_nodes.items():
            node.register_prehook(output_prehook(weakref.ref(rec), call, entries))
            count += 1
    for node, entries in base_nodes.items():
        node.register_prehook(base_prehook(weakref.ref(rec), call, entries))
        count += 1
    for node in set(edges) | (set() if rewrite_outputs else set(out_nodes)):
        out_entries = () if rewrite_outputs else tuple(out_nodes.get(node, ()))
        node.register_hook(
            node_posthook(weakref.ref(rec), call, out_entries, tuple(edges.get(node, ()))))
        count += 1
    return count
