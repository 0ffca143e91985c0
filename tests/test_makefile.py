"""The Makefile's install targets, read with ``make -n`` (what make would run, nothing run):
``make demo`` installs only the demo's needs, and ``make test`` after it still installs the
test extras."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def _dry(tmp: Path, target: str) -> str:
    out = subprocess.run(["make", "-n", target], cwd=tmp, capture_output=True, text=True,
                         check=True)
    return out.stdout


@pytest.fixture
def checkout(tmp_path):
    for name in ("Makefile", "pyproject.toml", "constraints.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


def test_make_demo_installs_only_what_the_demo_needs_and_make_test_the_rest(checkout):
    demo = _dry(checkout, "demo")
    installs = [line for line in demo.splitlines() if "pip install" in line]
    assert len(installs) == 1 and '-e ".[demo]"' in installs[0] and "torch==" in installs[0]
    assert ".[dev]" not in demo and ".[test]" not in demo
    assert "gradtap demo" in demo
    # After the demo's install (its stamp newer than the inputs), make test installs the rest.
    venv = checkout / ".venv"
    venv.mkdir()
    stamp = venv / ".installed-demo"
    stamp.touch()
    later = time.time() + 5
    os.utime(stamp, (later, later))
    assert "pip install" not in _dry(checkout, "demo")  # the demo's needs are there
    assert '-e ".[dev]"' in _dry(checkout, "test")
    # and after make test's install, make demo installs nothing more
    (venv / ".installed").touch()
    os.utime(venv / ".installed", (later, later))
    assert "pip install" not in _dry(checkout, "demo")
    assert "pip install" not in _dry(checkout, "test")
