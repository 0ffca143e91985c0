"""The metadata a Monitor records with its run: versions, configuration, selection, model."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from gradtap._types import Selector
from gradtap._version import __version__
from gradtap.errors import StoreError

__all__ = ["RESERVED", "run_meta"]

#: Keys a store sets itself; ``meta=`` may not set them.
RESERVED = ("status", "schema_version")


def run_meta(
    model: nn.Module,
    *,
    select: Selector,
    config: dict[str, Any],
    parameters: Sequence[str],
    modules: Sequence[str],
    world_size: int,
    edges: list[float] | None,
    extra: dict[str, Any] | None,
    check: bool = True,
) -> dict[str, Any]:
    """The run metadata: ``start_time``, versions, ``world_size``, ``config`` (``select`` as
    given when it is a glob or a list of globs, else its repr, then ``config``), ``selected``
    (``parameters`` and ``modules``), ``model``, ``histogram`` (bin ``edges``) and the
    ``extra`` keys.

    Raises:
        ValueError: ``extra`` sets a reserved key (only with ``check``; otherwise such keys
            are left out).
        StoreError: ``extra`` is not JSON-serialisable (only with ``check``).
    """
    params = list(model.named_parameters())
    meta: dict[str, Any] = {
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime()),
        "gradtap_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "world_size": world_size,
        "config": {
            "select": select if isinstance(select, str) or (
                isinstance(select, (list, tuple)) and all(isinstance(s, str) for s in select)
            ) else repr(select),
            **config,
        },
        "selected": {"parameters": list(parameters), "modules": list(modules)},
        "model": {
            "class": type(model).__name__,
            "num_parameters": sum(p.numel() for _, p in params),
            "trainable_parameters": sum(p.numel() for _, p in params if p.requires_grad),
            "parameters": [[n, list(p.shape), str(p.dtype).replace("torch.", ""),
                            p.requires_grad] for n, p in params],
            "repr": repr(model)[:20000],
        },
    }
    if edges is not None:
        meta["histogram"] = {"edges": edges}
    if extra:
        clash = sorted(set(extra) & set(meta) | set(extra) & set(RESERVED))
        if clash and check:
            raise ValueError(f"meta= may not set reserved keys {clash}")
        if check:
            try:
                json.dumps(extra)
            except TypeError as err:
                raise StoreError(f"meta= must be JSON-serialisable: {err}") from err
        meta.update({k: v for k, v in extra.items() if k not in clash})
    return meta
