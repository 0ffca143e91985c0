"""Type aliases shared across gradtap, and the glossary of shape letters.

Shape letters used in docstrings and einsum strings throughout the package:

    N  batch (samples)          O  output features / channels
    I  input features / channels K  kernel positions (product of kernel sizes)
    G  groups                   S  spatial positions (product of spatial sizes)
    T  sequence positions (any leading dims between N and the feature dim, flattened)
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias, TypeGuard, get_args

from torch import nn

#: What ``select=`` accepts: a glob on qualified module names, a list of globs, a module class
#: or tuple of classes, or a predicate ``(qualified_name, module) -> bool``.
Selector: TypeAlias = (
    str
    | Sequence[str]
    | type[nn.Module]
    | tuple[type[nn.Module], ...]
    | Callable[[str, nn.Module], bool]
)

KeepLiteral = Literal["inputs", "outputs"]
WhenLiteral = Literal["backward", "accumulate", "step"]
OnLiteral = Literal["param_grad", "grad_output", "grad_input"]
StatName = Literal["norm", "mean", "std", "absmax", "min", "max", "nonfinite", "zero_frac"]
ActionLiteral = Literal["raise", "warn", "record"]

# Each vocabulary once: the literal types above, and their values for checks and messages.
WHENS: tuple[str, ...] = get_args(WhenLiteral)
ONS: tuple[str, ...] = get_args(OnLiteral)
STAT_NAMES: tuple[str, ...] = get_args(StatName)
ACTIONS: tuple[str, ...] = get_args(ActionLiteral)


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an integer and not a ``bool`` (``True`` is an ``int`` to Python, but
    never a count or a size to gradtap): the one check behind every int-valued option.

    Example:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
