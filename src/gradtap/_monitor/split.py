"""``Monitor(split={glob: dim})``: the statistics of each slice of stacked parameters.

A parameter matched by a glob (an MoE layer's ``[E, out, in]`` expert weights) gets, beside its
own row, one row per index along ``dim``, named ``"<name>[i]"`` (``experts.w1[0]`` ...
``experts.w1[E-1]``), for kinds ``param_grad`` and ``param``. Slices are views: nothing is
copied. Under FSDP2 each rank takes the slices of its local shard: along a sharded dimension
(``fully_shard`` shards dim 0, so the experts themselves) a local slice is the whole slice
number ``offset + i`` of the global tensor, along another one it is this rank's part of slice
``i``; either way the names are the same on every rank and the step's reduction sums the parts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import Tensor, nn

from gradtap import distributed
from gradtap.errors import SelectionError
from gradtap.select import clean_name, select_parameters

__all__ = ["Splits", "check_split"]


def check_split(split: Mapping[str, int] | None, model: nn.Module,
                params: Sequence[tuple[str, nn.Parameter]]) -> dict[str, int]:
    """``{parameter name: dim}`` of the selected parameters each glob of ``split`` matches,
    with ``dim`` made non-negative.

    Raises:
        TypeError: ``split`` is not a mapping of globs to ints.
        SelectionError: a glob matches no selected parameter.
        ValueError: a dim out of range, or a parameter matched by two globs with other dims.
    """
    if not split:
        return {}
    if not isinstance(split, Mapping):
        raise TypeError(f"split= takes a dict {{glob: dim}}, e.g. {{'*.experts.*': 0}}; got "
                        f"{type(split).__name__}")
    selected = dict(params)
    out: dict[str, int] = {}
    by: dict[str, str] = {}
    for glob, dim in split.items():
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"split[{glob!r}] must be a dimension (int); got {dim!r}")
        names = [clean_name(n) for n, _ in select_parameters(model, glob)]
        names = [n for n in names if n in selected]
        if not names:
            raise SelectionError(f"split glob {glob!r} matches no parameter this Monitor selects")
        for name in names:
            ndim = len(selected[name].shape)
            if not -ndim <= dim < ndim:
                raise ValueError(f"split[{glob!r}] = {dim}: parameter {name!r} has {ndim} "
                                 f"dimension(s) (shape {list(selected[name].shape)})")
            d = dim % ndim
            if name in out and out[name] != d:
                raise ValueError(f"parameter {name!r} is split along dim {out[name]} by "
                                 f"{by[name]!r} and along dim {d} by {glob!r}")
            out[name], by[name] = d, glob
    return out


class Splits:
    """The slices of the split parameters of one step.

    Args:
        dims: ``{parameter name: dim}`` from :func:`check_split`.
        shapes: the full shape of each split parameter.
    """

    def __init__(self, dims: Mapping[str, int], shapes: Mapping[str, Sequence[int]]) -> None:
        self.dims = dict(dims)
        self.sizes = {n: int(shapes[n][d]) for n, d in self.dims.items()}

    def __bool__(self) -> bool:
        return bool(self.dims)

    def names(self, name: str) -> list[str]:
        """Every slice name of ``name`` (the same on every rank)."""
        return [f"{name}[{i}]" for i in range(self.sizes[name])]

    def whole(self, tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The slices of the split tensors among ``tensors`` (whole tensors: DDP, one process)."""
        out: dict[str, Tensor] = {}
        for name, t in tensors.items():
            dim = self.dims.get(name)
            if dim is not None:
                out.update(zip(self.names(name), t.unbind(dim)))
        return out

    def local(self, tensors: Mapping[str, Tensor], counts: Mapping[str, bool],
              full: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, bool]]:
        """Slices of local shards (FSDP2): every slice name of each split tensor of ``full``
        (DTensors) with this rank's part where it has one, and whether that part counts."""
        out: dict[str, Tensor] = {}
        flags: dict[str, bool] = {}
        for name, t in tensors.items():
            dim = self.dims.get(name)
            if dim is None:
                continue
            offset = distributed.shard_offset(full[name], dim, name)
            names = self.names(name)
            parts = dict(zip(names[offset:], t.unbind(dim)))
            for n in names:  # the same order on every rank
                part = parts.get(n)
                out[n] = t.new_zeros(0) if part is None else part
                flags[n] = part is not None and bool(counts.get(name)) and part.numel() > 0
        return out, flags
