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
