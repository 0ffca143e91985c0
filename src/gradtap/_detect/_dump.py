"""Dump files: one per anomaly, plain data only, so ``torch.load(weights_only=True)`` reads them.

A dump is a dict of tensors, strings, numbers, ``None`` and lists/dicts of them::

    {"format": "gradtap.detect.dump", "version": 1, "torch": "2.x",
     "report": str,                       # the anomaly's message
     "anomaly": {...},                    # Anomaly.to_dict()
     "record": {"module_name", "module_type", "call", "notes",
                "grad_inputs", "grad_outputs", "param_grads", "inputs", "outputs"} | None,
     "module_state": {name: tensor}}      # the module's state_dict when it was written
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._detect._anomaly import Anomaly
from gradtap._text import format_number, format_table
from gradtap.errors import GradtapError
from gradtap.record import GradRecord

__all__ = ["DumpError", "format_dump", "inspect_main", "load_dump", "write_dump"]

FORMAT = "gradtap.detect.dump"
VERSION = 1


class DumpError(GradtapError, ValueError):
    """A file is not a gradtap dump, or holds objects that safe loading refuses."""


def write_dump(dump_dir: str, anomaly: Anomaly, index: int, module: nn.Module | None,
               kept: dict[str, dict[str, Tensor]] | None) -> Anomaly:
    """Write ``anomaly``'s dump into ``dump_dir``; return it with ``dump_path`` and the
    path appended to its message."""
    name = {"": "model", "<loss>": "loss"}.get(anomaly.module_name, anomaly.module_name)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
    path = os.path.join(dump_dir, f"step{anomaly.step:06d}_{index:03d}_{anomaly.kind}_"
                                  f"{anomaly.where}_{safe}.pt")
    anomaly = replace(anomaly, dump_path=path,
                      message=f"{anomaly.message}\ndump: {path} (gradtap inspect {path})")
    rec = anomaly.record
    record = None if rec is None else _record_dict(rec)
    if record is not None and kept is not None:
        for part in ("inputs", "outputs"):
            if not record[part]:
                record[part] = _tensors(kept[part])
    elif record is None and kept is not None:
        record = {"module_name": anomaly.module_name, "module_type": anomaly.module_type,
                  "call": anomaly.call, "notes": ["forward only: its backward was not checked"],
                  "grad_inputs": {}, "grad_outputs": {}, "param_grads": {},
                  "inputs": _tensors(kept["inputs"]), "outputs": _tensors(kept["outputs"])}
    state = {} if module is None else _tensors(module.state_dict(keep_vars=False))
    payload = {"format": FORMAT, "version": VERSION, "torch": str(torch.__version__),
               "report": anomaly.message, "anomaly": _plain(anomaly.to_dict()),
               "record": record, "module_state": state}
    torch.save(payload, path)
    return anomaly


def load_dump(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load a dump written by ``gt.detect(..., dump_dir=...)``, safely (``weights_only=True``).

    Only tensors, strings, numbers and lists/dicts of them are loaded; a file holding any other
    pickled object is refused, so a dump from an untrusted source cannot run code.

    Args:
        path: the dump file (``Anomaly.dump_path``).

    Returns:
        The dump dict: ``report`` (str), ``anomaly`` (dict), ``record`` (dict of slot dicts
        of tensors: ``grad_inputs``, ``grad_outputs``, ``param_grads``, ``inputs``,
        ``outputs``; or ``None``) and ``module_state`` (dict of tensors).

    Raises:
        FileNotFoundError: no such file.
        DumpError: the file holds objects other than plain data, or is not a gradtap dump.

    Example:
        >>> import tempfile, torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with gt.detect(net, action="record", dump_dir=d) as det:
        ...         net(torch.tensor([[1.0, float("inf")]])).sum().backward()
        ...     dump = gt.load_dump(det.anomalies[0].dump_path)
        >>> dump["anomaly"]["module_name"], dump["anomaly"]["slot"], sorted(dump["record"])[:3]
        ('0', 'input', ['call', 'grad_inputs', 'grad_outputs'])
    """
    path = os.fspath(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        text = " ".join(str(err).split())
        at = text.find("WeightsUnpickler error")
        why = text[at:] if at >= 0 else text
        why = why.split(" Check the documentation")[0].split(" Please use")[0]
        if "Unsupported global" in text or "Unsupported class" in text:
            raise DumpError(
                f"refusing to load {path!r}: it holds pickled objects that safe loading "
                f"(weights_only=True) does not allow, so it is not a plain gradtap dump ({why})"
            ) from err
        raise DumpError(f"{path!r} is not a readable torch file ({why})") from err
    except (RuntimeError, EOFError) as err:
        raise DumpError(f"{path!r} is not a readable torch file: {err}") from err
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DumpError(f"{path!r} is not a gradtap detect dump (no format={FORMAT!r} entry)")
    if data.get("version") != VERSION:
        raise DumpError(f"{path!r} is a gradtap dump of version {data.get('version')!r}; this "
                        f"gradtap reads version {VERSION}")
    return data


def format_dump(dump: dict[str, Any]) -> str:
    """The text ``gradtap inspect DUMP`` prints: the report and every tensor the dump holds."""
    lines = [dump["report"], ""]
    rec = dump.get("record")
    if rec is not None:
        rows = []
        for part in ("grad_outputs", "grad_inputs", "param_grads", "inputs", "outputs"):
            for key, t in rec[part].items():
                rows.append([part, repr(key), *_summary(t)])
        lines.append(f"record of {rec['module_name']!r} ({rec['module_type']}, "
                     f"call {rec['call']}):")
        header = ["slot", "key", "shape", "dtype", "norm", "NaN", "Inf"]
        lines += ["  " + line for line in format_table(header, rows)] if rows else ["  (empty)"]
        lines += [f"  note: {n}" for n in rec.get("notes", [])]
    state = dump.get("module_state") or {}
    if state:
        lines.append(f"module state: {len(state)} tensors "
                     f"({', '.join(list(state)[:8])}{', ...' if len(state) > 8 else ''})")
    return "\n".join(lines).rstrip()


def inspect_main(path: str | os.PathLike[str]) -> str:
    """Load a dump safely and return the text ``gradtap inspect DUMP`` prints.

    Raises:
        FileNotFoundError: no such file.
        DumpError: not a plain gradtap dump.
    """
    return format_dump(load_dump(path))


def _record_dict(rec: GradRecord) -> dict[str, Any]:
    return {"module_name": rec.module_name, "module_type": rec.module_type, "call": rec.call,
            "notes": list(rec.notes), "grad_inputs": _tensors(rec.grad_inputs),
            "grad_outputs": _tensors(rec.grad_outputs), "param_grads": _tensors(rec.param_grads),
            "inputs": _tensors(rec.inputs), "outputs": _tensors(rec.outputs)}


def _tensors(slots: Any) -> dict[str, Tensor | None]:
    # A compact CPU copy: no views of larger storages, no autograd state, plain Tensor class.
    return {str(k): None if t is None else t.detach().to("cpu", copy=True).as_subclass(Tensor)
            for k, t in slots.items()}


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float)):
        return x
    return str(x)  # also turns str subclasses into plain str


def _summary(t: Tensor | None) -> list[str]:
    if t is None:
        return ["-", "-", "-", "-", "-"]
    shape = "[" + ", ".join(map(str, t.shape)) + "]"
    dtype = str(t.dtype).removeprefix("torch.")
    if not t.is_floating_point():
        return [shape, dtype, "-", "0", "0"]
    norm = float(torch.linalg.vector_norm(t.double())) if t.numel() else 0.0
    return [shape, dtype, format_number(norm),
            str(int(torch.isnan(t).sum())), str(int(torch.isinf(t).sum()))]
