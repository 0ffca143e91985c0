"""``gt.dp_sgd``: DP-SGD on the per-sample engine (:mod:`gradtap._samples`).

:class:`DPSGD` follows a model's backward with one :class:`~gradtap._samples.engine.PerSample`
over its trainable parameters, with a book (:mod:`gradtap._samples.clipped`): each
parameter's squared per-sample norms and its clipped sum ``sum_i c_i g_i`` from closed forms
where its layer has one (no ``[B, *shape]``; with ``clipping="per_layer"`` formed in the
backward), from per-sample gradients elsewhere (the layer rules, or a ``torch.func`` replay
where no rule applies); right before each
``optimizer.step()`` (a :class:`~gradtap.capture.HookSet` optimizer pre-hook), replaces every
trainable parameter's ``.grad`` with the private gradient::

    (sum_i c_i g_i + N(0, (noise_multiplier * C)^2 I)) / (sample_rate * dataset_size)

``clip`` (:func:`clip_coefficients`) gives ``c_i``; the accountant (:mod:`.accounting`)
counts the step. The sum runs over the micro-batches since the last step
(:mod:`.accumulate`), of the unscaled gradients under a loss scaler (:mod:`.amp`), and over
the ranks under DDP (:mod:`.distributed`). The exact definition is in docs/semantics.md
("Differentially private training").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from gradtap._privacy.accounting import Accountant, _check_accountant, calibrate_noise
from gradtap._privacy.accumulate import MicroBatches
from gradtap._privacy.amp import LossScale
from gradtap._privacy.checks import check_noise, check_number, check_rate
from gradtap._privacy.distributed import Ranks
from gradtap._privacy.noise import add_gaussian_noise_
from gradtap._samples.clipped import Book
from gradtap._samples.engine import PerSample
from gradtap._samples.spec import LossReduction
from gradtap.capture import HookSet, session
from gradtap.errors import UnsupportedModuleError
from gradtap.select import clean_name, unwrap_model

__all__ = ["CLIP_EPS", "DPSGD", "Clipping", "clip_coefficients", "dp_sgd"]

#: Added to a per-sample norm in the clipping coefficient ``min(1, C / (norm + CLIP_EPS))``.
CLIP_EPS = 1e-6

Clipping = Literal["flat", "per_layer"]


def clip_coefficients(sq_norms: Sequence[Tensor], max_grad_norm: float,
                      clipping: Clipping) -> list[Tensor]:
    """Each parameter's clipping coefficients ``[B]`` from its per-sample squared norms.

    ``"flat"``: one coefficient per sample, ``min(1, C / (norm + 1e-6))`` with ``norm`` over
    all the parameters together (the same tensor for every parameter). ``"per_layer"``: per
    parameter, with the bound ``C / sqrt(P)`` of ``P`` parameters, so a clipped gradient's
    total norm is at most ``C`` again.

    >>> import torch
    >>> from gradtap._privacy.dpsgd import clip_coefficients
    >>> [c] = clip_coefficients([torch.tensor([4.0, 0.25])], 1.0, "flat")  # norms 2 and 0.5
    >>> [round(v, 4) for v in c.tolist()]
    [0.5, 1.0]
    """
    if not sq_norms:
        return []
    if clipping == "flat":
        dtype = sq_norms[0].dtype
        for s in sq_norms[1:]:
            dtype = torch.promote_types(dtype, s.dtype)
        device = sq_norms[0].device
        total = torch.stack([s.to(device=device, dtype=dtype) for s in sq_norms]).sum(0)
        c = (max_grad_norm / (total.sqrt() + CLIP_EPS)).clamp_(max=1.0)
        return [c.to(device=s.device, dtype=s.dtype) for s in sq_norms]
    bound = max_grad_norm / math.sqrt(len(sq_norms))
    return [_clamped(bound, s) for s in sq_norms]


def _clamped(bound: float, sq: Tensor) -> Tensor:
    return (bound / (sq.sqrt() + CLIP_EPS)).clamp_(max=1.0)


def _batchnorm_in_training(model: nn.Module) -> str | None:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
            return f"{name or 'the model'!r} ({type(module).__name__})"
    return None


def _check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                     params: dict[str, nn.Parameter]) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"dp_sgd: optimizer must be a torch.optim.Optimizer, "
                        f"got {type(optimizer).__name__}")
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in params.items() if id(p) not in held]
    if missing:
        raise ValueError(f"dp_sgd: the optimizer does not hold the model's trainable "
                         f"parameter(s) {', '.join(map(repr, missing[:5]))}"
                         f"{' ...' if len(missing) > 5 else ''}: make it over "
                         f"[p for p in model.parameters() if p.requires_grad]")
    mine = {id(p) for p in model.parameters()}
    extra = sum(1 for group in optimizer.param_groups for p in group["params"]
                if p.requires_grad and id(p) not in mine)
    if extra:
        raise ValueError(f"dp_sgd: the optimizer holds {extra} trainable parameter(s) that are "
                         f"not the model's: they would be stepped without clipping or noise")


def _engine(model: nn.Module, loss_reduction: LossReduction, book: Book,
            batch_dim: int) -> PerSample:
    # own_grad: autograd skips the batch weight gradients the private step replaces; the
    # book: the clipped sums from closed forms (per layer: formed already in backward).
    try:
        return PerSample(model, "*", loss_reduction=loss_reduction, quantities=("grad",),
                         own_grad=True, book=book, batch_dim=batch_dim)
    except ValueError as err:
        if "another open" not in str(err):
            raise
        raise ValueError(f"dp_sgd: the model is already followed by another dp_sgd (or "
                         f"per_sample) that computes its .grad: detach that one first "
                         f"({err})") from None


class DPSGD:
    """DP-SGD on a model and its optimizer; made by :func:`gradtap.dp_sgd`.

    Each ``optimizer.step()`` first turns the per-sample gradients of the batch's backward
    into the private gradient (see :func:`gradtap.dp_sgd`) and counts a step. Attributes:
    ``noise_multiplier`` (given or calibrated), ``max_grad_norm``, ``sample_rate``,
    ``dataset_size``, ``clipping``, ``steps`` (taken so far), ``accountant`` (an
    :class:`~gradtap._privacy.accounting.Accountant`). ``detach()`` (or leaving the ``with``
    block) removes every hook; the optimizer then steps on ``.grad`` as usual.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                 max_grad_norm: float, sample_rate: float, dataset_size: int,
                 noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 target_delta: float | None = None, steps: int | None = None,
                 accountant: str = "prv", clipping: Clipping = "flat",
                 loss_reduction: LossReduction = "mean",
                 generator: torch.Generator | None = None,
                 scaler: torch.amp.GradScaler | None = None, batch_dim: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"dp_sgd: model must be an nn.Module, got {type(model).__name__}")
        self.max_grad_norm = check_number("max_grad_norm", max_grad_norm, 0.0, math.inf,
                                          low_open=True, high_open=True,
                                          meaning="the clipping bound C of each sample's gradient")
        self.sample_rate = check_rate(sample_rate)
        if isinstance(dataset_size, bool) or not isinstance(dataset_size, int) \
                or dataset_size < 1:
            raise ValueError(f"dp_sgd: dataset_size (the number of examples N) must be an int "
                             f">= 1, got {dataset_size!r}")
        self.dataset_size = dataset_size
        if clipping not in ("flat", "per_layer"):
            raise ValueError(f"dp_sgd: clipping must be 'flat' or 'per_layer', got {clipping!r}")
        self.clipping: Clipping = clipping
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"dp_sgd: generator must be a torch.Generator or None, "
                            f"got {type(generator).__name__}")
        self.generator = generator
        _check_accountant(accountant)
        self.noise_multiplier = self._noise(noise_multiplier, target_epsilon, target_delta,
                                            steps, accountant)
        self.accountant = Accountant(self.noise_multiplier, self.sample_rate, accountant)
        where = _batchnorm_in_training(model)
        if where is not None:
            raise UnsupportedModuleError(
                f"dp_sgd: module {where} is in training mode: batch statistics mix the "
                f"samples, so no sample's gradient is its own; replace it with GroupNorm or "
                f"LayerNorm (or put it in eval mode)")
        params = {clean_name(name): p for name, p in unwrap_model(model).named_parameters()
                  if p.requires_grad}
        if not params:
            raise ValueError("dp_sgd: the model has no trainable parameter")
        _check_optimizer(model, optimizer, params)
        self.optimizer = optimizer
        self._hooks = HookSet()
        try:
            self._install(model, scaler)
            bound = self.max_grad_norm / math.sqrt(len(params))
            book = Book(None if clipping == "flat" else
                        lambda _q, sq: self._layer_coefficients(bound, sq))
            self._ps = _engine(model, loss_reduction, book, batch_dim)
        except BaseException:
            self.detach()
            raise
        self._params = {name: params[name] for name in self._ps.names}

    def _install(self, model: nn.Module, scaler: torch.amp.GradScaler | None) -> None:
        """The hooks of the micro-batches, the loss scale and the ranks (subscribed before
        the engine's, so a micro-batch is folded before the engine sees the next one)."""
        s = session(model, "dp_sgd()").attach()
        self._hooks.add_cleanup(s.detach)
        self._ranks = Ranks(self._hooks, model)
        self._scale = LossScale(self._hooks, s, self.optimizer, scaler, self._skipped,
                                self._ranks.agree_on_overflow)
        self._micro = MicroBatches(self._hooks, s.root, self._clipped_sum,
                                   lambda: self._ps.clear())
        self._hooks.optimizer_step_pre(self.optimizer, self._before_step)

    def _noise(self, noise_multiplier: float | None, target_epsilon: float | None,
               target_delta: float | None, steps: int | None, accountant: str) -> float:
        targets = {"target_epsilon": target_epsilon, "target_delta": target_delta,
                   "steps": steps}
        if noise_multiplier is not None:
            given = [k for k, v in targets.items() if v is not None]
            if given:
                raise ValueError(f"dp_sgd: give either noise_multiplier or target_epsilon, "
                                 f"target_delta and steps, not both (got noise_multiplier "
                                 f"and {', '.join(given)})")
            return check_noise(noise_multiplier)
        absent = [k for k, v in targets.items() if v is None]
        if len(absent) == len(targets):
            raise ValueError("dp_sgd: no noise: give noise_multiplier, or target_epsilon, "
                             "target_delta and steps to calibrate it")
        if absent:
            raise ValueError(f"dp_sgd: calibrating the noise needs target_epsilon, "
                             f"target_delta and steps; missing {', '.join(absent)}")
        return calibrate_noise(target_epsilon, target_delta, self.sample_rate,  # type: ignore[arg-type]
                               steps, accountant=accountant)  # type: ignore[arg-type]

    def _clipped_sum(self) -> list[Tensor] | None:
        """``sum_i c_i g_i`` of each trainable parameter over the samples of the engine's
        backward(s) (one micro-batch), of the unscaled gradients; ``None`` without samples.
        The engine gives the squared per-sample norms, then the sums for the coefficients
        (from closed forms where the layer has one)."""
        if not self._ps.batch_size:  # an empty batch, or no backward
            return None
        clipped = self._ps.clipped
        sq = clipped.norm_sq()
        scale = self._scale.scale()
        norms = list(sq.values())
        if scale is not None:  # the gradients of scale * loss
            norms = [s / scale.to(s.device, s.dtype).square() for s in norms]
        coefs = clip_coefficients(norms, self.max_grad_norm, self.clipping)
        if scale is not None:
            coefs = [c / scale.to(c.device, c.dtype) for c in coefs]
        weighted = clipped.weighted(dict(zip(sq, coefs, strict=True)))
        return [weighted[name] for name in self._params]

    def _layer_coefficients(self, bound: float, sq: Tensor) -> Tensor:
        """Per-layer clipping inside backward: one parameter's coefficients from its squared
        per-sample norms, of the unscaled gradients."""
        scale = self._scale.scale()
        if scale is None:
            return _clamped(bound, sq)
        s = scale.to(sq.device, sq.dtype)
        return _clamped(bound, sq / s.square()) / s

    def _private_grads(self) -> list[Tensor]:
        """The private gradient of each trainable parameter (``.grad`` of the next step), from
        the clipped sums of the micro-batches since the last step, summed over the ranks;
        draws the noise (once for the job)."""
        params = list(self._params.values())
        sums = self._micro.take(params)  # zeros for a step of noise only
        if self.noise_multiplier > 0 and self._ranks.draws_noise:
            # one parameter's draw at a time: no second copy of the model's gradients
            add_gaussian_noise_(sums, self.noise_multiplier * self.max_grad_norm,
                                self.generator)
        self._ranks.sum(sums)
        torch._foreach_div_(sums, self.sample_rate * self.dataset_size)
        return [s.to(dtype=p.dtype) for s, p in zip(sums, params, strict=True)]

    def _before_step(self, _optimizer: Any, _args: Any, _kwargs: Any) -> None:
        grads = self._private_grads()
        with torch.no_grad():
            for p, g in zip(self._params.values(), grads, strict=True):
                p.grad = g
        self.accountant.step()
        self._scale.stepped = True

    def _skipped(self) -> None:
        """The scaler skipped the step (inf/NaN): the logical batch is dropped, no noise is
        drawn, and the step is counted (see :mod:`.amp`)."""
        self._micro.discard()
        self.accountant.step()

    @property
    def steps(self) -> int:
        """The steps taken so far (empty batches and steps the loss scaler skipped included)."""
        return self.accountant.steps

    def epsilon(self, delta: float) -> float:
        """The privacy spent so far: epsilon at ``delta`` of the steps taken."""
        return self.accountant.epsilon(delta)

    def state_dict(self) -> dict[str, Any]:
        """The accountant's count, for a checkpoint."""
        return self.accountant.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state)

    def detach(self) -> None:
        """Remove every hook (safe to call twice); the accountant stays readable."""
        self._hooks.remove()
        ps = getattr(self, "_ps", None)
        if ps is not None:
            ps.remove()

    def __enter__(self) -> DPSGD:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def __repr__(self) -> str:
        return (f"<DPSGD {len(self._params)} parameters, noise_multiplier="
                f"{self.noise_multiplier:g}, max_grad_norm={self.max_grad_norm:g}, "
                f"clipping={self.clipping!r}, steps={self.steps}>")


