"""``gradtap watch``'s side of the run: start the command with the watch's start-up code on
``PYTHONPATH``, wait for it, write the reports, and exit as the command did."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from gradtap._watch import site
from gradtap.store import DB_NAME, open_run, set_run_meta

__all__ = ["WatchOptions", "run_watched", "run_dirs", "summary"]


@dataclass
class WatchOptions:
    """What ``gradtap watch`` was asked for (see ``gradtap watch --help``)."""

    out: str
    select: str = "*"
    stats: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=lambda: ["param_grad"])
    every: int = 1
    detect: bool = False
    report: bool = False
    gns_from: str | None = None
    batch_size: int | None = None
    log_to: list[str] = field(default_factory=list)


def run_dirs(out: str | os.PathLike[str]) -> list[Path]:
    """The run stores a watch wrote under ``out``: ``out`` itself (the first optimizer) and
    ``out/optimizer-<k>`` (the others), those that exist."""
    root = Path(out)
    found = [root] if (root / DB_NAME).exists() else []
    extra = [p for p in root.glob("optimizer-*") if (p / DB_NAME).exists()]
    return found + sorted(extra, key=lambda p: int(p.name.rsplit("-", 1)[1]))


def summary(run_dir: Path, detect: bool) -> str:
    """What ``gradtap watch`` says of one run it wrote, at the end: where it went, its steps
    and, with ``--detect``, how many anomalies it found and the first one's module.

    Example:
        >>> import tempfile, torch, gradtap as gt
        >>> d = Path(tempfile.mkdtemp()) / "run"
        >>> with gt.Monitor(torch.nn.Linear(2, 1), store=d):
        ...     pass
        >>> summary(d, detect=True).replace(str(d), "DIR")
        'run stored in DIR (0 steps); --detect found no anomaly'
    """
    from gradtap.report.data import read_anomalies

    try:
        steps = len(open_run(run_dir).steps)
        text = f"run stored in {run_dir} ({steps} step{'' if steps == 1 else 's'})"
    except Exception as exc:  # cut short: still say where it is
        return f"run stored in {run_dir} (unreadable: {exc})"
    if not detect:
        return text
    try:
        found, _ = read_anomalies(run_dir)
    except Exception as exc:
        return f"{text}; --detect's anomalies are unreadable ({exc})"
    if not found:
        return f"{text}; --detect found no anomaly"
    first = found[0]
    module = first.get("module_name")
    where = "the model itself" if module == "" else repr(module)
    return (f"{text}; --detect found {len(found)} anomal{'y' if len(found) == 1 else 'ies'}, "
            f"the first at step {first.get('step')} in {where} ({first.get('kind')}); "
            f"see {run_dir / 'anomalies.json'}")


def run_watched(command: Sequence[str], options: WatchOptions) -> int:
    """Run ``command`` under the watch and return its exit code (128 + N after signal N).

    The command inherits stdin, stdout and stderr; ``SIGINT`` reaches it from the terminal
    as usual (the watch ignores it meanwhile), ``SIGTERM`` and ``SIGHUP`` sent to the watch
    are passed on. With ``options.report`` each run store written gets its ``report.html``
    once the command has ended, however it ended.

    Raises:
        FileNotFoundError: the command's program does not exist.
    """
    config = {"out": os.path.abspath(options.out), "select": options.select,
              "stats": list(options.stats), "kinds": list(options.kinds),
              "every": options.every, "detect": options.detect, "gns_from": options.gns_from,
              "batch_size": options.batch_size, "log_to": list(options.log_to)}
    folder = tempfile.mkdtemp(prefix="gradtap-watch-")
    try:
        shutil.copyfile(site.__file__, os.path.join(folder, "sitecustomize.py"))
        env = dict(os.environ)
        old = env.get("PYTHONPATH")
        env["PYTHONPATH"] = folder if not old else folder + os.pathsep + old
        env[site.CONFIG_ENV] = json.dumps(config)
        env.pop(site.MAIN_ENV, None)
        code = _run(list(command), env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _finish(options, code)
    return code


def _run(command: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(command, env=env)

    def forward(signum: int, frame: FrameType | None) -> None:
        proc.send_signal(signum)

    previous: dict[int, Any] = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None:
            previous[sig] = signal.signal(sig, forward)
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code


def _finish(options: WatchOptions, code: int) -> None:
    dirs = run_dirs(options.out)
    if not dirs:
        print(f"gradtap watch: no optimizer step was watched; nothing written to {options.out}",
              file=sys.stderr)
        return
    for d in dirs:
        # How the command ended: a nonzero exit (sys.exit(1), a signal) is a failed run, and a
        # run a killed process never closed is no longer running.
        try:
            ended: dict[str, Any] = {"exit_code": code}
            if code != 0 or open_run(d).meta.get("status") == "running":
                ended["status"] = "failed"
            set_run_meta(d, **ended)
        except Exception as exc:
            print(f"gradtap watch: cannot record the exit code in {d} ({exc})", file=sys.stderr)
        print(f"gradtap watch: {summary(d, options.detect)}", file=sys.stderr)
    if not options.report:
        return
    from gradtap.report import write_report

    for d in dirs:
        try:
            path = write_report(d)
        except Exception as exc:  # the run may be empty or cut short
            print(f"gradtap watch: no report for {d} ({exc})", file=sys.stderr)
        else:
            print(f"gradtap watch: report {path}", file=sys.stderr)
