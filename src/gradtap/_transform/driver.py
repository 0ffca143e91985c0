"""``gradtap.transform``: apply per-layer gradient transforms to a model.

The driver resolves ``{selector: Transform}`` rules into a plan once (first match wins),
keeps one state per parameter (or per module output/input slot for activation gradients) in
the handle, and asks :mod:`gradtap.capture` for the hooks that apply the transforms at the
chosen moment. Nothing is stored on the model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._transform.base import State, Transform, is_group_only
from gradtap._types import OnLiteral, WhenLiteral
from gradtap.capture import HookSet, Tap, at_end_of_backward, tap
from gradtap.errors import SelectionError
from gradtap.select import select_modules, select_parameters

__all__ = ["TransformHandle", "transform"]

_WHENS: tuple[str, ...] = ("backward", "accumulate", "step")
_ONS: tuple[str, ...] = ("param_grad", "grad_output", "grad_input")
_STATE_VERSION = 1

Rules = Mapping[Any, Transform] | Sequence[tuple[Any, Transform]]


class _Entry:
    """One transformed tensor (a parameter or an activation slot): its rule and its state."""

    __slots__ = ("name", "label", "transform", "state", "param", "hits")

    def __init__(self, name: str, label: str, t: Transform, state: State, param: Tensor | None) -> None:
        self.name = name
        self.label = label
        self.transform = t
        self.state = state
        self.param = param
        self.hits = 0  # when="backward": contributions transformed in the current backward


def _label(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def _check_output(out: Any, grad: Tensor, label: str, where: str) -> Tensor:
    if not isinstance(out, Tensor):
        raise TypeError(
            f"rule {label!r} on {where}: the transform returned {type(out).__name__} as the new "
            "gradient; expected a Tensor (update must return (new_grad, new_state))"
        )
    if out.shape != grad.shape or out.dtype != grad.dtype or out.device != grad.device:
        raise ValueError(
            f"rule {label!r} on {where}: the transform returned shape {tuple(out.shape)}, "
            f"{out.dtype}, {out.device}; expected shape {tuple(grad.shape)}, {grad.dtype}, "
            f"{grad.device} like the gradient it replaces"
        )
    return out


def _unpack(result: Any, label: str, where: str) -> tuple[Any, State]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"rule {label!r} on {where}: update must return a pair (new_grad, new_state); "
            f"got {type(result).__name__}"
        )
    return result


def _check_same_structure(expected: Any, got: Any, where: str) -> Any:
    """Return ``got`` with tensors moved to the device of ``expected``; raise if shapes differ."""
    if isinstance(expected, Tensor):
        if not isinstance(got, Tensor) or got.shape != expected.shape:
            what = f"shape {tuple(got.shape)}" if isinstance(got, Tensor) else type(got).__name__
            raise ValueError(
                f"load_state_dict: state {where} holds {what}; expected a tensor of shape "
                f"{tuple(expected.shape)} (was the checkpoint made with the same rules and model?)"
            )
        return got.to(device=expected.device)
    if isinstance(expected, Mapping):
        if not isinstance(got, Mapping) or set(got) != set(expected):
            what = f"keys {sorted(map(str, got))}" if isinstance(got, Mapping) else type(got).__name__
            raise ValueError(
                f"load_state_dict: state {where} holds {what}; expected keys "
                f"{sorted(map(str, expected))} (was the checkpoint made with the same rules?)"
            )
        return {k: _check_same_structure(expected[k], got[k], f"{where}[{k!r}]") for k in expected}
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            what = f"{len(got)} parts" if isinstance(got, (tuple, list)) else type(got).__name__
            raise ValueError(
                f"load_state_dict: state {where} holds {what}; expected a tuple of "
                f"{len(expected)} parts (was the checkpoint made with the same rules?)"
            )
        parts = [_check_same_structure(e, g, f"{where}[{i}]") for i, (e, g) in enumerate(zip(expected, got, strict=True))]
        return type(expected)(parts)
    return got


class TransformHandle:
    """The live transforms installed by :func:`transform`; remove with :meth:`remove`.

    Attributes:
        on: which gradients are transformed (``"param_grad"``, ``"grad_output"``, ``"grad_input"``).
        when: when parameter gradients are transformed (``"backward"``, ``"accumulate"``, ``"step"``).
    """

    def __init__(
        self,
        model: nn.Module,
        rules: Rules,
        when: WhenLiteral | None,
        on: OnLiteral,
        optimizer: torch.optim.Optimizer | None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"transform() needs an nn.Module; got {type(model).__name__}")
        if on not in _ONS:
            raise ValueError(f"transform(): unknown on={on!r}; expected one of {', '.join(map(repr, _ONS))}")
        if when is None:
            when = "accumulate" if on == "param_grad" else "backward"
        if when not in _WHENS:
            raise ValueError(
                f"transform(): unknown when={when!r}; expected one of {', '.join(map(repr, _WHENS))}"
            )
        if on != "param_grad" and when != "backward":
            raise ValueError(
                f"transform(): on={on!r} transforms activation gradients as each call's backward "
                f"runs, so only when='backward' applies; got when={when!r}"
            )
        if when == "step" and optimizer is None:
            raise ValueError(
                "transform(): when='step' transforms gradients right before optimizer.step(); "
                "pass optimizer=<the torch.optim.Optimizer that steps these parameters>"
            )
        if when != "step" and optimizer is not None:
            raise ValueError(f"transform(): optimizer= is only used with when='step'; got when={when!r}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"transform(): optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
        self.on: OnLiteral = on
        self.when: WhenLiteral = when
        pairs = self._rule_pairs(rules)
        self._hooks = HookSet()
        self._tap: Tap | None = None
        self._removed = False
        self._entries: dict[str, _Entry] = {}
        # activation gradients: module name -> (label, transform); slot entries made lazily
        self._module_rules: dict[str, tuple[str, Transform]] = {}
        self._pending: dict[str, State] = {}
        try:
            if on == "param_grad":
                self._plan_params(model, pairs, optimizer)
                self._install_param_hooks(model, optimizer)
            else:
                self._plan_modules(model, pairs)
                self._install_activation_hooks(model)
        except BaseException:
            self.remove()
            raise

    # -- planning ---------------------------------------------------------------------------

    @staticmethod
    def _rule_pairs(rules: Rules) -> list[tuple[Any, str, Transform]]:
        if isinstance(rules, Mapping):
            items = list(rules.items())
        elif isinstance(rules, Sequence) and not isinstance(rules, str):
            items = list(rules)
            for i, item in enumerate(items):
                if not (isinstance(item, tuple) and len(item) == 2):
                    raise TypeError(
                        f"transform(): rules must be a mapping {{glob: Transform}} or a sequence "
                        f"of (glob, Transform) pairs; item {i} is {type(item).__name__}"
                    )
        else:
            raise TypeError(
                f"transform(): rules must be a mapping {{glob: Transform}}; got {type(rules).__name__}"
            )
        if not items:
            raise ValueError("transform(): rules is empty; give at least one {glob: Transform}")
        out = []
        for key, t in items:
            label = _label(key)
            if not isinstance(t, Transform):
                raise TypeError(
                    f"rule {label!r}: expected a gradtap Transform (e.g. gt.scale(0.1)); got "
                    f"{type(t).__name__}"
                )
            out.append((key, label, t))
        return out

    def _assign(
        self, pairs: list[tuple[Any, str, Transform]], matches: list[list[str]], what: str
    ) -> dict[str, tuple[str, Transform]]:
        owner: dict[str, tuple[str, Transform]] = {}
        for (_, label, t), names in zip(pairs, matches, strict=True):
            fresh = [n for n in names if n not in owner]
            if not fresh:
                taken = sorted({owner[n][0] for n in names})
                raise SelectionError(
                    f"rule {label!r} applies to no {what}: every {what} it matches "
                    f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}) was taken by "
                    f"the earlier rule(s) {', '.join(map(repr, taken))} (first match wins); "
                    "reorder or remove it"
                )
            for n in fresh:
                owner[n] = (label, t)
        return owner

    def _plan_params(
        self, model: nn.Module, pairs: list[tuple[Any, str, Transform]], optimizer: torch.optim.Optimizer | None
    ) -> None:
        if self.when == "backward":
            for _, label, t in pairs:
                if is_group_only(t):
                    raise ValueError(
                        f"rule {label!r}: clip_global_norm needs every gradient the rule matched at "
                        "once; when='backward' transforms each call's contribution as it arrives "
                        "(use when='accumulate' to clip after each backward, when='step' to clip "
                        "before each optimizer step, or clip_norm for a per-tensor bound)"
                    )
        params = dict(model.named_parameters())
        matches = []
        for key, label, _ in pairs:
            names = [n for n, _ in select_parameters(model, key)]
            trainable = [n for n in names if params[n].requires_grad]
            if not trainable:
                raise SelectionError(
                    f"rule {label!r} matches only parameters that do not require grad "
                    f"({', '.join(names[:5])}); they never get a gradient to transform"
                )
            matches.append(trainable)
        owner = self._assign(pairs, matches, "parameter")
        if optimizer is not None:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            outside = [n for n in owner if id(params[n]) not in stepped]
            if outside:
                labels = sorted({owner[n][0] for n in outside})
                raise ValueError(
                    f"rule(s) {', '.join(map(repr, labels))}: parameter(s) {', '.join(outside[:5])} "
                    "are not in the optimizer's param_groups, so when='step' would never apply "
                    "to them at the right time; narrow the rule or add them to the optimizer"
                )
        for name, p in params.items():  # named_parameters() order
            if name in owner:
                label, t = owner[name]
                self._entries[name] = _Entry(name, label, t, t.init(p.detach()), p)

    def _plan_modules(self, model: nn.Module, pairs: list[tuple[Any, str, Transform]]) -> None:
        for _, label, t in pairs:
            if is_group_only(t):
                raise ValueError(
                    f"rule {label!r}: clip_global_norm needs every gradient the rule matched at "
                    f"once; on={self.on!r} transforms each call's gradient as it arrives, so it "
                    "cannot be used here (use clip_norm for a per-tensor bound)"
                )
        matches = [[n for n, _ in select_modules(model, key)] for key, _, _ in pairs]
        owner = self._assign(pairs, matches, "module")
        order = [n for n, _ in model.named_modules()]
        self._module_rules = {n: owner[n] for n in order if n in owner}

    # -- hooks ------------------------------------------------------------------------------

    def _where(self, entry: _Entry) -> str:
        return f"parameter {entry.name!r}" if self.on == "param_grad" else f"{self.on} {entry.name!r}"

    def _apply(self, entry: _Entry, grad: Tensor, param: Tensor | None) -> Tensor:
        result = entry.transform.update(grad, entry.state, param)
        # Cheap metadata checks on the hot path; the message is built only on failure.
        if not (isinstance(result, tuple) and len(result) == 2):
            _unpack(result, entry.label, self._where(entry))
        new, state = result
        if not (
            isinstance(new, Tensor)
            and new.shape == grad.shape
            and new.dtype == grad.dtype
            and new.device == grad.device
        ):
            _check_output(new, grad, entry.label, self._where(entry))
        entry.state = state
        return new

    def _install_param_hooks(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if self.when == "accumulate":
            whole_rules: dict[str, list[_Entry]] = {}
            for entry in self._entries.values():
                if is_group_only(entry.transform):
                    whole_rules.setdefault(entry.label, []).append(entry)
                    continue

                def on_accumulated(p: Tensor, _entry: _Entry = entry) -> None:
                    if p.grad is not None:
                        p.grad = self._apply(_entry, p.grad, p)

                self._hooks.post_accumulate_grad(entry.param, on_accumulated)
            if whole_rules:
                self._install_end_of_backward(list(whole_rules.values()))
        elif self.when == "step":
            groups: dict[str, list[_Entry]] = {}
            for entry in self._entries.values():
                groups.setdefault(entry.label, []).append(entry)
            group_list = list(groups.values())

            def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                for entries in group_list:
                    self._step_group(entries)

            assert optimizer is not None
            self._hooks.optimizer_step_pre(optimizer, before_step)
        else:  # "backward": each call's contribution, through capture's per-call rewrite
            # Keyed by identity, so a parameter shared by two modules (tied weights) is
            # transformed in the calls of each module that owns it directly.
            by_id = {id(e.param): e for e in self._entries.values()}
            direct: dict[tuple[str, str], _Entry] = {}
            for mod_name, module in model.named_modules(remove_duplicate=False):
                for p_name, p in module.named_parameters(recurse=False):
                    entry = by_id.get(id(p))
                    if entry is not None:
                        direct.setdefault((mod_name, p_name), entry)
            owners = list(dict.fromkeys(m for m, _ in direct))

            def rewrite(module_name: str, call: int, param_name: str, grad: Tensor) -> Tensor | None:
                # A module's record covers parameters of its children too: only the direct
                # owner transforms, so each contribution is transformed exactly once.
                entry = direct.get((module_name, param_name))
                if entry is None:
                    return None
                entry.hits += 1
                return self._apply(entry, grad, entry.param)

            # A predicate, not globs: module names may hold glob characters (ModuleDict keys).
            owner_set = set(owners)
            self._tap = tap(model, select=lambda name, _m: name in owner_set, store=False,
                            rewrite_param_grad=rewrite)

            owners_of: dict[int, list[str]] = {}
            for (mod_name, _), entry in direct.items():
                owners_of.setdefault(id(entry), []).append(mod_name or "<root>")
            for entry in self._entries.values():

                def check(p: Tensor, _entry: _Entry = entry) -> None:
                    # A parameter used only outside the calls of the module that owns it (e.g.
                    # `F.linear(x, self.a.weight)` in a parent's forward) would silently keep
                    # its plain gradient: say so instead.
                    if _entry.hits == 0:
                        owners_txt = ", ".join(map(repr, owners_of.get(id(_entry), [])))
                        raise ValueError(
                            f"rule {_entry.label!r} on parameter {_entry.name!r}: when='backward' "
                            f"transforms the contributions made inside calls of the module that "
                            f"owns it ({owners_txt}), but this backward gave it a gradient with no "
                            "such call (it is used outside its module); use when='accumulate' or "
                            "when='step'"
                        )
                    _entry.hits = 0

                self._hooks.post_accumulate_grad(entry.param, check)

    def _install_end_of_backward(self, groups: list[list[_Entry]]) -> None:
        """when="accumulate" for group-only rules (``clip_global_norm``): once per backward,
        after every gradient of that backward was accumulated, the rule runs once over the
        accumulated ``.grad`` of all its parameters that have one (as at ``when="step"``).

        A rule is run at the end of a backward only if that backward accumulated into at
        least one of its parameters. A backward nested inside a node of another backward
        (reentrant activation checkpointing) is not the end: the rule waits for the
        enclosing backward, whose other gradients are still to come.
        """
        reached = [False] * len(groups)
        queued: list[int | None] = [None]  # the graph task whose end is already awaited

        def defer_to_enclosing(node: Any) -> None:
            fired = [False]

            def after_node(grad_inputs: Any, grad_outputs: Any) -> None:
                # One-shot: with retain_graph the node may run again in a later backward.
                if not fired[0] and self._hooks.enabled:
                    fired[0] = True
                    at_end_of_backward(end_of_backward)

            node.register_hook(after_node)

        def end_of_backward() -> None:
            if not self._hooks.enabled:
                return
            node = torch._C._current_autograd_node()
            if node is not None:  # a nested backward ends inside a node of another one
                defer_to_enclosing(node)
                return
            queued[0] = None
            todo = [entries for entries, hit in zip(groups, reached, strict=True) if hit]
            reached[:] = [False] * len(groups)
            for entries in todo:
                self._step_group(entries)

        for i, entries in enumerate(groups):
            for entry in entries:

                def on_accumulated(p: Tensor, _i: int = i) -> None:
                    reached[_i] = True
                    task = torch._C._current_graph_task_id()
                    if task != queued[0]:
                        # Once per backward (a stale id left by a backward that raised is
                        # never reused: graph task ids only grow).
                        queued[0] = task
                        at_end_of_backward(end_of_backward)

                self._hooks.post_accumulate_grad(entry.param, on_accumulated)

    def _step_group(self, entries: list[_Entry]) -> None:
        live = [e for e in entries if e.param is not None and e.param.grad is not None]
        if not live:
            return
        t = live[0].transform
        if t.update_many is None:
            for e in live:
                e.param.grad = self._apply(e, e.param.grad, e.param)  # type: ignore[union-attr]
            return
        label = live[0].label
        grads = [e.param.grad for e in live]  # type: ignore[union-attr]
        result = t.update_many(grads, [e.state for e in live], [e.param for e in live])
        new_grads, new_states = _unpack(result, label, "its parameters (update_many)")
        new_grads, new_states = list(new_grads), list(new_states)
        if len(new_grads) != len(live) or len(new_states) != len(live):
            raise ValueError(
                f"rule {label!r}: update_many returned {len(new_grads)} gradients and "
                f"{len(new_states)} states for {len(live)} parameters"
            )
        for e, g, new, state in zip(live, grads, new_grads, new_states, strict=True):
            _check_output(new, g, label, f"parameter {e.name!r}")
            e.state = state
        for e, new in zip(live, new_grads, strict=True):
            e.param.grad = new  # type: ignore[union-attr]

    def _install_activation_hooks(self, model: nn.Module) -> None:
        rules = self._module_rules

        def rewrite_slot(module_name: str, path: str, grad: Tensor) -> Tensor | None:
            rule = rules.get(module_name)
            if rule is None:
                return None
            slot = f"{module_name}:{path}"
            entry = self._entries.get(slot)
            if entry is None:
                label, t = rule
                pending = self._pending.pop(slot, None)
                state = pending if pending is not None else t.init(grad.detach())
                entry = self._entries[slot] = _Entry(slot, label, t, state, None)
            return self._apply(entry, grad, None)

        def select(name: str, module: nn.Module) -> bool:
            return name in rules

        if self.on == "grad_output":
            self._tap = tap(model, select=select, store=False, rewrite_grad_output=rewrite_slot)
        else:
            self._tap = tap(model, select=select, store=False, rewrite_grad_input=rewrite_slot)

    # -- public -----------------------------------------------------------------------------

    def plan(self) -> dict[str, str]:
        """Return which rule applies where: ``{name: rule pattern}``.

        Names are parameter names (``on="param_grad"``, in ``named_parameters()`` order) or
        module names (activation gradients, in ``named_modules()`` order). Parameters and
        modules that no rule matched are absent.
        """
        if self.on == "param_grad":
            return {name: e.label for name, e in self._entries.items()}
        return {name: label for name, (label, _) in self._module_rules.items()}

    def state_dict(self) -> dict[str, Any]:
        """Return a copy of every transform state, keyed by parameter name or slot.

        Slots of activation gradients are named ``"<module>:<path>"`` (e.g.
        ``"encoder:output"``) and exist once a backward reached them. The result holds only
        strings, numbers and tensors, so ``torch.save`` / ``torch.load(weights_only=True)``
        round-trips it.
        """
        states = {name: e.state for name, e in self._entries.items()}
        states.update(self._pending)
        return {
            "version": _STATE_VERSION,
            "on": self.on,
            "when": self.when,
            "plan": self.plan(),
            "state": copy.deepcopy(states),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore states saved by :meth:`state_dict`, so training resumes bit for bit.

        Raises:
            ValueError: the checkpoint was made with different rules, ``on`` or names, or a
                state does not have the structure this handle's transforms expect.
        """
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "plan" not in state_dict:
            raise ValueError("load_state_dict: expected a dict made by TransformHandle.state_dict()")
        if state_dict.get("on") != self.on:
            raise ValueError(f"load_state_dict: checkpoint has on={state_dict.get('on')!r}; this handle has on={self.on!r}")
        plan, saved_plan = self.plan(), dict(state_dict["plan"])
        if saved_plan != plan:
            missing = sorted(set(plan) - set(saved_plan))
            extra = sorted(set(saved_plan) - set(plan))
            changed = sorted(n for n in set(plan) & set(saved_plan) if plan[n] != saved_plan[n])
            raise ValueError(
                "load_state_dict: the checkpoint's plan differs from this handle's: "
                f"missing {missing[:5]}, unexpected {extra[:5]}, different rule for {changed[:5]}"
            )
        states = copy.deepcopy(dict(state_dict["state"]))  # one deepcopy keeps shared tensors shared
        new: dict[str, State] = {}
        pending: dict[str, State] = {}
        for name, state in states.items():
            if self.on == "param_grad":
                if name not in self._entries:
                    raise ValueError(f"load_state_dict: state for unknown parameter {name!r}")
                new[name] = _check_same_structure(self._entries[name].state, state, repr(name))
            else:
                module = name.split(":", 1)[0]
                if module not in self._module_rules or ":" not in name:
                    raise ValueError(f"load_state_dict: state for unknown slot {name!r}")
                pending[name] = state
        if self.on == "param_grad":
            absent = sorted(set(self._entries) - set(new))
            if absent:
                raise ValueError(f"load_state_dict: the checkpoint has no state for {absent[:5]}")
            for name, state in new.items():
                self._entries[name].state = state
        else:
            self._entries.clear()
            self._pending = pending

    def remove(self) -> None:
        """Remove every hook; the model is left as it was. Safe to call more than once."""
        self._removed = True
        if self._tap is not None:
            self._tap.remove()
        self._hooks.remove()

    def __enter__(self) -> TransformHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        status = "removed" if self._removed else "active"
        return f"<TransformHandle {status}: on={self.on!r}, when={self.when!r}, {len(self.plan())} targets>"


