"""Work that several tests (and several pytest-xdist workers) share: done once per test session,
by the first worker that asks for it, under a file lock; the others wait for it and read its
folder."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock  # a dependency of torch


def once_per_session(tmp_path_factory: pytest.TempPathFactory, name: str,
                     make: Callable[[Path], None]) -> Path:
    """The folder ``name``, filled by ``make(folder)`` the first time any worker of this
    session asks for it. A ``make`` that raises leaves no result: the next test asking for it
    tries again (and fails with its own error)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder the session's workers share
    folder = root / name
    with FileLock(f"{folder}.lock"):
        if not (folder / ".done").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / ".done").touch()
    return folder
