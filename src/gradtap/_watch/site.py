"""Start-up code of a process run by ``gradtap watch``, copied as ``sitecustomize.py`` into a
temporary folder that ``gradtap watch`` puts first on ``PYTHONPATH``.

Python imports ``sitecustomize`` at start-up in every process whose environment carries that
``PYTHONPATH`` (the script, its DataLoader workers, its subprocesses, ``torchrun``'s ranks).
This file uses the standard library only and imports neither torch nor gradtap, so a process
that never imports torch is untouched. It

1. takes its folder back off ``sys.path`` (the script sees the ``sys.path`` it would have);
2. waits for ``torch`` to be imported (a finder on ``sys.meta_path`` that steps aside after
   the first import of ``torch``) and then starts ``gradtap._watch.child`` in that process;
3. runs the ``sitecustomize`` that Python would have found without ``gradtap watch`` (the
   user's own, if any), which becomes ``sys.modules["sitecustomize"]``.

The first process to run it marks itself as the watch's main process in the environment its
children inherit (``GRADTAP_WATCH_MAIN``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

CONFIG_ENV = "GRADTAP_WATCH"
MAIN_ENV = "GRADTAP_WATCH_MAIN"


def _start_watching(config: dict[str, Any]) -> None:
    """Run once torch is imported: watch this process's optimizers; never raise."""
    try:
        from gradtap._watch.child import install

        install(config)
    except Exception as exc:  # the script must run as it would without gradtap
        if os.environ.get(MAIN_ENV) == str(os.getpid()):
            sys.stderr.write(f"gradtap watch: not watching {sys.argv[0] or 'python'} "
                             f"({type(exc).__name__}: {exc})\n")


class _Loader:
    """torch's own loader, calling :func:`_start_watching` once torch's module has run."""

    def __init__(self, loader: Any, config: dict[str, Any]) -> None:
        self._loader = loader
        self._config = config

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # torch sees its own loader, as without gradtap.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        _start_watching(self._config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _AfterTorch:
    """A ``sys.meta_path`` finder that wraps the loader of ``torch`` and then steps aside."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._config = config

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, self._config)
        return spec


def _boot() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if not p or os.path.abspath(p) != here]
    raw = os.environ.get(CONFIG_ENV)
    if raw is not None and "torch" not in sys.modules:
        os.environ.setdefault(MAIN_ENV, str(os.getpid()))
        sys.meta_path.insert(0, _AfterTorch(json.loads(raw)))
    # The sitecustomize Python would have imported: found now that this folder is off the path.
    ours = sys.modules.pop("sitecustomize", None)
    try:
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


_boot()
