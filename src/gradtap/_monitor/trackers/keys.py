"""The slash-path keys under which a Monitor's values reach a tracker.

``grad/<stat>/<tensor>`` (kind ``param_grad``), ``grad_output/<stat>/<module>``,
``update/<stat>/<tensor>``, ``param/<stat>/<tensor>``, ``grad_cosine/cosine/<tensor>``,
``health/<stat>/<name>`` (``gain`` and the noise scale), ``loss``. Names are made valid in every
tracker (MLflow takes only letters, digits, ``_ - . /`` and spaces): ``"<all>"`` becomes
``all``, a ``split=`` slice ``experts.w1[3]`` becomes ``experts.w1.3``, a module's output path
``"layer1:output"`` becomes ``layer1`` (other paths ``layer1.<path>``), and any other character
``_``.

Example:
    >>> key_of("layer1.0.conv1.weight", "param_grad", "norm")
    'grad/norm/layer1.0.conv1.weight'
    >>> key_of("attn:0", "grad_output", "gain"), key_of("<loss>", "health", "value")
    ('health/gain/attn.0', 'loss')
"""

from __future__ import annotations

import re

import numpy as np

from gradtap._monitor.health import LOSS_NAME
from gradtap._monitor.options import HEALTH_STATS
from gradtap._monitor.rows import StepRows

__all__ = ["LOSS_KEY", "KeyTable", "clean", "key_of", "prefix_of"]

LOSS_KEY = "loss"
#: The first segment of a kind's keys (the kind itself where not listed).
_PREFIX = {"param_grad": "grad"}
_BAD = re.compile(r"[^\w.\- /]")
_SLICE = re.compile(r"\[(\d+)\]")


def prefix_of(kind: str, stat: str) -> str:
    """The first segment of the key of a ``(kind, stat)``."""
    return "health" if stat in HEALTH_STATS else _PREFIX.get(kind, kind)


def clean(name: str) -> str:
    """A tensor or module name as a key segment, valid in every tracker."""
    if name.startswith("<") and name.endswith(">"):
        name = name[1:-1]
    module, sep, path = name.partition(":")
    if sep:
        name = module if path == "output" else f"{module}.{path}"
    name = _SLICE.sub(r".\1", name)
    return _BAD.sub("_", name).strip("/") or "_"


def key_of(name: str, kind: str, stat: str) -> str:
    """The key of one series ``(name, kind, stat)`` of the run."""
    if name == LOSS_NAME and stat == "value":
        return LOSS_KEY
    return f"{prefix_of(kind, stat)}/{stat}/{clean(name)}"


class KeyTable:
    """The keys of a step's rows, one per value (cached per layout of the step's rows)."""

    def __init__(self) -> None:
        self._cache: dict[int, tuple[np.ndarray, list[str]]] = {}

    def keys(self, rows: StepRows) -> list[str]:
        hit = self._cache.get(id(rows.ids))
        if hit is None or hit[0] is not rows.ids:
            names, kinds, stats = rows.labels()
            hit = self._cache[id(rows.ids)] = (rows.ids, [
                key_of(n, k, s) for n, k, s in zip(names, kinds, stats)])
        return hit[1]
