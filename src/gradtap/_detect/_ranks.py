"""What ranks tell each other of a step's anomalies under ``torch.distributed`` (DDP, FSDP2).

Once a step, each rank puts the code of its first anomaly (0: none) in its slot of
``world_size`` numbers, and one all-reduce (max) gives every rank every slot. A code is
``1 + 4 * kind + where + 12 * module``, the module numbered by its place in the model (0: not
a module), the same on every rank. Each rank then records one anomaly per other finding rank,
pointing to that rank's own report.
"""

from __future__ import annotations

import torch
from torch import nn

from gradtap._detect._anomaly import Anomaly
from gradtap._tensorops.sharded import all_ranks_max

__all__ = ["exchange"]

_KINDS = ("nan", "inf", "spike")
_WHERES = ("forward", "grad_output", "grad_input", "param_grad")
_CODES = 4 * len(_KINDS)  # kind and where of one code; its multiples number the module


def exchange(held: list[Anomaly], rank: int, world: int, step: int,
             modules: dict[str, nn.Module]) -> list[Anomaly]:
    """The anomalies of the other ranks that found one this step (``held``: this rank's), one
    per rank; every rank calls it once a step. ``modules``: the model's, by name, in order."""
    codes = torch.zeros(world, dtype=torch.float64)
    names = list(modules)
    if held:
        first = held[0]
        module = names.index(first.module_name) + 1 if first.module_name in names else 0
        codes[rank] = (1 + 4 * _KINDS.index(first.kind) + _WHERES.index(first.where)
                       + _CODES * module)
    codes = all_ranks_max(codes)
    remote = []
    for r, code in enumerate(codes.tolist()):
        if r == rank or code <= 0:
            continue
        module, rest = divmod(int(code) - 1, _CODES)
        k, w = divmod(rest, 4)
        kind, where = _KINDS[k], _WHERES[w]
        name = names[module - 1] if module else f"<rank {r}>"
        type_name = type(modules[name]).__name__ if module else ""
        found = "a NaN" if kind == "nan" else "an Inf" if kind == "inf" else "a spike"
        place = f" in {name or '(root)'!r} ({type_name})" if module else ""
        message = (f"rank {r} found {found} ({where}){place} at step {step}; its "
                   f"report is on rank {r}. This rank (rank {rank}) skips the step "
                   "too.")
        remote.append(Anomaly(name, kind, where, step, None,  # type: ignore[arg-type]
                              message, module_type=type_name, rank=r))
    return remote
