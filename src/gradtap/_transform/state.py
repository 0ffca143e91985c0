"""The per-tensor transform states of one handle, and their checkpoint form.

A parameter's state is made from the parameter when the handle is made. An activation slot
(``"<module>:<path>"``) gets its state at the first gradient seen there, or from a loaded
checkpoint that named it. Nothing is stored on the model.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from gradtap._transform.base import State, Transform
from gradtap._transform.plan import Plan, Rule

__all__ = ["Entry", "StateTable"]

_STATE_VERSION = 1


class Entry:
    """One transformed tensor (a parameter or an activation slot): its rule and its state.

    ``where`` names it in error messages (``"parameter '0.weight'"``,
    ``"grad_output 'enc:output'"``).
    """

    __slots__ = ("name", "where", "label", "rule", "transform", "state")

    def __init__(self, name: str, where: str, rule: Rule, state: State) -> None:
        self.name = name
        self.where = where
        self.rule = rule
        self.label = rule.label
        self.transform: Transform = rule.transform
        self.state = state


class StateTable:
    """Every :class:`Entry` of one handle, by parameter name or slot name.

    Example:
        >>> import torch, gradtap as gt
        >>> from gradtap._transform.plan import make_plan
        >>> net = torch.nn.Linear(2, 1)
        >>> table = StateTable(make_plan(net, {"weight": gt.ewma(0.9)}, None, "param_grad", None))
        >>> table.entries["weight"].state["count"]
        0
        >>> sorted(table.state_dict())
        ['on', 'plan', 'state', 'version', 'when']
    """

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self.entries: dict[str, Entry] = {}
        # Activation slots loaded from a checkpoint before a backward reached them.
        self._pending: dict[str, State] = {}
        for name, (rule, param) in plan.params.items():
            self.entries[name] = Entry(name, f"parameter {name!r}", rule, rule.transform.init(param.detach()))

    def slot(self, module: str, path: str, grad: Tensor) -> Entry | None:
        """The entry of output/input ``path`` of ``module`` (made at its first gradient), or
        None when no rule covers ``module``."""
        rule = self._plan.modules.get(module)
        if rule is None:
            return None
        name = f"{module}:{path}"
        entry = self.entries.get(name)
        if entry is None:
            pending = self._pending.pop(name, None)
            state = pending if pending is not None else rule.transform.init(grad.detach())
            entry = self.entries[name] = Entry(name, f"{self._plan.on} {name!r}", rule, state)
        return entry

    def state_dict(self) -> dict[str, Any]:
        """A deep copy of every state with what it was made for (see ``TransformHandle``)."""
        states = {name: e.state for name, e in self.entries.items()}
        states.update(self._pending)
        return {
            "version": _STATE_VERSION,
            "on": self._plan.on,
            "when": self._plan.when,
            "plan": self._plan.labels(),
            "state": copy.deepcopy(states),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Replace every state by the checkpoint's, after checking it fits this plan."""
        on = self._plan.on
        if not isinstance(state_dict, Mapping) or "state" not in state_dict or "plan" not in state_dict:
            raise ValueError("load_state_dict: expected a dict made by TransformHandle.state_dict()")
        if state_dict.get("on") != on:
            raise ValueError(f"load_state_dict: checkpoint has on={state_dict.get('on')!r}; this handle has on={on!r}")
        plan, saved_plan = self._plan.labels(), dict(state_dict["plan"])
        if saved_plan != plan:
            missing = sorted(set(plan) - set(saved_plan))
            extra = sorted(set(saved_plan) - set(plan))
            changed = sorted(n for n in set(plan) & set(saved_plan) if plan[n] != saved_plan[n])
            raise ValueError(
                "load_state_dict: the checkpoint's plan differs from this handle's: "
                f"missing {missing[:5]}, unexpected {extra[:5]}, different rule for {changed[:5]}"
            )
        states = copy.deepcopy(dict(state_dict["state"]))  # one deepcopy keeps shared tensors shared
        if on == "param_grad":
            new: dict[str, State] = {}
            for name, state in states.items():
                if name not in self.entries:
                    raise ValueError(f"load_state_dict: state for unknown parameter {name!r}")
                new[name] = _same_structure(self.entries[name].state, state, repr(name))
            absent = sorted(set(self.entries) - set(new))
            if absent:
                raise ValueError(f"load_state_dict: the checkpoint has no state for {absent[:5]}")
            for name, state in new.items():
                self.entries[name].state = state
            return
        for name in states:
            if name.split(":", 1)[0] not in self._plan.modules or ":" not in name:
                raise ValueError(f"load_state_dict: state for unknown slot {name!r}")
        self.entries.clear()
        self._pending = states


def _same_structure(expected: Any, got: Any, where: str) -> Any:
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
        return {k: _same_structure(expected[k], got[k], f"{where}[{k!r}]") for k in expected}
    if isinstance(expected, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(expected):
            what = f"{len(got)} parts" if isinstance(got, (tuple, list)) else type(got).__name__
            raise ValueError(
                f"load_state_dict: state {where} holds {what}; expected a tuple of "
                f"{len(expected)} parts (was the checkpoint made with the same rules?)"
            )
        parts = [_same_structure(e, g, f"{where}[{i}]") for i, (e, g) in enumerate(zip(expected, got, strict=True))]
        return type(expected)(parts)
    return got
