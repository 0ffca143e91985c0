"""Run a script that prints one integer per durable step, SIGKILL it mid-run, return them."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path


def printed_until_killed(script: Path, arg: Path, after: int) -> list[int]:
    """Start ``python script arg``, read the integers it prints (one a line), send SIGKILL once
    ``after`` of them came, and return every integer it printed (those still buffered in the
    pipe included). Fails if the script did not get that far within two minutes or did not
    die of the signal."""
    proc = subprocess.Popen([sys.executable, str(script), str(arg)],
                            stdout=subprocess.PIPE, text=True)
    printed: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(printed) < after and time.monotonic() < deadline:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                break
            printed.append(int(line))
        assert len(printed) >= after, f"{script.name} did not get going"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        rest = proc.stdout.read()  # type: ignore[union-attr]
        proc.stdout.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    return printed + [int(s) for s in rest.split()]