def transform(
    model: nn.Module,
    rules: Rules,
    when: WhenLiteral | None = None,
    on: OnLiteral = "param_grad",
    optimizer: torch.optim.Optimizer | None = None,
) -> TransformHandle:
    """Apply stateful gradient transforms to selected parameters or module gradients.

    Rules are an ordered mapping from a glob to a :class:`Transform`. Globs match parameter
    names (``named_parameters()``) for ``on="param_grad"`` and module names
    (``named_modules()``) for ``on="grad_output"`` / ``"grad_input"``; other selectors
    accepted by :mod:`gradtap.select` work too. The first rule that matches wins; a rule
    that matches nothing (or only what earlier rules took) raises :class:`SelectionError`.
    Parameters that do not require grad are left out. State is kept per parameter (or per
    ``"<module>:<slot>"``) in the handle, never on the model.

    ``when`` (parameter gradients):

    * ``"accumulate"`` (default): once per backward, on ``p.grad`` right after it was
      accumulated (with micro-batching it sees the running sum, transformed so far);
    * ``"backward"``: each module call's contribution before accumulation, so the calls of
      a shared module are transformed separately (a parameter is transformed inside the calls
      of the module that owns it directly);
    * ``"step"``: once per ``optimizer.step()``, right before it, on the accumulated gradient
      (the choice for gradient accumulation); needs ``optimizer=``.

    A rule holding ``clip_global_norm`` (alone or in a :func:`chain`) runs once over all the
    parameters it matched, on the accumulated ``p.grad`` of those that have one (a
    parameter whose ``.grad`` is None is left out): with ``"step"`` right before each
    ``optimizer.step()``; with ``"accumulate"`` at the end of each backward that accumulated
    into at least one of them, after all that backward's gradients are in. So
    ``"accumulate"`` gives what ``torch.nn.utils.clip_grad_norm_(<the rule's parameters>,
    max_norm)`` called after every backward gives: with one backward per step that is the
    usual clipping; with several backwards before a step each one clips the running sum
    (the earlier, already clipped, part included), not its own increment, so the global norm
    of those ``.grad`` never exceeds ``max_norm`` between backwards. To clip the sum of the
    micro-batches once, use ``"step"``. ``"backward"`` and activation gradients refuse it.

    Activation gradients (``on="grad_output"``: dL/d(output) as it enters the module's
    backward, so everything upstream sees the change; ``on="grad_input"``: what a call sends
    to its inputs) are transformed per call, ``when="backward"``. Their transforms' ``init``
    receives the first gradient seen at a slot and ``update`` gets ``param=None``.

    Args:
        model: the model.
        rules: ``{glob: Transform}`` (or a sequence of ``(glob, Transform)`` pairs), in order.
        when: ``"accumulate"``, ``"backward"`` or ``"step"``; default ``"accumulate"`` for
            parameters, ``"backward"`` for activation gradients.
        on: ``"param_grad"`` (default), ``"grad_output"`` or ``"grad_input"``.
        optimizer: the optimizer whose ``step()`` triggers ``when="step"``.

    Returns:
        A :class:`TransformHandle` (``plan()``, ``state_dict()``, ``load_state_dict()``,
        ``remove()``; a context manager).

    Raises:
        SelectionError: a rule matches nothing.
        ValueError: unknown ``when``/``on``, ``when="step"`` without an optimizer,
            ``clip_global_norm`` with ``when="backward"`` or on activation gradients; and,
            during backward or step, a
            transform that returns a gradient of another shape, dtype or device (naming
            the rule and the parameter).
        TypeError: a rule's value is not a :class:`Transform`.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        >>> rules = {"0.weight": gt.chain(gt.normalize(0.99), gt.clip_norm(1.0)), "*.bias": gt.scale(0.1)}
        >>> with gt.transform(net, rules, when="accumulate") as h:
        ...     net(torch.randn(2, 3)).sum().backward()
        >>> h.plan()
        {'0.weight': '0.weight', '0.bias': '*.bias', '1.bias': '*.bias'}
    """
    return TransformHandle(model, rules, when, on, optimizer)

