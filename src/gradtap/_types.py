"""Type aliases shared across gradtap, and the glossary of shape letters.

Shape letters used in docstrings and einsum strings throughout the package:

    N  batch (samples)          O  output features / channels
    I  input features / channels K  kernel positions (product of kernel sizes)
    G  groups                   S  spatial positions (product of spatial sizes)
    T  sequence positions (any leading dims between N and the feature dim, flattened)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

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
StatName = Literal["norm", "mean", "std", "absmax", "min", "max", "nonfinite", "zero_frac", "rms"]
