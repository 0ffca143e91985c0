"""The graph walk: the nodes one call created, and their edges into its inputs and parameters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from gradtap.capture import compat
from gradtap.capture.boundary import stands_for

if TYPE_CHECKING:
    from gradtap.capture.state import Call

__all__ = ["INPUT", "INPUT_REGION", "PARAM", "made_since", "sequence_mark", "walk_call"]

#: Kinds of an edge found by :func:`walk_call`: into an argument, into a parameter, into the
#: base of a view argument (the key then also says where the view lies in it).
INPUT, PARAM, INPUT_REGION = 0, 1, 2

Edges = dict[Any, list[tuple[int, int, Any]]]


def sequence_mark() -> int:
    """A mark in the order autograd records ops: ops recorded from now on are at or after it
    (see :func:`made_since`)."""
    return compat.sequence_nr()


def made_since(t: Tensor, mark: int) -> bool:
    """Whether ``t`` was made by an op recorded at or after ``mark`` (False for a leaf or a
    tensor that does not require grad).

    Example:
        >>> import torch
        >>> x = torch.ones(2, requires_grad=True)
        >>> before = x * 2
        >>> mark = sequence_mark()
        >>> [made_since(t, mark) for t in (x, before, before + 1)]
        [False, False, True]
    """
    fn = t.grad_fn
    return fn is not None and fn._sequence_nr() >= mark
Users = dict[tuple[Any, int], list[Any]]


def walk_call(call: Call, starts: list[Any], watched: dict[tuple[Any, int], None]
              ) -> tuple[Edges, Users]:
    """Walk the nodes ``call`` created, back from its outputs' nodes ``starts``.

    Returns the nodes with edges into the call's inputs, the bases of its view inputs or
    its parameters (``{node: [(edge index, kind, key)]}``), and for each watched edge
    the nodes of this call that use it (``{edge: [node]}``).

    An edge into a node that a call inside this one put in front of an argument (a boundary
    node of a pass-through, or the ``CopySlices`` node a pass-through of a view of the
    argument put on it; :func:`~gradtap.capture.boundary.stands_for`) counts as an edge into
    that argument: the uses after the inner call returned, which also go through that node,
    include uses after this call returned. Not so for a node this call returns (one of
    ``starts``): the uses after this call are then uses of its output.
    """
    start, param_by_id = call.start, call.info.param_by_id
    input_edges, input_bases = call.input_edges, call.input_bases
    current: dict[int, str] | None = call.param_ids
    stack = [n for n in dict.fromkeys(starts)
             if n._sequence_nr() >= start and type(n) is not compat.AccumulateGrad]
    seen = set(stack)
    returned = frozenset(stack)
    found: Edges = {}
    users: Users = {}
    while stack:
        node = stack.pop()
        for i, edge in enumerate(node.next_functions):
            nxt = edge[0]
            if nxt is None:
                continue
            if edge in watched:
                users.setdefault(edge, []).append(node)
            if (edge not in input_edges and nxt not in returned
                    and nxt._sequence_nr() >= start):
                edge = _argument_behind(edge, input_edges, input_bases)
            key = input_edges.get(edge)
            if key is not None:
                found.setdefault(node, []).append((i, INPUT, key))
            elif edge in input_bases:
                found.setdefault(node, []).append((i, INPUT_REGION, input_bases[edge]))
            elif type(nxt) is compat.AccumulateGrad:
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
                    found.setdefault(node, []).append((i, PARAM, name))
            elif nxt not in seen and nxt._sequence_nr() >= start:
                seen.add(nxt)
                stack.append(nxt)
    return found, users


def _argument_behind(edge: tuple[Any, int], input_edges: dict, input_bases: dict
                     ) -> tuple[Any, int]:
    """The edge of an argument (or of the base of a view argument) that ``edge`` stands in
    front of through nodes :func:`~gradtap.capture.boundary.mark_boundary` put; ``edge``
    itself where there is none."""
    behind = stands_for(edge[0])
    while behind is not None:
        if behind in input_edges or behind in input_bases:
            return behind
        behind = stands_for(behind[0]) if behind[0] is not None else None
    return edge
