"""Run code on N gloo ranks on this machine, for multi-process tests (CPU only).

    from tests._dist import run_ranks

    def worker(rank, world, scale):          # a module-level function of an importable module
        import torch.distributed as dist
        t = torch.ones(1) * scale
        dist.all_reduce(t)
        return {"sum": t.item()}              # JSON-able (tensors and arrays become lists)

    results = run_ranks(worker, world=2, kwargs={"scale": 3.0})   # [rank 0's, rank 1's]

Each rank is a fresh ``python`` process (its own session, so it and anything it starts can be
killed as a group) with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR=127.0.0.1``
and a free ``MASTER_PORT``; ``OMP_NUM_THREADS=1``. For a function, the rank process
initialises the gloo process group (``init_method="env://"``), calls
``fn(rank, world, **kwargs)``, writes its return value as JSON and destroys the group. For a
script (a path), it runs the file as ``__main__`` with ``sys.argv = [path, outdir, *args]``;
the script initialises the group itself, and its module-level ``RESULT`` (if any) is its
result. Once its result is written a rank exits at once (``os._exit(0)``), skipping
interpreter teardown.

Every exit path (success, a failing rank, the hard ``timeout``, an exception or
KeyboardInterrupt in the caller) ends with no rank process left: the survivors of a failing
rank get ``grace`` seconds to exit on their own (they are usually blocked in a collective),
then their process groups are killed. A failure raises ``RankError`` with each rank's exit
status and the tail of its output. The port is re-picked if rank 0 loses it to another
process before binding.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RankError", "free_port", "gloo_available", "run_ranks", "to_json"]

_ROOT = Path(__file__).resolve().parents[1]
_SRC = _ROOT / "src"

# Run inside each rank: argv = [-c, target, outdir, kwargs_json, *script_args]
_BOOT = r"""
import json, os, runpy, sys
from importlib import import_module
sys.path[:0] = [p for p in os.environ["GT_DIST_PATH"].split(os.pathsep) if p]
from tests._dist import to_json
target, out, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if target.endswith(".py"):
    sys.argv = [target, out, *sys.argv[4:]]
    result = runpy.run_path(target, run_name="__main__").get("RESULT")
else:
    import datetime
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    mod, _, name = target.partition(":")
    fn = import_module(mod)
    for part in name.split("."):
        fn = getattr(fn, part)
    dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=float(os.environ["GT_DIST_PG_TIMEOUT"])))
    try:
        result = fn(rank, world, **kwargs)
    finally:
        dist.destroy_process_group()
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
    json.dump(to_json(result), f)
os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
# The result is written: skip interpreter teardown, where torch's C++ threads (gloo, FSDP)
# now and then abort the process ("terminate called without an active exception").
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


class RankError(AssertionError):
    """A rank failed, or the ranks ran past the timeout."""


