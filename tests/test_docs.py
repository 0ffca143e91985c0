"""Docstring examples of public entry points and the README's Python blocks actually run."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gradtap"


def _modules_with_examples() -> list[str]:
    """Every gradtap module whose docstrings hold an example (``>>>``), found by reading the
    sources, so a new module's examples run without being listed here."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" not in path.read_text():
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(p for p in parts if p != "__init__"))
    return names


DOCTEST_MODULES = _modules_with_examples()


def test_every_public_verb_has_a_runnable_example():
    import inspect

    import gradtap

    missing = [name for name in gradtap.__all__
               if (inspect.isfunction(getattr(gradtap, name))
                   and ">>>" not in (inspect.getdoc(getattr(gradtap, name)) or ""))]
    assert not missing, f"public functions without a docstring example: {missing}"


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


def test_readme_python_blocks_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})  # noqa: S102 - our own README


def test_health_page_python_blocks_run():
    text = (ROOT / "docs" / "health.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "docs/health.md", "exec"), {})  # noqa: S102 - our own docs


def test_critical_batch_size_example_agrees_with_its_oracle():
    """The worked example of docs/health.md, in its quick form: the noise scale from samples
    equals the one from torch.func's per-sample gradients, and micro-batches equal ranks (the
    same halves of each batch, one process or two DDP ranks)."""
    import sys

    from tests._dist import gloo_available

    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not in this torch build")
    sys.path.insert(0, str(ROOT / "examples"))  # also for the ranks it spawns
    try:
        got = list(importlib.import_module("critical_batch_size").main(["--quick"]).values())
    finally:
        sys.path.remove(str(ROOT / "examples"))
    # float32 gradients; |G|^2 is a difference of nearly equal numbers (B_simple >> B)
    assert got[0] == pytest.approx(got[3], rel=1e-4)
    assert got[1] == pytest.approx(got[2], rel=1e-4)
