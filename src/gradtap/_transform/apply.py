"""When and where transforms run: one installer per ``when`` / ``on``, all through capture.

* ``when="accumulate"``: a post-accumulate event per parameter (``HookSet``); group-only
  rules once at the end of each backward that reached them, over all their parameters;
  batched rules (``clip_norm``, the spike rules) at the end of each backward, over the
  parameters it reached (one by one under compiled autograd, which refuses that callback);
* ``when="step"``: every rule over its parameters' ``.grad`` right before ``optimizer.step()``
  (rules that read the optimizer get it as ``optimizer=``);
* ``when="backward"``: each call's contribution to a parameter, rewritten by a tap's
  :class:`~gradtap.capture.Listener`, and a post-accumulate check that every gradient went
  through such a call;
* ``on="grad_output"`` / ``"grad_input"``: each call's activation gradient, rewritten by a
  tap's listener, per ``"<module>:<path>"`` slot.

:func:`install` picks one. Every subscription lands in the caller's ``HookSet`` or in the
returned :class:`~gradtap.capture.Tap`, which the handle removes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gradtap._transform.base import is_batched, is_group_only, needs
from gradtap._transform.plan import Plan, Rule
from gradtap._transform.state import Entry, StateTable
from gradtap._transform.update import apply_group, apply_one
from gradtap.capture import HookSet, Listener, ScalerWatch, Tap, tap
from gradtap.select import unwrap_model

__all__ = ["install"]

# (entry, parameter) pairs of one rule, in plan order.
_Group = list[tuple[Entry, Tensor]]


def install(
    model: nn.Module,
    plan: Plan,
    states: StateTable,
    hooks: HookSet,
    optimizer: torch.optim.Optimizer | None,
    amp: ScalerWatch | None = None,
) -> Tap | None:
    """Subscribe what ``plan`` needs to ``hooks`` (and a tap, returned); apply into ``states``.

    With ``amp`` (a grad scaler's watch) every transform sees the unscaled gradient."""
    if plan.on != "param_grad":
        return _install_activations(model, plan, states, amp)
    targets: _Group = [(states.entries[name], t.param) for name, t in plan.params.items()]
    if plan.when == "accumulate":
        _install_accumulate(targets, hooks, amp)
        return None
    if plan.when == "step":
        # make_plan refuses when="step" without an optimizer.
        assert optimizer is not None
        _install_step(targets, hooks, optimizer, amp)
        return None
    return _install_backward(model, targets, hooks, amp)


def _step_scale(amp: ScalerWatch | None) -> Tensor | None:
    """The scale on gradients computed in a backward (what a scaled loss gives them)."""
    return None if amp is None else amp.step_scale()


def _by_rule(targets: _Group) -> list[_Group]:
    groups: dict[Rule, _Group] = {}
    for entry, param in targets:
        groups.setdefault(entry.rule, []).append((entry, param))
    return list(groups.values())


def _install_accumulate(targets: _Group, hooks: HookSet, amp: ScalerWatch | None) -> None:
    factor_of = None if amp is None else amp.factor
    whole: _Group = []
    batched: _Group = []
    for entry, param in targets:
        if is_group_only(entry.transform):
            whole.append((entry, param))
            continue
        if is_batched(entry.transform) and entry.transform.update_many is not None:
            batched.append((entry, param))
            continue

        def on_accumulated(p: Tensor, _entry: Entry = entry) -> None:
            g = p.grad
            if g is not None:
                p.grad = apply_one(_entry, g, p, None if amp is None else amp.factor(p))

        hooks.post_accumulate_grad(param, on_accumulated)
    if whole:
        # Once per backward, after every gradient of that backward was accumulated, a
        # group-only rule runs once over the accumulated .grad of all its parameters
        # that have one (as at when="step"), if that backward reached one of them.
        groups = _by_rule(whole)

        def after_backward(reached: list[int]) -> None:
            for i in reached:
                apply_group(groups[i], factor_of)

        hooks.after_accumulation([[p for _, p in group] for group in groups], after_backward)
    if batched:
        # Per-tensor rules with a batched update_many: the same result as one by one as each
        # .grad is accumulated, in a few kernels for all the parameters the backward reached.
        # Under compiled autograd (no end-of-backward callback) they run one by one instead.
        def after_backward_each(reached: list[int]) -> None:
            for group in _by_rule([batched[i] for i in reached]):
                apply_group(group, factor_of)

        def one(i: int, p: Tensor) -> None:
            g = p.grad
            if g is not None:
                p.grad = apply_one(batched[i][0], g, p, None if amp is None else amp.factor(p))

        hooks.after_accumulation([[p] for _, p in batched], after_backward_each, one)


def _install_step(targets: _Group, hooks: HookSet, optimizer: torch.optim.Optimizer,
                  amp: ScalerWatch | None) -> None:
    groups = _by_rule(targets)
    factor_of = None if amp is None else amp.factor
    extras = [{"optimizer": optimizer} if "optimizer" in needs(group[0][0].transform) else {}
              for group in groups]

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Unfused: scaler.step unscaled the gradients first (and skips the step on an
        # overflow); fused: they are still scaled here.
        for group, extra in zip(groups, extras, strict=True):
            apply_group(group, factor_of, extra)

    hooks.optimizer_step_pre(optimizer, before_step)


class _Owned:
    """A parameter transformed inside the calls of the module(s) owning it directly."""

    __slots__ = ("entry", "param", "owners", "hits")

    def __init__(self, entry: Entry, param: Tensor) -> None:
        self.entry = entry
        self.param = param
        self.owners: list[str] = []
        self.hits = 0  # contributions transformed in the current backward


class _Contributions(Listener):
    """when="backward": each call's contribution to a parameter, before accumulation."""

    def __init__(self, direct: dict[tuple[str, str], _Owned], amp: ScalerWatch | None) -> None:
        self._direct = direct
        self._amp = amp

    def rewrite_param_grad(self, name: str, call: int, param: str, grad: Tensor) -> Tensor | None:
        # A module's record covers parameters of its children too: only the direct owner
        # transforms, so each contribution is transformed exactly once.
        owned = self._direct.get((name, param))
        if owned is None:
            return None
        owned.hits += 1
        return apply_one(owned.entry, grad, owned.param, _step_scale(self._amp))


def _install_backward(model: nn.Module, targets: _Group, hooks: HookSet,
                      amp: ScalerWatch | None) -> Tap:
    # Keyed by identity, so a parameter shared by two modules (tied weights) is transformed
    # in the calls of each module that owns it directly.
    by_id = {id(param): _Owned(entry, param) for entry, param in targets}
    direct: dict[tuple[str, str], _Owned] = {}
    for mod_name, module in unwrap_model(model).named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            owned = by_id.get(id(p))
            if owned is not None and (mod_name, p_name) not in direct:
                direct[mod_name, p_name] = owned
                owned.owners.append(mod_name or "<root>")
    # A predicate, not globs: module names may hold glob characters (ModuleDict keys).
    owner_set = {m for m, _ in direct}
    made = tap(model, select=lambda name, _m: name in owner_set, store=False,
               listener=_Contributions(direct, amp))

    for owned in by_id.values():

        def check(p: Tensor, _owned: _Owned = owned) -> None:
            # A parameter used only outside the calls of the module that owns it (e.g.
            # `F.linear(x, self.a.weight)` in a parent's forward) would silently keep its
            # plain gradient: say so instead.
            if _owned.hits == 0:
                entry = _owned.entry
                raise ValueError(
                    f"rule {entry.label!r} on parameter {entry.name!r}: when='backward' "
                    f"transforms the contributions made inside calls of the module that "
                    f"owns it ({', '.join(map(repr, _owned.owners))}), but this backward gave "
                    "it a gradient with no such call (it is used outside its module); use "
                    "when='accumulate' or when='step'"
                )
            _owned.hits = 0

        hooks.post_accumulate_grad(owned.param, check)
    return made


class _SlotGrads(Listener):
    """Activation gradients, per ``"<module>:<path>"`` slot; subclasses pick the side."""

    def __init__(self, states: StateTable, amp: ScalerWatch | None) -> None:
        self._states = states
        self._amp = amp

    def _rewrite(self, name: str, path: str, grad: Tensor) -> Tensor | None:
        entry = self._states.slot(name, path, grad)
        return None if entry is None else apply_one(entry, grad, None, _step_scale(self._amp))


class _GradOutputs(_SlotGrads):
    """on="grad_output": dL/d(output) as it enters each selected call's backward."""

    def rewrite_grad_output(self, name: str, call: int, path: str, grad: Tensor) -> Tensor | None:
        return self._rewrite(name, path, grad)


class _GradInputs(_SlotGrads):
    """on="grad_input": what each selected call sends to its inputs."""

    def rewrite_grad_input(self, name: str, call: int, key: str, grad: Tensor) -> Tensor | None:
        return self._rewrite(name, key, grad)


def _install_activations(model: nn.Module, plan: Plan, states: StateTable,
                         amp: ScalerWatch | None) -> Tap:
    modules = plan.modules
    listener = (_GradOutputs if plan.on == "grad_output" else _GradInputs)(states, amp)
    return tap(model, select=lambda name, _m: name in modules, store=False, listener=listener)