def gloo_available() -> bool:
    """True when this torch build has ``torch.distributed`` with the gloo backend."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def to_json(obj: Any) -> Any:
    """``obj`` with tensors and numpy arrays/scalars turned into (nested) lists and floats;
    dict keys become strings; NaN and Inf stay floats (``json`` writes them)."""
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    if hasattr(obj, "detach") and hasattr(obj, "tolist"):  # torch.Tensor
        return obj.detach().cpu().tolist()
    if hasattr(obj, "tolist") and hasattr(obj, "dtype"):  # numpy array or scalar
        return obj.tolist()
    if isinstance(obj, float) or obj is None or isinstance(obj, (bool, int, str)):
        return obj
    raise TypeError(f"rank result: cannot turn a {type(obj).__name__} into JSON")


def run_ranks(
    target: Callable[..., Any] | str | os.PathLike[str],
    world: int = 2,
    *,
    kwargs: Mapping[str, Any] | None = None,
    args: Sequence[str] = (),
    timeout: float = 120.0,
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    outdir: str | os.PathLike[str] | None = None,
    path: Sequence[str | os.PathLike[str]] = (),
) -> list[Any]:
    """Run ``target`` on ``world`` gloo ranks; return each rank's result, rank order.

    Args:
        target: a module-level function ``fn(rank, world, **kwargs)`` of an importable module
            (``tests.test_x`` works) or its name ``"module:function"``, or the path of a script
            (``.py``; see the module docstring).
        world: number of ranks.
        kwargs: JSON-able keyword arguments for a function target.
        args: extra ``sys.argv`` entries for a script target (after the output folder).
        timeout: hard limit in seconds for the whole run (all ranks); past it every rank is
            killed and ``RankError`` is raised.
        grace: seconds the other ranks get to exit after one rank fails.
        env: extra environment variables for the ranks.
        outdir: folder for results and logs (default: a temporary folder, removed after).
        path: extra ``sys.path`` entries for the ranks (before the repository's).

    Raises:
        RankError: a rank exited with a non-zero status, wrote no result, or the run timed out.
    """
    if outdir is None:
        with tempfile.TemporaryDirectory(prefix="gt-dist-") as tmp:
            return run_ranks(target, world, kwargs=kwargs, args=args, timeout=timeout,
                             grace=grace, env=env, outdir=tmp, path=path)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    if callable(target):
        spec = f"{target.__module__}:{target.__qualname__}"
        if "<locals>" in spec or target.__module__ == "__main__":
            raise ValueError(f"run_ranks needs a module-level function of an importable module; "
                             f"got {spec}")
    elif isinstance(target, str) and ":" in target and not target.endswith(".py"):
        spec = target
    else:
        spec = os.fspath(Path(target).resolve())
    extra = [os.fspath(Path(p).resolve()) for p in path]
    for attempt in range(3):
        try:
            return _launch(spec, world, dict(kwargs or {}), list(args), timeout, grace,
                           dict(env or {}), out, extra)
        except _PortLost:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortLost(Exception):
    pass


def _launch(spec: str, world: int, kwargs: dict[str, Any], args: list[str], timeout: float,
            grace: float, extra_env: dict[str, str], out: Path, extra: list[str]) -> list[Any]:
    for r in range(world):
        (out / f"rank{r}.json").unlink(missing_ok=True)
    path = os.pathsep.join([*extra, str(_SRC), str(_ROOT), os.environ.get("PYTHONPATH", "")])
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
            "GT_DIST_PATH": path, "GT_DIST_PG_TIMEOUT": str(max(timeout, 1.0)),
            **extra_env}
    argv = [sys.executable, "-c", _BOOT, spec, str(out), json.dumps(kwargs), *args]
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for r in range(world):
            log = open(out / f"rank{r}.log", "wb")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            procs.append(subprocess.Popen(
                argv, env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=str(_ROOT),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if any(c not in (None, 0) for c in codes):
                deadline = min(deadline, now + grace)
            if now >= deadline:
                timed_out = not any(c not in (None, 0) for c in codes)
                break
            # Block on one live rank for a short while (no busy loop).
            live = next(p for p, c in zip(procs, codes) if c is None)
            try:
                live.wait(timeout=min(0.1, max(deadline - now, 0.01)))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            _kill_group(p)
        for log in logs:
            log.close()
    texts = [(out / f"rank{r}.log").read_text(errors="replace") for r in range(len(procs))]
    codes = [p.returncode for p in procs]
    if any(c != 0 for c in codes) and any("EADDRINUSE" in t or "address already in use"
                                          in t.lower() for t in texts):
        raise _PortLost()
    if timed_out or any(c != 0 for c in codes):
        what = f"timed out after {timeout:g} s" if timed_out else "failed"
        detail = "\n".join(f"--- rank {r} (exit {c}) ---\n{_tail(t)}"
                           for r, (c, t) in enumerate(zip(codes, texts)))
        raise RankError(f"{world} gloo ranks {what} running {spec}\n{detail}")
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        if not f.exists():
            raise RankError(f"rank {r} exited 0 but wrote no result\n{_tail(texts[r])}")
        results.append(json.loads(f.read_text()))
    return results


def _kill_group(p: subprocess.Popen[bytes]) -> None:
    """Kill ``p`` (and its process group) if it still runs; reap it."""
    if p.poll() is None:  # still running (not reaped), so its pid is still its group's id
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
    p.wait()


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]

