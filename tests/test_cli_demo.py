"""``gradtap demo``, ``gradtap report`` and ``gradtap runs``: outputs, files and every error path."""

from __future__ import annotations

import io
import json
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from gradtap import cli
from gradtap.cli import main

STEPS = 24
NAN_STEP = 9


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "demo"
    return out


@pytest.fixture(scope="module")
def demo_output(demo_dir):
    """Run ``gradtap demo`` once for the module; return (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err
    try:
        code = main(["demo", "--steps", str(STEPS), "--out", str(demo_dir), "--seed", "3",
                     "--inject-nan", str(NAN_STEP)])
    finally:
        sys.stdout, sys.stderr = stdout, stderr
    return code, out.getvalue(), err.getvalue()


def test_demo_writes_run_report_and_summary(demo_output, demo_dir):
    code, out, err = demo_output
    assert code == 0, err
    report = demo_dir / "report.html"
    assert (demo_dir / "run.db").is_file() and report.is_file()
    assert f"report:    {report}" in out
    assert f"for {STEPS} steps" in out and "test accuracy" in out
    # the per-layer summary table names every parameter
    for name in ("block1.conv.weight", "block2.conv.bias", "block3.conv.weight", "fc1.weight",
                 "fc2.bias"):
        assert re.search(rf"^{re.escape(name)}\s+\S+", out, flags=re.M), name
    assert "transform: block1.conv.weight, block2.conv.weight, block3.conv.weight" in out
    # the anomaly was stored with the run and skipped, and the report shows it
    anomalies = json.loads((demo_dir / "anomalies.json").read_text())["anomalies"]
    assert anomalies and anomalies[0]["step"] == NAN_STEP
    assert f"at step {NAN_STEP}" in out and f"skipped optimizer steps: {NAN_STEP}" in out
    assert 'id="anomaly-table"' in report.read_text()
    # progress went to stderr (not a terminal here: one line per tenth)
    lines = [ln for ln in err.splitlines() if ln.startswith("step ")]
    assert lines[-1].startswith(f"step {STEPS - 1} ({STEPS}/{STEPS} done)") and "loss" in lines[-1]
    assert 5 <= len(lines) <= 12


def test_demo_replaces_its_run_directory(demo_output, demo_dir, tmp_path, capsys):
    out = tmp_path / "again"
    assert main(["demo", "--steps", "3", "--out", str(out), "--no-progress"]) == 0
    assert main(["demo", "--steps", "4", "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["runs", str(out)]) == 0
    table = capsys.readouterr().out
    assert re.search(rf"{re.escape(str(out))}\s+4\s+3\s+\S+\s+finished", table), table
    # no stale anomalies from another run: this one planted none
    assert json.loads((out / "anomalies.json").read_text())["anomalies"] == []


def test_demo_argument_errors(capsys, tmp_path):
    assert main(["demo", "--steps", "5", "--inject-nan", "5", "--out", str(tmp_path / "x")]) == 2
    assert "--inject-nan must be a step in [0, 5); got 5" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--steps", "0"])
    assert exc.value.code == 2
    assert "expected a positive integer" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["demo", "--steps", "2", "--out", str(tmp_path / "file"), "--no-progress"]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_demo_spike_option(tmp_path, capsys):
    pytest.importorskip("gradtap._detect", reason="spikes are found by gradtap.detect")
    assert main(["demo", "--steps", "2", "--spike", "-1", "--out", str(tmp_path / "s"),
                 "--no-progress"]) == 2
    assert "spike must be None, True" in capsys.readouterr().err
    assert main(["demo", "--steps", "12", "--spike", "10", "--out", str(tmp_path / "s"),
                 "--no-progress"]) == 0
    assert "anomalies: none" in capsys.readouterr().out


# -- report ----------------------------------------------------------------------------------


def test_report_default_and_explicit_output(demo_output, demo_dir, tmp_path, capsys):
    target = tmp_path / "sub" / "r.html"
    assert main(["report", str(demo_dir), "-o", str(target), "--hist", "fc*.weight"]) == 0
    assert capsys.readouterr().out.strip() == str(target)
    page = target.read_text()
    assert page.count('data-kind="ridgelines"') == 2
    copy = tmp_path / "copy"
    shutil.copytree(demo_dir, copy)
    (copy / "report.html").unlink()
    assert main(["report", str(copy)]) == 0
    assert capsys.readouterr().out.strip() == str(copy / "report.html")
    assert (copy / "report.html").is_file()


def _report_error(capsys, *argv: str) -> str:
    code = main(["report", *argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("gradtap report: error: ")
    return err


def test_report_errors(demo_output, demo_dir, tmp_path, capsys):
    err = _report_error(capsys, str(tmp_path / "missing"))
    assert "no run store at" in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    assert "holds no run.db" in _report_error(capsys, str(tmp_path / "empty"))

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "run.db").write_bytes(b"this is not sqlite" * 200)
    assert "is not a readable SQLite database" in _report_error(capsys, str(garbage))

    other = tmp_path / "other"
    other.mkdir()
    with sqlite3.connect(other / "run.db") as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    assert "not a gradtap run store" in _report_error(capsys, str(other))

    truncated = tmp_path / "truncated"
    shutil.copytree(demo_dir, truncated)
    db = truncated / "run.db"
    data = db.read_bytes()
    db.write_bytes(data[: len(data) // 3])
    err = _report_error(capsys, str(truncated))
    assert "run.db" in err and ("malformed" in err or "damaged" in err)

    bad_side = tmp_path / "bad_side"
    shutil.copytree(demo_dir, bad_side)
    (bad_side / "anomalies.json").write_text("{oops")
    assert "anomalies.json" in _report_error(capsys, str(bad_side))

    assert "matches no tensor with histograms" in _report_error(
        capsys, str(demo_dir), "--hist", "nope*", "-o", str(tmp_path / "x.html"))
    (tmp_path / "blocker").write_text("a file, not a directory")
    assert "cannot write the report" in _report_error(
        capsys, str(demo_dir), "-o", str(tmp_path / "blocker" / "r.html"))


# -- runs ------------------------------------------------------------------------------------


def test_runs_lists_runs_and_marks_unreadable_ones(demo_output, demo_dir, tmp_path, capsys):
    root = tmp_path / "runs"
    shutil.copytree(demo_dir, root / "good")
    (root / "nested" / "bad").mkdir(parents=True)
    (root / "nested" / "bad" / "run.db").write_bytes(b"\0" * 4096)
    (root / "not-a-run").mkdir()
    assert main(["runs", str(root)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split() == ["run", "steps", "last", "step", "started", "status"]
    good = next(ln for ln in lines if "good" in ln)
    assert re.search(rf"\s{STEPS}\s+{STEPS - 1}\s+\d{{4}}-\d\d-\d\dT\S+\s+finished$", good), good
    bad = next(ln for ln in lines if "bad" in ln)
    assert bad.split()[1:] == ["-", "-", "-", "unreadable"]
    assert "nested/bad" in captured.err and "run.db" in captured.err
    assert not any("not-a-run" in ln for ln in lines)

    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    assert "gradtap runs: error: no such directory" in capsys.readouterr().err
    (tmp_path / "none").mkdir()
    assert main(["runs", str(tmp_path / "none")]) == 0
    assert "no run directories" in capsys.readouterr().out


# -- help, progress, the console script -------------------------------------------------------


@pytest.mark.parametrize("command", ["demo", "report", "runs", "explain"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: gradtap {command}")
    assert len(out.splitlines()) > 4


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "report", "runs", "explain"):
        assert command in out
    assert main([]) == 2


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_on_a_terminal():
    stream = _Tty()
    bar = cli._Progress(stream)
    for step in range(5):
        bar(step, 5, 1.0 / (step + 1), 0.5)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") == 5 and text.endswith("\n")
    assert "[" + "#" * 30 + "] 5/5  step 4  loss  0.2000" in text  # steps from 0, as stored


def test_progress_lines_in_a_log_number_steps_as_the_store_does():
    stream = io.StringIO()
    bar = cli._Progress(stream)
    for step in range(20):
        bar(step, 20, 1.0, 0.5)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 0 (1/20 done)") and lines[-1].startswith("step 19 (20/20 done)")


def test_console_script_exit_code(tmp_path):
    exe = Path(sys.executable).with_name("gradtap")
    if not exe.exists():
        pytest.skip("the gradtap console script is not installed next to this Python")
    proc = subprocess.run([str(exe), "report", str(tmp_path / "missing")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "gradtap report: error: no run store at" in proc.stderr

