"""The results of ``gt.per_sample`` from what the backwards accumulated.

Parameters whose per-sample gradients were built (``[N, *shape]``) give every quantity from
them; the others from the reduced accumulators: squared norms ``[N]``, ``sum_n g_n**2`` and
the batch gradient (for the variance), with the formulas of docs/semantics.md.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor, nn

__all__ = ["SNR_EPS", "STATS", "results"]

#: Added to the variance in ``snr``.
SNR_EPS = 1e-12

#: Quantities computed from ``sum_n g_n**2``.
STATS = frozenset({"variance", "second_moment", "snr"})


def results(params: dict[str, nn.Parameter], n: int, quantities: Collection[str],
            grad: dict[str, Tensor], norm_sq: dict[str, Tensor], sum_sq: dict[str, Tensor],
            total: dict[str, Tensor]) -> dict[str, object]:
    """``{"grad", "norm", "norms", "second_moment", "variance", "snr"}`` over ``params``.

    ``grad``: per-sample gradients ``[N, *shape]``; ``norm_sq`` ``[N]``, ``sum_sq`` (shape of
    the parameter) and ``total`` (the batch gradient times ``N`` for a mean loss) for
    parameters reduced without them. A parameter in none of them got no gradient: zeros.
    """
    want_norm = "norm" in quantities
    want_stats = bool(STATS & set(quantities))
    want_var = bool({"variance", "snr"} & set(quantities))
    grads: dict[str, Tensor] = {}
    norms: dict[str, Tensor] = {}
    second: dict[str, Tensor] = {}
    var: dict[str, Tensor] = {}
    snr: dict[str, Tensor] = {}
    for qual, p in params.items():
        g = grad.get(qual)
        if g is None and qual not in norm_sq and qual not in sum_sq:
            # Never reached by this backward: every sample's gradient is zero.
            g = p.new_zeros((n, *p.shape))
        if g is not None:
            grads[qual] = g
            if want_norm:
                norms[qual] = (g.flatten(1) if g.dim() > 1 else g.unsqueeze(1)).square().sum(1)
            if "second_moment" in quantities:
                second[qual] = g.square().mean(0)
            if want_var:
                var[qual], m = torch.var_mean(g, 0, correction=0)
                if "snr" in quantities:
                    snr[qual] = m.square() / (var[qual] + SNR_EPS)
            continue
        if want_norm:
            norms[qual] = norm_sq[qual]
        if want_stats:
            second[qual] = sm = sum_sq[qual] / n
            if want_var:
                t = total.get(qual)
                m2 = (t / n).square_() if t is not None else torch.zeros_like(sm)
                var[qual] = (sm - m2).clamp_min_(0)
                if "snr" in quantities:
                    snr[qual] = m2 / (var[qual] + SNR_EPS)
    out: dict[str, object] = {}
    if "grad" in quantities:
        out["grad"] = grads
    if want_norm:
        out["norm"] = torch.stack(list(norms.values())).sum(0).sqrt()
        out["norms"] = {k: v.sqrt() for k, v in norms.items()}
    out["second_moment"], out["variance"], out["snr"] = second, var, snr
    return out
