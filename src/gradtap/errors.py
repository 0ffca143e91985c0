"""Exceptions raised by gradtap.

Every gradtap error derives from :class:`GradtapError` and also from the builtin exception a
generic handler would expect (``ValueError`` for bad values, ``TypeError`` for unsupported
types), so ``except ValueError`` keeps working around gradtap calls.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "GradientAnomaly",
    "GradtapError",
    "SelectionError",
    "StoreError",
    "UnsupportedModuleError",
]


class GradtapError(Exception):
    """Base class of every error gradtap raises."""


class SelectionError(GradtapError, ValueError):
    """A selector matched nothing, or is not a valid selector."""


class UnsupportedModuleError(GradtapError, TypeError):
    """A module type has no rule for the requested capability."""


class StoreError(GradtapError, ValueError):
    """A run store is missing, corrupt or of an unknown schema version."""


class GradientAnomaly(GradtapError, FloatingPointError):
    """A NaN, Inf or gradient spike was found; ``.anomaly`` carries the details."""

    def __init__(self, message: str, anomaly: Any = None) -> None:
        super().__init__(message)
        self.anomaly = anomaly


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message names the extra that installs it.

    Internal (not in ``__all__``): raised through :func:`missing_extra`, and what the command
    line reports in one line instead of a traceback. Catch ``ImportError``.
    """


def missing_extra(what: str, package: str, extra: str) -> MissingExtraError:
    """The error for ``what`` needing ``package`` from gradtap's optional ``extra``, with the
    install command for a package install and for a clone (pinned by ``constraints.txt``)."""
    return MissingExtraError(
        f'{what} needs {package}, an optional dependency of gradtap: pip install "gradtap[{extra}]" '
        f'(from a clone: pip install -c constraints.txt ".[{extra}]")', name=package)
