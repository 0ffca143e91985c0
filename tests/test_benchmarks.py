"""Every benchmark script runs (tiny --quick sizes), so none can rot unnoticed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


def test_tap_overhead_quick(capsys):
    tables = importlib.import_module("tap_overhead").main(["--quick"]).split("\n\n")
    assert len(tables) == 2  # the default allocator, and glibc without trimming in a child
    for table in tables:
        assert "gt.tap on every module" in table and "faults" in table
        assert table.count("\n") == 4  # header, rule, three models


def test_run_all_rejects_unknown(capsys):
    with pytest.raises(SystemExit):
        importlib.import_module("run_all").main(["no_such_benchmark"])
    assert "unknown benchmark" in capsys.readouterr().err
