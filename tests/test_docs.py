"""Docstring examples of public entry points and the README's Python blocks actually run."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCTEST_MODULES = ["gradtap.select", "gradtap.capture", "gradtap.record", "gradtap.explain",
                   "gradtap.curvature", "gradtap.functional.explicit", "gradtap._monitor.monitor",
                   "gradtap._monitor.history", "gradtap.store", "gradtap._per_sample.api",
                   "gradtap.rules", "gradtap._registry", "gradtap.integrations.hf_models",
                   "gradtap._tensorops.groups", "gradtap._tensorops.host",
                   "gradtap._tensorops.norms", "gradtap._tensorops.ewma",
                   "gradtap._tensorops.histograms", "gradtap._tensorops.moments",
                   "gradtap._tensorops.finish"]


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
