"""Readers of the trackers' own files, for the tracker tests: each tracker's package reads its
own output back (no mock of any tracker)."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar under ``log_dir`` (tensorboard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def tensorboard_texts(log_dir: Path) -> dict[str, dict[int, str]]:
    """``{tag: {step: text}}`` of the text summaries under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    out: dict[str, dict[int, str]] = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            for e in acc.Tensors(tag):
                value = tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0]
                out.setdefault(tag, {})[e.step] = value.decode()
    return out


def wandb_history(run_file: Path, timeout: float = 20.0) -> list[dict[str, object]]:
    """The history rows of a finished wandb run's ``.wandb`` file, parsed as wandb's own
    ``Record`` protobufs from the file's record log (wandb's LevelDB-style log: a 7-byte file
    header, 32 KiB blocks, each record chunk behind a ``crc32, length, type`` header). wandb's
    service may still be writing the file when ``run.finish()`` returns: read until the run's
    ``exit`` record is there."""
    deadline = time.monotonic() + timeout
    while True:
        rows, finished = _wandb_records(Path(run_file))
        if finished or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _wandb_records(run_file: Path) -> tuple[list[dict[str, object]], bool]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    finished = False
    assert data[:4] == b":W&B", "not a wandb run file"
    block, pos, buf, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # padding to the end of the block
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            kind_of = record.WhichOneof("record_type")
            finished = finished or kind_of == "exit"
            if kind_of == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                             for i in record.history.item})
    return rows, finished
