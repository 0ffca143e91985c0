"""One start of the gloo ranks for all the distributed runs of a test file: the rank
functions run one after the other on the same ranks and process group, once per test session
(shared by the pytest workers), and each test reads its function's results.

    @pytest.fixture(scope="module")
    def ranks(tmp_path_factory):
        return ranks_once(tmp_path_factory, "consumers", 2, {"ddp": _ddp_worker, ...},
                          timeout=240)

    def test_ddp(ranks):
        out = [r["ddp"] for r in ranks]      # each rank's result of _ddp_worker, rank order

Starting the ranks (a Python that imports torch, per rank) costs seconds; the functions
themselves mostly less. Each function must leave the process group as it found it (no
pending collectives); a barrier separates them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from importlib import import_module
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_ranks
from tests._shared_run import once_per_session


def several(rank: int, world: int, calls: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Run on each rank: ``calls`` maps a key to ``[module:function spec, kwargs]``; each
    function is called as ``fn(rank, world, **kwargs)`` in turn, its result kept under its
    key."""
    import torch.distributed as dist

    out = {}
    for key, (spec, kwargs) in calls.items():
        module, _, name = spec.partition(":")
        out[key] = getattr(import_module(module), name)(rank, world, **kwargs)
        dist.barrier()
    return out


def ranks_once(tmp_path_factory: pytest.TempPathFactory, name: str, world: int,
               functions: Mapping[str, Callable[..., Any] | tuple[Callable[..., Any], dict]],
               *, timeout: float) -> list[dict[str, Any]]:
    """Each rank's results (rank order) of ``functions`` (a function, or a function and its
    JSON-able keyword arguments, by key) run by :func:`several` on ``world`` ranks, once per
    session under ``name``."""
    calls = {}
    for key, entry in functions.items():
        fn, kwargs = entry if isinstance(entry, tuple) else (entry, {})
        calls[key] = [f"{fn.__module__}:{fn.__qualname__}", kwargs]

    def make(folder: Path) -> None:
        results = run_ranks(several, world, kwargs={"calls": calls}, timeout=timeout)
        (folder / "results.json").write_text(json.dumps(results))

    folder = once_per_session(tmp_path_factory, f"ranks-{name}", make)
    return json.loads((folder / "results.json").read_text())
