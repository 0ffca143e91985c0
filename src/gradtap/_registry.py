"""TypeTable: a table of rules keyed by module type, looked up through the class hierarchy.

Each capability that depends on the layer type (per-sample gradients, per-sample norms,
``explain``'s slot meanings) owns one table object. Rules are registered with a decorator on
that object; registering a type twice is an error unless ``replace=True``. Lookup starts at
``torch.nn.utils.parametrize.type_before_parametrizations(module)`` (so a parametrized
``Linear`` still finds the ``Linear`` rule), walks the class's ``__mro__`` (so subclasses and
wrappers derived from a registered class find its rule) and caches the answer per class.

Example:
    >>> from torch import nn
    >>> table = TypeTable("greeting")
    >>> @table.register(nn.Linear)
    ... def hello_linear(module):
    ...     return "hello"
    >>> table.lookup(nn.Linear(2, 3)) is hello_linear
    True
    >>> table.lookup(nn.Conv1d(1, 1, 1)) is None
    True
    >>> table.supported()
    ['Linear']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from torch import nn
from torch.nn.utils.parametrize import type_before_parametrizations

from gradtap.errors import UnsupportedModuleError

__all__ = ["TypeTable"]

R = TypeVar("R")


class TypeTable(Generic[R]):
    """Rules of one capability, keyed by module type.

    Args:
        purpose: what the rules compute, used in error messages (``"per-sample gradient"``).
    """

    def __init__(self, purpose: str) -> None:
        self.purpose = purpose
        self._rules: dict[type[nn.Module], R] = {}
        self._cache: dict[type, R | None] = {}

    def register(self, *types: type[nn.Module], replace: bool = False) -> Callable[[R], R]:
        """Return a decorator that registers its argument as the rule for ``types``.

        Args:
            *types: one or more ``nn.Module`` subclasses.
            replace: allow overriding an existing rule for one of ``types``.

        Returns:
            A decorator that registers the rule and returns it unchanged.

        Raises:
            TypeError: no type given, or one is not an ``nn.Module`` subclass.
            ValueError: a type already has a rule in this table and ``replace`` is false.
        """
        if not types:
            raise TypeError(f"{self.purpose} table: register() needs at least one module type")
        for t in types:
            if not (isinstance(t, type) and issubclass(t, nn.Module)):
                raise TypeError(
                    f"{self.purpose} table: register() takes nn.Module subclasses, got {t!r}"
                )

        def decorator(rule: R) -> R:
            if not replace:
                taken = [t for t in types if t in self._rules]
                if taken:
                    names = ", ".join(t.__name__ for t in taken)
                    raise ValueError(
                        f"{self.purpose} table: {names} already has a rule "
                        f"({_describe(self._rules[taken[0]])}); pass replace=True to override it"
                    )
            for t in types:
                self._rules[t] = rule
            self._cache.clear()
            return rule

        return decorator

    def lookup(self, module: nn.Module) -> R | None:
        """Return the rule for ``module``'s type, or ``None`` when no class in its MRO has one."""
        cls = type_before_parametrizations(module)
        try:
            return self._cache[cls]
        except KeyError:
            pass
        found = next((self._rules[c] for c in cls.__mro__ if c in self._rules), None)
        self._cache[cls] = found
        return found

    def require(self, module: nn.Module, name: str) -> R:
        """Return the rule for ``module`` or raise ``UnsupportedModuleError`` naming ``name``.

        Raises:
            UnsupportedModuleError: no rule for the module's type; the message lists the
                supported types.
        """
        rule = self.lookup(module)
        if rule is None:
            cls = type_before_parametrizations(module)
            raise UnsupportedModuleError(
                f"no {self.purpose} rule for module {name!r} of type {cls.__name__}; "
                f"supported types (and their subclasses): {', '.join(self.supported())}"
            )
        return rule

    def supported(self) -> list[str]:
        """Return the sorted names of the registered module types."""
        return sorted(t.__name__ for t in self._rules)

    def types(self) -> list[type[nn.Module]]:
        """Return the registered module types, in registration order."""
        return list(self._rules)

    def items(self) -> list[tuple[type[nn.Module], R]]:
        """Return ``(module type, rule)`` pairs, in registration order."""
        return list(self._rules.items())

    def __contains__(self, module_type: object) -> bool:
        return module_type in self._rules

    def __repr__(self) -> str:
        return f"TypeTable({self.purpose!r}, {len(self._rules)} types)"


def _describe(rule: object) -> str:
    return getattr(rule, "__qualname__", None) or repr(rule)