def dp_sgd(model: nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float,
           sample_rate: float, dataset_size: int, noise_multiplier: float | None = None,
           target_epsilon: float | None = None, target_delta: float | None = None,
           steps: int | None = None, accountant: str = "prv", clipping: Clipping = "flat",
           loss_reduction: LossReduction = "mean",
           generator: torch.Generator | None = None,
           scaler: torch.amp.GradScaler | None = None, batch_dim: int = 0) -> DPSGD:
    """Train ``model`` with DP-SGD: from now on each ``optimizer.step()`` is private.

    Right before each step, every trainable parameter's ``.grad`` becomes::

        (sum_i clip(g_i) + N(0, (noise_multiplier * C)^2 I)) / (sample_rate * dataset_size)

    over the samples ``i`` of the batch of the backward(s) since the last step, with ``g_i``
    sample i's gradient of its term of the loss (as :func:`gradtap.per_sample` defines it:
    with ``loss_reduction="mean"`` the loss is a mean over the batch, whose ``1/B`` is
    undone), ``clip(g) = g * min(1, C / (norm(g) + 1e-6))`` with the norm over all trainable
    parameters together (``clipping="per_layer"``: each parameter on its own, with the bound
    ``C / sqrt(P)`` for ``P`` trainable parameters), ``C = max_grad_norm``. Frozen
    parameters take no part. A step without samples (an empty Poisson batch, or no
    backward) gets the noise alone. Draw the batches with :func:`gradtap.poisson_batches`
    at ``sample_rate``: the accounting assumes it.

    Several forward/backward passes (micro-batches of distinct samples) before one step are
    one logical batch: each sample is clipped on its own whole gradient and the clipped sums
    add up, with the noise added once at the step. Under ``DistributedDataParallel`` the
    ranks' clipped sums are summed (DDP's own averaging all-reduce is off while attached),
    rank 0 adds the noise once for the job, and every rank steps on the same gradient. With
    ``scaler=`` (a ``torch.amp.GradScaler``) the per-sample gradients are unscaled before
    clipping, and a step the scaler skips drops the batch (no noise; still counted). The
    exact meaning is in docs/semantics.md ("Differentially private training").

    Args:
        model: the model, or its ``DistributedDataParallel`` wrapper (every rank makes the
            same ``dp_sgd``); no BatchNorm in training mode.
        optimizer: an optimizer over the model's trainable parameters (all of them).
        max_grad_norm: the clipping bound ``C > 0``.
        sample_rate: each example's probability ``q`` in ``(0, 1]`` of joining a batch.
        dataset_size: the number of examples ``N``; ``q N`` divides the noisy sum.
        noise_multiplier: the noise's standard deviation over ``C``; or, instead,
        target_epsilon, target_delta, steps: the budget to spend in ``steps`` steps, from
            which the smallest noise multiplier is calibrated.
        accountant: ``"prv"`` (default), ``"pld"`` or ``"rdp"`` (``dp-accounting``).
        clipping: ``"flat"`` or ``"per_layer"``.
        loss_reduction: ``"mean"`` or ``"sum"``: how the loss reduces its per-sample terms.
        generator: the ``torch.Generator`` of the noise (torch's default when ``None``;
            under DDP only rank 0's draws).
        scaler: the ``torch.amp.GradScaler`` whose ``scaler.step(optimizer)`` steps the
            optimizer, if any.
        batch_dim: the dim of the model's inputs (and of every layer's) that indexes the
            samples, as :func:`gradtap.per_sample` takes it: ``1`` for a sequence-first
            model (``[T, B, ...]`` inputs, ``batch_first=False`` attention and recurrent
            layers).

    Returns:
        A :class:`DPSGD`: ``dp.epsilon(delta)``, ``dp.steps``, ``dp.noise_multiplier``;
        ``dp.detach()`` or a ``with`` block removes its hooks.

    Raises:
        ValueError: a bad argument (``max_grad_norm <= 0``, ``sample_rate`` outside
            ``(0, 1]``, neither a noise multiplier nor a complete target); an optimizer
            that does not hold every trainable parameter of the model.
        UnsupportedModuleError: a BatchNorm in training mode (named).
        NotImplementedError: a ``scaler`` with a fused optimizer; at
            ``scaler.step(optimizer)``, an enabled ``torch.amp.GradScaler`` not given as
            ``scaler=``.
        TypeError: a ``scaler`` that is not a ``torch.amp.GradScaler``.
        GradtapError: at a step, for parameters whose per-sample gradients neither a rule
            nor a replay could give (named).

    Example:
        >>> import torch, gradtap as gt
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> net = torch.nn.Linear(3, 2)
        >>> opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> dp = gt.dp_sgd(net, opt, max_grad_norm=1.0, sample_rate=0.1, dataset_size=50,
        ...                noise_multiplier=1.0, accountant="rdp")
        >>> x, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
        >>> torch.nn.functional.cross_entropy(net(x), y).backward()
        >>> opt.step()
        >>> dp.steps, dp.epsilon(1e-5) > 0
        (1, True)
        >>> dp.detach()
    """
    return DPSGD(model, optimizer, max_grad_norm=max_grad_norm, sample_rate=sample_rate,
                 dataset_size=dataset_size, noise_multiplier=noise_multiplier,
                 target_epsilon=target_epsilon, target_delta=target_delta, steps=steps,
                 accountant=accountant, clipping=clipping, loss_reduction=loss_reduction,
                 generator=generator, scaler=scaler, batch_dim=batch_dim)
