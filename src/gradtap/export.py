"""Export a run store to TensorBoard event files (``gt.to_tensorboard``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gradtap.errors import missing_extra
from gradtap.store import Run

__all__ = ["export_tensorboard", "to_tensorboard"]


def to_tensorboard(run: Run | str | os.PathLike[str], log_dir: str | os.PathLike[str]) -> Path:
    """Write a run's statistics and histograms as TensorBoard events, through
    ``torch.utils.tensorboard``.

    Scalars are tagged ``"<kind>/<name>/<stat>"`` (TensorBoard keeps them as float32; NaN and
    Inf are written as they are), histograms ``"<kind>/<name>"`` with the run's bin edges
    (their sum and sum of squares, which TensorBoard asks for, are estimated from the bin
    centres); each value keeps its step and the wall time at which that step was stored.

    Args:
        run: a :class:`~gradtap.Run` or a run directory.
        log_dir: where to write the event file (created if missing).

    Returns:
        ``log_dir`` as a :class:`~pathlib.Path`.

    Raises:
        ImportError: tensorboard is missing (``pip install gradtap[tensorboard]``).
        StoreError: ``run`` is not a readable run store.

    Example:
        >>> import tempfile, torch, gradtap as gt
        >>> tmp = tempfile.mkdtemp()
        >>> net = torch.nn.Linear(3, 1)
        >>> with gt.Monitor(net, store=f"{tmp}/run") as mon:
        ...     net(torch.randn(4, 3)).sum().backward(); mon.step()
        >>> gt.to_tensorboard(f"{tmp}/run", f"{tmp}/tb").name
        'tb'
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise missing_extra("to_tensorboard", "tensorboard", "tensorboard") from err
    if not isinstance(run, Run):
        run = Run(run)
    log_dir = Path(log_dir)
    walls = run.wall_times()
    writer = SummaryWriter(log_dir=str(log_dir))
    try:
        for name, kind, stat in run.series_keys():
            tag = f"{kind}/{name}/{stat}"
            steps, values = run.series(name, stat, kind)  # one series in memory at a time
            for step, value in zip(steps.tolist(), values.tolist()):
                writer.add_scalar(tag, value, step, walltime=walls.get(step))
        for kind, name in run.histogram_names():
            hist = run.histogram(name, kind)
            edges = hist.bin_edges
            centers = (edges[:-1] + edges[1:]) / 2
            for step, counts in zip(hist.steps.tolist(), hist.counts):
                total = int(counts.sum())
                if total == 0:
                    continue
                nz = np.flatnonzero(counts)
                writer.add_histogram_raw(
                    f"{kind}/{name}",
                    min=float(edges[nz[0]]), max=float(edges[nz[-1] + 1]), num=total,
                    sum=float((centers * counts).sum()),
                    sum_squares=float((centers**2 * counts).sum()),
                    bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(),
                    global_step=step, walltime=walls.get(step),
                )
    finally:
        writer.close()
    return log_dir


def export_tensorboard(run_dir: str | os.PathLike[str], log_dir: str | os.PathLike[str]) -> str:
    """``gradtap export-tensorboard RUN_DIR LOG_DIR``: export and return a one-line summary."""
    run = Run(run_dir)
    out = to_tensorboard(run, log_dir)
    n_hist = len(run.histogram_names())
    return (f"wrote {len(run.steps)} steps of {len(run.names)} tensors"
            f"{f' and {n_hist} histogram series' if n_hist else ''} to {out} "
            f"(view with: tensorboard --logdir {out})")
