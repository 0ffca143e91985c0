"""``gradtap.transform``: apply per-layer gradient transforms to a model.

The handle composes three parts: the :class:`~gradtap._transform.plan.Plan` (which rule
applies to which parameter or module, resolved once, first match wins), the
:class:`~gradtap._transform.state.StateTable` (one state per parameter, or per module
output/input slot for activation gradients, kept in the handle) and the installer of
:mod:`~gradtap._transform.apply` (the capture subscriptions that apply the transforms at the
chosen moment). Nothing is stored on the model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gradtap._transform.apply import install
from gradtap._transform.base import factor_fn
from gradtap._transform.plan import Rules, make_plan
from gradtap._transform.state import StateTable
from gradtap._types import OnLiteral, WhenLiteral
from gradtap.capture import HookSet, Tap, check_scaler, compiled_feature, session
from gradtap.select import clean_name

__all__ = ["Rules", "TransformHandle", "transform"]


class TransformHandle:
    """The live transforms installed by :func:`transform`; remove with :meth:`remove`.

    Attributes:
        on: which gradients are transformed (``"param_grad"``, ``"grad_output"``, ``"grad_input"``).
        when: when parameter gradients are transformed (``"backward"``, ``"accumulate"``, ``"step"``).

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Linear(2, 1)
        >>> h = gt.transform(net, {"weight": gt.ewma(0.9)})
        >>> net(torch.ones(1, 2)).sum().backward()
        >>> h.state_dict()["state"]["weight"]["count"]
        1
        >>> h.remove()
        >>> h
        <TransformHandle removed: on='param_grad', when='accumulate', 1 targets>
    """

    def __init__(
        self,
        model: nn.Module,
        rules: Rules,
        when: WhenLiteral | None,
        on: OnLiteral,
        optimizer: torch.optim.Optimizer | None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        sess = session(model, "transform()")
        check_scaler(scaler, "transform")
        _check_ddp(model, when, on)
        # Named as the user's model (no DDP or compile prefixes); the hooks go through the
        # wrappers, so a compiled model's per-call taps run eagerly.
        self._plan = make_plan(sess.root, rules, when, on, optimizer)
        self.on: OnLiteral = self._plan.on
        self.when: WhenLiteral = self._plan.when
        self._hooks = HookSet()
        self._hooks.add_cleanup(sess.attach().detach)
        self._tap: Tap | None = None
        self._removed = False
        try:
            self._states = StateTable(self._plan)
            amp = sess.scaler(scaler, "transform")
            feature = (f"transform(on={self.on!r})" if self.on != "param_grad"
                       else f"transform(when={self.when!r})")
            with compiled_feature(feature):
                self._tap = install(model, self._plan, self._states, self._hooks, optimizer,
                                    amp)
            if self.on == "param_grad":  # a Monitor on the model stores them (clip_factor)
                self._hooks.add_cleanup(sess.publish(
                    "clip_factor", lambda: {clean_name(n): f for n, f in self.last_factors.items()}))
                if self.when == "step":
                    self._publish_pending(sess, optimizer)
        except BaseException:
            self.remove()
            raise

    def _publish_pending(self, sess: Any, optimizer: torch.optim.Optimizer | None) -> None:
        """when="step": the rules run inside ``optimizer.step()``, after a Monitor step taken
        before it. From the end of a backward that reached a ruled parameter to the optimizer
        step, the factors of the current gradients are still to come: published as topic
        ``"clip_factor_pending"`` (the names), so the Monitor stores them with their own
        step once the optimizer step ran."""
        assert optimizer is not None
        pending = [False]
        params: list[Tensor] = [t.param for t in self._plan.params.values()]

        def backward_reached(reached: list[int]) -> None:
            pending[0] = True

        def ran(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            pending[0] = False  # after the rules' own pre-hook, registered before this one

        self._hooks.after_accumulation([params], backward_reached)
        self._hooks.optimizer_step_pre(optimizer, ran)
        self._hooks.add_cleanup(sess.publish(
            "clip_factor_pending",
            lambda: {clean_name(n): f for n, f in self.last_factors.items()} if pending[0]
            else {}))

    def plan(self) -> dict[str, str]:
        """Return which rule applies where: ``{name: rule pattern}``.

        Names are parameter names (``on="param_grad"``, in ``named_parameters()`` order) or
        module names (activation gradients, in ``named_modules()`` order). Parameters and
        modules that no rule matched are absent.
        """
        return self._plan.labels()

    @property
    def last_factors(self) -> dict[str, Tensor]:
        """What the spike rules did at the last step: ``{name: factor}``.

        For each parameter (or slot) whose rule holds a spike-control transform (``zclip``,
        ``adagc``, ``agc``, ``adagn``, ``spam_clip``; the product when a chain holds
        several), the factor its gradient was multiplied by the last time the rule ran on it:
        a 0-dim tensor on the device, 1.0 where the rule left it alone (and before the first
        step); for the unit- and element-wise rules the ratio of its norms after/before.
        Reading it does not sync with the host; ``float()`` on a value does.

        Example:
            >>> import torch, gradtap as gt
            >>> net = torch.nn.Linear(2, 1)
            >>> h = gt.transform(net, {"weight": gt.zclip(warmup=1, max_norm=0.5)})
            >>> net(torch.tensor([[3.0, 4.0]])).sum().backward()   # warm-up, norm 5 > 0.5
            >>> {n: round(float(f), 4) for n, f in h.last_factors.items()}
            {'weight': 0.1}
            >>> h.remove()
        """
        out: dict[str, Tensor] = {}
        for name, entry in self._states.entries.items():
            fn = factor_fn(entry.transform)
            if fn is not None:
                out[name] = fn(entry.state)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Return a copy of every transform state, keyed by parameter name or slot.

        Slots of activation gradients are named ``"<module>:<path>"`` (e.g.
        ``"encoder:output"``) and exist once a backward reached them. The result holds only
        strings, numbers and tensors, so ``torch.save`` / ``torch.load(weights_only=True)``
        round-trips it.
        """
        return self._states.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore states saved by :meth:`state_dict`, so training resumes bit for bit.

        Raises:
            ValueError: the checkpoint was made with different rules, ``on`` or names, or a
                state does not have the structure this handle's transforms expect.
        """
        self._states.load_state_dict(state_dict)

    def remove(self) -> None:
        """Remove every hook; the model is left as it was. Safe to call more than once."""
        self._removed = True
        if self._tap is not None:
            self._tap.remove()
        self._hooks.remove()

    def __enter__(self) -> TransformHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        status = "removed" if self._removed else "active"
        return f"<TransformHandle {status}: on={self.on!r}, when={self.when!r}, {len(self.plan())} targets>"


def _check_ddp(model: nn.Module, when: WhenLiteral | None, on: OnLiteral) -> None:
    """Refuse parameter-gradient transforms that would run before DDP's all-reduce."""
    from torch.nn.parallel import DistributedDataParallel

    if (isinstance(model, DistributedDataParallel) and on == "param_grad"
            and when in (None, "accumulate", "backward")):
        raise ValueError(
            f"transform(): under DistributedDataParallel, when={when or 'accumulate'!r} would "
            "transform each rank's own gradient before DDP averages them across ranks (and "
            "DDP then overwrites .grad); use when='step' with optimizer= (the averaged "
            "gradients, the same on every rank, right before optimizer.step())"
        )


