"""``gt.per_sample``: the public verb over the per-sample engine (:mod:`gradtap._samples`)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from gradtap._samples.engine import PerSample
from gradtap._samples.spec import LossReduction, Quantity
from gradtap._types import Selector

__all__ = ["PerSample", "Quantity", "per_sample"]


def per_sample(
    model: nn.Module,
    select: Selector = "*",
    *,
    loss_reduction: LossReduction = "mean",
    batch_dim: int = 0,
    quantities: Iterable[Quantity] = ("grad", "norm"),
    fallback: bool = True,
    own_grad: bool = False,
) -> PerSample:
    """Compute per-sample gradients, their norms and batch statistics during backward.

    Args:
        model: the model; its forward and backward run as usual inside the block.
        select: which parameters. A module selector (as for ``gt.tap``: a glob on module
            names, a list of globs, a module class or tuple of classes, a predicate
            ``(name, module) -> bool``) selects every parameter under the modules it picks;
            a glob also matches parameter names (``"fc.weight"``, ``"*.bias"``). ``"*"`` is
            every parameter. Parameters that do not require grad are skipped.
        loss_reduction: ``"mean"`` if the loss is ``(1/N) sum_n s_n``, ``"sum"`` if it is
            ``sum_n s_n``. Either way ``ps.grad[p].mean(0)`` (or ``.sum(0)``) equals ``p.grad``.
        batch_dim: the dim of every input tensor that indexes samples. An input whose size
            there is 1 while the batch has more samples, or that has fewer dims, is shared
            by all samples (position ids ``[1, T]``, a broadcast mask). The batch size is the
            size most of the model's tensor arguments have there.
        quantities: any of ``"grad"`` (``ps.grad``), ``"norm"`` (``ps.norm``, ``ps.norms``),
            ``"variance"``, ``"second_moment"``, ``"snr"``. Without ``"grad"``,
            ``[N, *shape]`` is not built where a closed form exists.
        fallback: replay calls under ``torch.func`` where no rule applies: a module without
            a rule (its own call), and parameters whose module's call cannot be split into
            samples (a shared input, samples folded with other rows, one call per sample,
            an output gradient that cannot be trusted, a use outside the module, per-sample
            gradients that do not add up to ``.grad``), which get theirs from the innermost
            enclosing call that can be replayed, with a warning naming the module. ``False``
            raises ``UnsupportedModuleError`` for modules without a rule, and makes the
            results name the other parameters in a ``GradtapError`` instead.
        own_grad: compute ``.grad`` here instead of in autograd, for the selected parameters
            whose every holding module has a rule. Their modules' calls that have one row
            per sample and an argument that requires grad use them detached (so autograd
            skips their batch weight gradients; ``MultiheadAttention`` then runs a forward of
            its own that reads its projections' gradients instead of replaying its core), and
            at the end of each backward the sum of those calls' per-sample gradients (times
            ``1/N`` for ``"mean"``) is added to ``.grad``, or set where it is ``None``. Other
            uses keep autograd's path and add to the same ``.grad``. Tensor hooks and
            post-accumulate-grad hooks of those parameters see only autograd's part; the
            added part carries no graph under ``create_graph=True`` (docs/semantics.md).

    Returns:
        A :class:`PerSample`, to use as a context manager; read its results after backward.

    Raises:
        SelectionError: ``select`` matches no parameter that requires grad.
        UnsupportedModuleError: a module couples its samples (BatchNorm in training mode),
            or has no rule and ``fallback=False``; in backward, a replay that draws random
            numbers (dropout in training mode).
        ValueError: a bad argument; a module is shared with an open ``per_sample`` of the
            other kind (one with ``own_grad=True``, one without: the latter would see the
            owned calls' parameters detached), or its calls are owned by another open one.
        GradtapError: when results are read, for parameters that no rule and no replay could
            give per-sample gradients (the message names each one, its module and why); with
            ``own_grad``, from backward, when an owned call's share of ``.grad`` could not be
            computed.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        >>> x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> with gt.per_sample(net, quantities=("grad", "norm", "variance")) as ps:
        ...     torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> ps.grad["0.weight"].shape, ps.norm.shape
        (torch.Size([5, 4, 3]), torch.Size([5]))
        >>> torch.allclose(ps.grad["0.weight"].mean(0), net[0].weight.grad, atol=1e-6)
        True
        >>> expected = net[2].weight.grad.clone()
        >>> net.zero_grad()
        >>> with gt.per_sample(net, own_grad=True) as ps:   # .grad from the per-sample sums
        ...     torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> torch.allclose(net[2].weight.grad, expected, atol=1e-6)
        True
    """
    return PerSample(model, select, loss_reduction=loss_reduction, batch_dim=batch_dim,
                     quantities=quantities, fallback=fallback, own_grad=own_grad)
