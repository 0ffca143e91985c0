"""Which rule applies where: ``{selector: Transform}`` resolved once into a :class:`Plan`.

Every check that needs no gradient happens here, before any hook exists: the ``when`` /
``on`` / ``optimizer`` options, the rules themselves, and what each rule matches. The first
rule that matches a parameter (or, for activation gradients, a module) wins; a rule left
with nothing raises :class:`~gradtap.errors.SelectionError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import torch
from torch import nn

from gradtap._tensorops.sharded import is_sharded
from gradtap._transform.base import Transform, group_only_name, is_group_only, needs
from gradtap._types import ONS, WHENS, OnLiteral, WhenLiteral
from gradtap.errors import SelectionError
from gradtap.select import select_modules, select_parameters

__all__ = ["ParamTarget", "Plan", "Rule", "Rules", "make_plan"]


#: What :func:`gradtap.transform` accepts as rules. Keys are selectors (see
#: :mod:`gradtap.select`); ``Any`` because a ``Mapping`` is invariant in its key type, so a
#: ``dict[str, Transform]`` would not be a ``Mapping[Selector, Transform]``.
Rules: TypeAlias = Mapping[Any, Transform] | Sequence[tuple[Any, Transform]]


class Rule(NamedTuple):
    """One rule: its label (the selector as :meth:`TransformHandle.plan` shows it) and transform."""

    label: str
    transform: Transform


class ParamTarget(NamedTuple):
    """A parameter a rule applies to (``on="param_grad"``)."""

    rule: Rule
    param: nn.Parameter


class Plan(NamedTuple):
    """The resolved rules of one handle.

    ``params`` (``on="param_grad"``, in ``named_parameters()`` order) or ``modules``
    (activation gradients, in ``named_modules()`` order) is filled; the other is empty.
    """

    on: OnLiteral
    when: WhenLiteral
    params: dict[str, ParamTarget]
    modules: dict[str, Rule]

    def labels(self) -> dict[str, str]:
        """``{parameter or module name: rule label}``, what ``TransformHandle.plan()`` returns."""
        if self.on == "param_grad":
            return {name: target.rule.label for name, target in self.params.items()}
        return {name: rule.label for name, rule in self.modules.items()}


def make_plan(
    model: nn.Module,
    rules: Rules,
    when: WhenLiteral | None,
    on: OnLiteral,
    optimizer: torch.optim.Optimizer | None,
) -> Plan:
    """Check the options and resolve ``rules`` on ``model`` (first match wins).

    Raises what :func:`gradtap.transform` documents (TypeError, ValueError, SelectionError),
    always before any hook is installed.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        >>> plan = make_plan(net, {"0.*": gt.scale(0.5), "*": gt.zero()}, None, "param_grad", None)
        >>> plan.when, plan.labels()
        ('accumulate', {'0.weight': '0.*', '0.bias': '0.*', '2.weight': '*', '2.bias': '*'})
    """
    when = _check_options(when, on, optimizer)
    pairs = _rule_pairs(rules)
    if on == "param_grad":
        return Plan(on, when, _plan_params(model, pairs, when, optimizer), {})
    return Plan(on, when, {}, _plan_modules(model, pairs, on))


def _check_options(
    when: WhenLiteral | None, on: OnLiteral, optimizer: torch.optim.Optimizer | None
) -> WhenLiteral:
    """Return ``when`` with its default filled in; raise on a combination that cannot work."""
    if on not in ONS:
        raise ValueError(f"transform(): unknown on={on!r}; expected one of {', '.join(map(repr, ONS))}")
    if when is None:
        when = "accumulate" if on == "param_grad" else "backward"
    if when not in WHENS:
        raise ValueError(
            f"transform(): unknown when={when!r}; expected one of {', '.join(map(repr, WHENS))}"
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
    return when


def _label(key: Any) -> str:
    return key if isinstance(key, str) else repr(key)


def _rule_pairs(rules: Rules) -> list[tuple[Any, Rule]]:
    """``[(selector, Rule)]`` in order, checking the container and every value."""
    items: list[Any]
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
        out.append((key, Rule(label, t)))
    return out


def _assign(rules: list[Rule], matches: list[list[str]], what: str) -> dict[str, Rule]:
    """First match wins: ``{name: rule}``; a rule left with no name of its own raises."""
    owner: dict[str, Rule] = {}
    for rule, names in zip(rules, matches, strict=True):
        fresh = [n for n in names if n not in owner]
        if not fresh:
            taken = sorted({owner[n].label for n in names})
            raise SelectionError(
                f"rule {rule.label!r} applies to no {what}: every {what} it matches "
                f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''}) was taken by "
                f"the earlier rule(s) {', '.join(map(repr, taken))} (first match wins); "
                "reorder or remove it"
            )
        for n in fresh:
            owner[n] = rule
    return owner


def _plan_params(
    model: nn.Module,
    pairs: list[tuple[Any, Rule]],
    when: WhenLiteral,
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, ParamTarget]:
    if when == "backward":
        for _, rule in pairs:
            if is_group_only(rule.transform):
                raise ValueError(
                    f"rule {rule.label!r}: {group_only_name(rule.transform)} needs every "
                    "gradient the rule matched at once; when='backward' transforms each call's "
                    "contribution as it arrives (use when='accumulate' to clip after each "
                    "backward, when='step' to clip before each optimizer step, or clip_norm "
                    "for a per-tensor bound)"
                )
    for _, rule in pairs:
        if "optimizer" in needs(rule.transform):
            _check_optimizer_rule(rule, when, optimizer)
    params = dict(model.named_parameters())
    if when != "step" and any(is_sharded(p) for p in params.values()):
        raise ValueError(
            f"transform(): the model's parameters are sharded (FSDP2 DTensors): their "
            f"gradients are reduced across ranks after the backward, so when={when!r} never "
            "sees them; use when='step' with optimizer= (the reduced, sharded gradients, "
            "right before optimizer.step())"
        )
    matches = []
    for key, rule in pairs:
        names = [n for n, _ in select_parameters(model, key)]
        trainable = [n for n in names if params[n].requires_grad]
        if not trainable:
            raise SelectionError(
                f"rule {rule.label!r} matches only parameters that do not require grad "
                f"({', '.join(names[:5])}); they never get a gradient to transform"
            )
        matches.append(trainable)
    owner = _assign([rule for _, rule in pairs], matches, "parameter")
    if optimizer is not None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        outside = [n for n in owner if id(params[n]) not in stepped]
        if outside:
            labels = sorted({owner[n].label for n in outside})
            raise ValueError(
                f"rule(s) {', '.join(map(repr, labels))}: parameter(s) {', '.join(outside[:5])} "
                "are not in the optimizer's param_groups, so when='step' would never apply "
                "to them at the right time; narrow the rule or add them to the optimizer"
            )
    return {name: ParamTarget(owner[name], p) for name, p in params.items() if name in owner}


def _check_optimizer_rule(rule: Rule, when: WhenLiteral,
                          optimizer: torch.optim.Optimizer | None) -> None:
    """A rule that reads the optimizer's state (spam_clip) runs at when='step' with an
    Adam-like optimizer (one with ``betas``; its state is checked again at each step)."""
    if when != "step" or optimizer is None:
        raise ValueError(
            f"rule {rule.label!r}: spam_clip reads the optimizer's exp_avg_sq, so it runs "
            f"right before optimizer.step(): use when='step' with optimizer=<an Adam-like "
            f"optimizer>; got when={when!r}"
        )
    if "betas" not in optimizer.defaults:
        raise ValueError(
            f"rule {rule.label!r}: spam_clip needs an Adam-like optimizer (Adam, AdamW, NAdam, "
            f"RAdam, ...: one that keeps exp_avg_sq); got {type(optimizer).__name__}"
        )


def _plan_modules(model: nn.Module, pairs: list[tuple[Any, Rule]], on: OnLiteral) -> dict[str, Rule]:
    for _, rule in pairs:
        if is_group_only(rule.transform):
            raise ValueError(
                f"rule {rule.label!r}: {group_only_name(rule.transform)} needs every gradient "
                f"the rule matched at once; on={on!r} transforms each call's gradient as it "
                "arrives, so it cannot be used here (use clip_norm for a per-tensor bound)"
            )
        needed = needs(rule.transform) & {"param", "optimizer"}
        if needed:
            raise ValueError(
                f"rule {rule.label!r}: this transform (agc, spam_clip) reads the parameter "
                f"{'and the optimizer state ' if 'optimizer' in needed else ''}of the "
                f"gradient it changes; on={on!r} transforms activation gradients, which have "
                "none (use it on parameter gradients, on='param_grad')"
            )
    matches = [[n for n, _ in select_modules(model, key)] for key, _ in pairs]
    owner = _assign([rule for _, rule in pairs], matches, "module")
    return {n: owner[n] for n, _ in model.named_modules() if n in owner}