def transform(
    model: nn.Module,
    rules: Rules,
    *,
    when: WhenLiteral | None = None,
    on: OnLiteral = "param_grad",
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> TransformHandle:
    """Apply stateful gradient transforms to selected parameters or module gradients.

    Rules are an ordered mapping from a glob to a :class:`Transform`. Globs match parameter
    names (``named_parameters()``) for ``on="param_grad"`` and module names
    (``named_modules()``) for ``on="grad_output"`` / ``"grad_input"``; other selectors
    accepted by :mod:`gradtap.select` work too. The first rule that matches wins; a rule
    that matches nothing (or only what earlier rules took) raises :class:`SelectionError`.
    Parameters that do not require grad are left out. State is kept per parameter (or per
    ``"<module>:<slot>"``) in the handle, never on the model.

    ``when`` (parameter gradients):

    * ``"accumulate"`` (default): once per backward, on ``p.grad`` right after it was
      accumulated (with micro-batching it sees the running sum, transformed so far);
    * ``"backward"``: each module call's contribution before accumulation, so the calls of
      a shared module are transformed separately (a parameter is transformed inside the calls
      of the module that owns it directly);
    * ``"step"``: once per ``optimizer.step()``, right before it, on the accumulated gradient
      (the choice for gradient accumulation); needs ``optimizer=``.

    A rule holding ``clip_global_norm`` (alone or in a :func:`chain`) runs once over all the
    parameters it matched, on the accumulated ``p.grad`` of those that have one (a
    parameter whose ``.grad`` is None is left out): with ``"step"`` right before each
    ``optimizer.step()``; with ``"accumulate"`` at the end of each backward that accumulated
    into at least one of them, after all that backward's gradients are in. So
    ``"accumulate"`` gives what ``torch.nn.utils.clip_grad_norm_(<the rule's parameters>,
    max_norm)`` called after every backward gives: with one backward per step that is the
    usual clipping; with several backwards before a step each one clips the running sum
    (the earlier, already clipped, part included), not its own increment, so the global norm
    of those ``.grad`` never exceeds ``max_norm`` between backwards. To clip the sum of the
    micro-batches once, use ``"step"``. ``"backward"`` and activation gradients refuse it.

    The spike-control rules (``zclip``, ``adagc``, ``agc``, ``adagn``, ``spam_clip``) run
    batched over their rule's parameters: with ``"accumulate"`` at the end of each backward,
    over the parameters it reached (``zclip`` without ``per_tensor`` and ``adagc`` over all
    of them, as ``clip_global_norm``); ``spam_clip`` reads the optimizer's ``exp_avg_sq`` and
    needs ``"step"``. :attr:`TransformHandle.last_factors` says what they did.

    Under ``DistributedDataParallel`` and FSDP2 (``fully_shard``) parameter gradients are
    transformed with ``when="step"``: the gradients after the cross-rank reduction (DDP's
    average, the same on every rank; FSDP2's reduce-scattered shards), right before
    ``optimizer.step()``; the other moments would see one rank's own gradient before the
    reduction and are refused. On shards, what needs a whole tensor gets it:
    ``clip_global_norm`` and ``clip_norm`` sum each shard's squares and all-reduce them
    (one all-reduce a rule a step, of one number per tensor; none under DDP), ``centralize`` takes each row's mean over the whole row (no collective when the
    tensors are sharded by rows, FSDP2's default), and the EWMA of ``normalize`` and
    ``ewma`` lives sharded with the gradient (no collective). The results are those of
    one process on the concatenated batch. Pass the wrapped model (DDP's ``.module`` is
    used, so names carry no ``module.`` prefix).

    Activation gradients (``on="grad_output"``: dL/d(output) as it enters the module's
    backward, so everything upstream sees the change; ``on="grad_input"``: what a call sends
    to its inputs) are transformed per call, ``when="backward"``. Their transforms' ``init``
    receives the first gradient seen at a slot and ``update`` gets ``param=None``.

    Args:
        model: the model.
        rules: ``{glob: Transform}`` (or a sequence of ``(glob, Transform)`` pairs), in order.
        when: ``"accumulate"``, ``"backward"`` or ``"step"``; default ``"accumulate"`` for
            parameters, ``"backward"`` for activation gradients.
        on: ``"param_grad"`` (default), ``"grad_output"`` or ``"grad_input"``.
        optimizer: the optimizer whose ``step()`` triggers ``when="step"``.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision run: every transform then
            sees the unscaled gradient ``g / scale`` (its result is scaled back, so the
            scaler's unscale gives the transform of the true gradient), whether it runs
            before or after ``scaler.unscale_`` (``when="step"`` under ``scaler.step``:
            after it for plain optimizers, before for fused ones, which keep the gradient
            scaled until they step). A step the scaler skips for an inf/NaN never reaches
            ``when="step"`` with a plain optimizer; the other moments run before the
            scaler's check and see the inf like any gradient.

    Returns:
        A :class:`TransformHandle` (``plan()``, ``state_dict()``, ``load_state_dict()``,
        ``remove()``; a context manager).

    Raises:
        SelectionError: a rule matches nothing.
        ValueError: unknown ``when``/``on``, ``when="step"`` without an optimizer,
            ``clip_global_norm`` (or ``zclip`` without ``per_tensor``, ``adagc``) with
            ``when="backward"`` or on activation gradients, ``agc`` or ``spam_clip`` on
            activation gradients, ``spam_clip`` without ``when="step"`` and an Adam-like
            optimizer,
            parameter gradients of a DDP-wrapped or FSDP2 model at another ``when`` than
            ``"step"``; and,
            during backward or step, a
            transform that returns a gradient of another shape, dtype or device (naming
            the rule and the parameter).
        TypeError: a rule's value is not a :class:`Transform`.

    Example:
        >>> import torch, gradtap as gt
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        >>> rules = {"0.weight": gt.chain(gt.normalize(0.99), gt.clip_norm(1.0)), "*.bias": gt.scale(0.1)}
        >>> with gt.transform(net, rules, when="accumulate") as h:
        ...     net(torch.randn(2, 3)).sum().backward()
        >>> h.plan()
        {'0.weight': '0.weight', '0.bias': '*.bias', '1.bias': '*.bias'}
    """
    return TransformHandle(model, rules, when, on, optimizer, scaler)

