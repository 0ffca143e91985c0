"""The default watch of ``gt.detect``: a light screen of each step (``_replay.py`` then replays
a step found bad, to localize it).

A healthy step should cost little, so the screen keeps no records and walks no graph:

* After each call of the model its floating outputs are screened, and a hook on each output
  that requires grad screens the gradient that reaches it; a hook on each input that requires
  grad screens the gradient that leaves the model. With ``screen="modules"`` every selected
  call's outputs and their gradients are screened the same way, which also sees a NaN/Inf
  that is masked before it reaches a parameter gradient (a ReLU after a sqrt at 0), at a cost
  per call. A small tensor is kept by reference and reduced with the others in one batched
  norm at the check; a large one is reduced at once (``torch.aminmax``, kept on the device).
* A call of one of the model's direct children made outside any call of the model (a model
  used through its own methods, ``decode(encode(x))``) is a top-level call too: its outputs
  and their gradients are screened the same way, and it is kept for a replay (not for a
  plain ``nn.Sequential``, which is used through its forward, nor for a compiled model: no
  hook on their children).
* Around each call of the model the screen also keeps the arguments (references), the RNG
  state and the autocast state (capture's replay kit): what a replay needs.
* At the end of a backward that reached a screened output it reads, in one host copy, every
  pending forward and gradient reduction plus a finiteness flag for every parameter gradient
  (one fused pass over the small ones, the in-backward sums of the large ones: how the
  parameter gradients are grouped and read is ``_params.py``'s job). A healthy
  step reads one flag per device: one fused finiteness pass over the parameter gradients and
  the sums of the screened tensors sets it; only when it is set does the full check look at
  each value, to say which is not finite.
  ``det.check_loss(loss)`` adds the loss to that check. Without a backward (or when it
  reached no screened tensor: a loss on an intermediate only), the check runs at
  ``det.step()``, parameter gradients included.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gradtap._detect import _host
from gradtap._detect._anomaly import LOSS
from gradtap._detect._params import HALF, ParamGrads
from gradtap._tensorops.sharded import local
from gradtap.capture import (
    AutocastState,
    HookSet,
    OncePerBackward,
    RngState,
    argument_tensors,
    compat,
    compiled_feature,
    compiled_parts,
    in_recomputation,
    run_eagerly,
    session,
)
from gradtap.record import flatten_tensors

__all__ = ["RootCall", "Screen", "Suspect"]

#: Calls of the model kept (arguments, RNG state) per step for a replay; older calls of a
#: step that runs more forwards than this without ``det.step()`` are not replayed.
MAX_KEPT_CALLS = 64
#: Tensors with at most this many elements are kept by reference until the check (one batched
#: norm for all); larger ones are reduced as they come, so the screen keeps nothing big alive.
SMALL = 1 << 16


class RootCall:
    """One top-level call in this step: of the model, or of one of its direct children called
    outside any call of the model (a model used through its own methods, ``decode(encode(x))``);
    what a replay needs, and what the screen checks."""

    __slots__ = ("module", "name", "args", "kwargs", "rng", "autocast", "grads", "reported")

    def __init__(self, module: nn.Module, name: str, args: tuple, kwargs: dict,
                 cuda_devices: list[int]) -> None:
        self.module, self.name = module, name
        self.args: tuple | None = args
        self.kwargs: dict = kwargs
        self.rng = RngState(cuda_devices)
        self.autocast = AutocastState.capture()
        self.grads: dict[str, Tensor] = {}  # dL/d(output) of the running backward
        self.reported = False  # an anomaly of its forward was reported: skip its backward


class Suspect:
    """What the screen found non-finite: ``where`` is ``"forward"`` (an output of ``module``),
    ``"loss"``, ``"grad_output"`` (dL/d an output of ``module``), ``"grad_input"`` (dL/d an
    input of the model) or ``"param_grad"`` (``key`` is the parameter's name); ``tensor`` when
    still held."""

    __slots__ = ("where", "module", "key", "tensor", "nan")

    def __init__(self, where: str, module: str, key: str, tensor: Tensor | None,
                 nan: bool | None = None) -> None:
        self.where, self.module, self.key, self.tensor = where, module, key, tensor
        self.nan = nan  # known from the reduction when the tensor is gone


class _Pending:
    """Screened tensors waiting for the next check: small ones by reference, large ones as
    device-side ``(min, max)`` pairs."""

    __slots__ = ("refs", "ref_info", "ranges", "range_info")

    def __init__(self) -> None:
        self.refs: list[Tensor] = []
        self.ref_info: list[tuple[int, str, str, str]] = []  # (order, where, module, key)
        self.ranges: list[Tensor] = []
        self.range_info: list[tuple[int, str, str, str, weakref.ref[Tensor]]] = []

    def add(self, where: str, module: str, key: str, t: Tensor) -> None:
        order = len(self.ref_info) + len(self.range_info)
        if t.numel() <= SMALL:
            self.refs.append(t)
            self.ref_info.append((order, where, module, key))
        else:
            lo, hi = torch.aminmax(t.detach())
            self.ranges += (lo, hi)
            self.range_info.append((order, where, module, key, weakref.ref(t)))


class Screen:
    """Light hooks on the model, and on ``modules`` (named) too; see the module docstring."""

    def __init__(self, model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
        # A compiled model: the hooks go on its wrapper (outside compiled code), the names
        # come from the model it compiles.
        self.model = model
        root = session(model).root
        self.calls: list[RootCall] = []  # this step's calls of the model, in call order
        self.on_backward_end: Any = None  # set by the detector: fn(list[RootCall])
        self.quiet_params = False  # an anomaly was reported this step: .grad holds its effects
        self.backward_checked = False  # a backward of this step was checked
        self.param_norms: tuple[list[tuple[str, Tensor]], np.ndarray] | None = None
        self._forward = _Pending()  # outputs since the last forward check
        self._grads = _Pending()  # gradients of the running backward
        # Open top-level calls; None for a call without grad mode or nested in another.
        self._open: list[RootCall | None] = []
        self._backward: list[RootCall] = []
        self._end = OncePerBackward(self._end_of_backward)
        self._leaf_hooks: list[RemovableHandle] = []  # on leaf tensors: removed after use
        # Parameters whose .grad was non-finite at the last check, and whether it still was
        # when the running backward began (device flags): a .grad that stays non-finite
        # because nobody zeroed it is not a new anomaly.
        self._bad_params: dict[int, Tensor] = {}
        self._finite_at_start: dict[int, Tensor] = {}
        self._flags: dict[torch.device, Tensor] = {}  # the flags of the healthy step's check
        self.params = ParamGrads(root)
        self.cuda = sorted({p.device.index or 0 for p in model.parameters() if p.is_cuda})
        self._arguments = argument_tensors(root)
        self.hooks = HookSet()
        for _, param in self.params.large:
            if param.requires_grad:
                self.hooks.post_accumulate_grad(param, self.params.sum_grad)
        self._screened = {name for name, module in modules
                          if module is not model and module is not root}
        for name, module in modules:
            if module is not model and module is not root:
                self.hooks.module_calls(module, None, functools.partial(self._screen_call, name))
        # The model's direct children, called outside any call of the model: top-level calls
        # too (a model trained through its own methods, as autoencoders are). A plain
        # nn.Sequential is used through its forward, and a compiled model's children run
        # inside its compiled code (a hook there would break its graph): no hook on them.
        used_directly = (type(root) is not nn.Sequential
                         and not compiled_parts(model, root, [root]))
        for name, child in (root.named_children() if used_directly else ()):
            self.hooks.module_calls(child, functools.partial(self._before, child, name),
                                    functools.partial(self._after, name))
        if modules:
            with compiled_feature("detect(screen='modules')"):
                release = run_eagerly(model, root, modules)
            if release is not None:
                self.hooks.add_cleanup(release)
        self.hooks.module_calls(model, functools.partial(self._before, model, ""),
                                functools.partial(self._after, ""))

    @property
    def norms_mode(self) -> bool:
        """Set by the detector with ``spike=``: the check reduces each parameter gradient to its
        L2 norm (instead of a finiteness flag per group, which the norms imply), and leaves
        ``(params, norms)`` of the last check of parameter gradients in ``param_norms``."""
        return self.params.norms_mode

    @norms_mode.setter
    def norms_mode(self, on: bool) -> None:
        self.params.norms_mode = on

    # -- hooks (no host sync) -----------------------------------------------------------------

    def _screen_call(self, name: str, output: Any) -> None:
        # Forward calls inside a backward are checkpoint recomputations; without grad mode
        # there is no backward to check (nor a record in the per-call watch).
        if torch.is_grad_enabled() and not in_recomputation():
            top = self._open[-1] if self._open else None
            if top is not None and top.name == name:
                return  # a top-level call of a child: screened as such (``_after``)
            self._screen_outputs(name, output, None)

    def _screen_outputs(self, name: str, output: Any, call: RootCall | None) -> None:
        outs = flatten_tensors(output, "output")
        for path, t in outs:
            if _host.measurable(t):
                self._forward.add("forward", name, path, t)  # detached if reported
                if t.requires_grad:
                    self._hook_gradient(t, "grad_output", name, path, call)

    def _hook_gradient(self, t: Tensor, where: str, name: str, path: str,
                       call: RootCall | None) -> None:
        handle = self.hooks.gradient(t, self._on_grad, (where, name, path, call))
        if handle is not None:
            self._leaf_hooks.append(handle)

    def _before(self, module: nn.Module, name: str, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or in_recomputation() or (name and self._open):
            self._open.append(None)  # no backward to check, or inside a top-level call
            return
        self._open.append(RootCall(module, name, args, kwargs, self.cuda))
        if name:
            return  # a child's arguments come from the model's own computation
        if not kwargs:
            for a in args:
                if not isinstance(a, Tensor) or a.requires_grad:
                    break
            else:
                return  # the usual call: tensors that need no gradient
        for path, t in self._arguments(args, kwargs):
            if t.requires_grad and _host.measurable(t):
                self._hook_gradient(t, "grad_input", "", path, None)

    def _after(self, name: str, output: Any) -> None:
        call = self._open.pop() if self._open else None
        if call is None:
            return
        self._screen_outputs(name, output, call)
        self.calls.append(call)
        if len(self.calls) > MAX_KEPT_CALLS:
            old = self.calls[-MAX_KEPT_CALLS - 1]
            old.args, old.kwargs = None, {}

    def _on_grad(self, where: str, name: str, path: str, call: RootCall | None,
                 g: Tensor) -> None:
        if self._end.arm():  # the first gradient of this backward
            self._backward = []
            if self._bad_params:
                with torch.no_grad():
                    self._finite_at_start = {
                        i: torch.isfinite(local(p.grad)).all().to(torch.float32)
                        for i, p in self._bad_params.items() if p.grad is not None}
        if _host.measurable(g):
            self._grads.add(where, name, path, g)
        if call is not None:  # the model's own output: kept for a replay of this backward
            backward = self._backward
            for c in backward:
                if c is call:
                    break
            else:
                backward.append(call)
            old = call.grads.get(path)
            call.grads[path] = g if old is None else old + g

    def _end_of_backward(self) -> None:
        backward, self._backward = self._backward, []
        try:
            if self.on_backward_end is not None:
                self.on_backward_end(backward)
        finally:
            if self._grads.refs or self._grads.range_info:
                self._grads = _Pending()
            if self._leaf_hooks:
                self._remove_leaf_hooks()
            for call in backward:
                call.grads = {}

    def _remove_leaf_hooks(self) -> None:
        for handle in self._leaf_hooks:
            handle.remove()
        self._leaf_hooks = []

    # -- checks ---------------------------------------------------------------------------------

    def unchecked(self) -> bool:
        """Whether screened forward outputs wait for a check."""
        return bool(self._forward.refs or self._forward.range_info)

    def add_loss(self, loss: Tensor) -> None:
        """Check ``loss`` with the forward outputs (``det.check_loss``)."""
        if _host.measurable(loss):
            self._forward.add("loss", LOSS, "loss", loss)

    def check(self, backward: bool = False, *, stale: bool = False) -> list[Suspect]:
        """Check, with one host copy, the forward outputs (and loss) screened since the last
        check, and with ``backward`` the running backward's gradients and every parameter
        gradient (``stale``: no backward was seen, so a ``.grad`` already known to be
        non-finite is not new). Returns what is non-finite, forward first (empty for a healthy
        step)."""
        fwd, self._forward = self._forward, _Pending()
        pending = [fwd]
        params: list[tuple[str, Tensor]] = []
        grad_groups: list[list[Tensor]] = []
        summed: list[tuple[Tensor, Tensor]] = []
        refs, ranges = fwd.refs, fwd.ranges
        started = {}
        if backward:
            self.backward_checked = True
            running = self._grads
            pending.append(running)
            refs, ranges = refs + running.refs, ranges + running.ranges
            if not self.quiet_params:
                params, grad_groups, summed = self.params.listed()
            started = self._finite_at_start
        self._finite_at_start = {}
        self.param_norms = None
        if not refs and not ranges and not params:
            return []
        if self._all_finite(refs, ranges, params, grad_groups, summed):  # the usual step
            if params:
                self._bad_params.clear()
            return []
        with torch.no_grad():
            # The one host copy: the screened tensors' norms, then one flag per group of
            # parameter gradients, the sums of those summed in backward, ranges, start flags;
            # in norms mode, each parameter gradient's norm (those summed in backward: their
            # norms) instead of the flags.
            if self.norms_mode:
                flags = []
                vectors = [self.params.norms(g) for g in grad_groups if g]
            else:
                flags = _host.nonfinite_flags(grad_groups)
                vectors = []
            values = _host.norms(refs, extra=[*flags, *(s for _, s in summed), *ranges,
                                              *started.values()], vectors=vectors)
        first_param = len(refs)
        if self.norms_mode:
            n_norms = sum(len(g) for g in grad_groups)
            grouped_norms = values[len(values) - n_norms:]
            values = values[:len(values) - n_norms]
            n_summed = len(summed)
            if params:
                self.param_norms = (params, np.concatenate(
                    [grouped_norms, values[first_param:first_param + n_summed]]))
            sizes = [len(g) for g in grad_groups if g]
            starts = np.cumsum([0, *sizes[:-1]])
            # A group is flagged when a norm is non-finite (or their sum overflows): the check
            # below then looks at each of its gradients, as for the flags.
            flagged = (~np.isfinite(np.add.reduceat(grouped_norms, starts)) if sizes
                       else np.zeros(0, dtype=bool))
        else:
            flagged = values[first_param:first_param + len(flags)]
            values = np.delete(values, np.s_[first_param:first_param + len(flags)])
        if not flagged.any() and math.isfinite(values.sum()):  # a healthy step
            if params:
                self._bad_params.clear()
            return []
        # Rare: which gradients of a flagged group are non-finite, one check each.
        grouped = [0.0 if not flag or bool(torch.isfinite(g).all()) else math.inf
                   for flag, group in zip(flagged, (g for g in grad_groups if g), strict=True)
                   for g in group]
        values = np.insert(values, first_param, grouped)
        n_refs = first_param + len(params)
        was_finite = dict(zip(started, values[n_refs + len(ranges):]))
        bad = np.flatnonzero(~np.isfinite(values[:n_refs])).tolist()
        grads = [g for group in grad_groups for g in group] + [g for g, _ in summed]
        refs += grads
        if self._bad_params and grads:  # a .grad known to be non-finite may be finite again
            now_bad = {id(params[i - first_param][1]) for i in bad if i >= first_param}
            for k in [k for k in self._bad_params if k not in now_bad]:
                del self._bad_params[k]
        found: list[tuple[int, int, Suspect]] = []  # (part, order, suspect)
        info = [(n, x) for n, part in enumerate(pending) for x in part.ref_info] if bad else []
        for i in bad:
            t = refs[i]
            if bool(torch.isfinite(t).all()):
                continue  # the norm or sum overflowed on finite values
            if i < first_param:
                n, (order, where, module, key) = info[i]
                found.append((n, order, Suspect(where, module, key, t.detach())))
                continue
            name, p = params[i - first_param]
            known = id(p) in self._bad_params
            self._bad_params[id(p)] = p
            if (stale and known) or was_finite.get(id(p), 1.0) == 0.0:
                continue  # non-finite before this backward: not new
            found.append((len(pending), i - first_param,
                          Suspect("param_grad", "", name, t.detach())))
        lohi = values[n_refs:]
        j = 0
        for n, part in enumerate(pending):
            for order, where, module, key, ref in part.range_info:
                lo, hi = lohi[j], lohi[j + 1]
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    held = ref()
                    found.append((n, order, Suspect(where, module, key,
                                                    None if held is None else held.detach(),
                                                    nan=bool(np.isnan(lo) or np.isnan(hi)))))
                j += 2
        # In the order they were screened: calls as they finished, gradients as they arrived.
        return [s for _, _, s in sorted(found, key=lambda x: (x[0], x[1]))]

    def _all_finite(self, refs: list[Tensor], ranges: list[Tensor],
                    params: list[tuple[str, Tensor]], grad_groups: list[list[Tensor]],
                    summed: list[tuple[Tensor, Tensor]]) -> bool:
        """The healthy step's check: whether everything :meth:`check` reads is finite, from
        one fused finiteness pass per device and dtype over the parameter gradients and the
        small reductions (the screened tensors' sums, the large gradients' sums, the ranges)
        and one host copy of a flag per device (in norms mode, with the parameter-gradient
        norms, then kept in ``param_norms``). False when something is not finite (or a sum
        overflows), or when this pass cannot say (a dtype or tensor the fused pass refuses):
        the full check then looks at each value."""
        if len(grad_groups) == 1 and grad_groups[0] and not ranges and not summed:
            found = self._one_device_finite(refs, params, grad_groups[0])
            if found is not None:
                return found
        grad_mode = torch.is_grad_enabled()
        compat.set_grad_enabled(False)  # no graph for the reductions
        try:
            lists: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
            vectors: list[Tensor] = []
            if self.norms_mode:
                vectors = [self.params.norms(g) for g in grad_groups if g]
            else:  # the gradients themselves, written back as they are by the fused pass
                for group in grad_groups:
                    if group:
                        lists.setdefault((group[0].device, group[0].dtype), []).extend(group)
            # Reductions made here, which the fused pass may write back too; a screened tensor
            # is summed (it is not ours to write), in float32 at least.
            owned: list[Tensor] = [*ranges, *(s for _, s in summed), *vectors]
            owned += [t.sum() if t.dtype not in HALF else t.sum(dtype=torch.float32)
                      for t in refs]
            for t in owned:
                if t.dtype in HALF:
                    t = t.float()
                key = (t.device, t.dtype)
                same = lists.get(key)
                if same is None:
                    lists[key] = [t]
                else:
                    same.append(t)
            flags = []
            for (device, _), tensors in lists.items():
                flag = self._flags.get(device)
                if flag is None:  # kept: the fused pass only ever sets it (reset when read set)
                    flag = self._flags[device] = torch.zeros((), dtype=torch.float32,
                                                             device=device)
                flags.append(flag)
                if not compat.flag_nonfinite_(tensors, flag):
                    self._reset_flags()
                    return False
            n_flags = len(flags)
            if self.norms_mode:
                flags += [*vectors, *(s.reshape(1) for _, s in summed)]
            host = _host.to_host(flags)
        finally:
            compat.set_grad_enabled(grad_mode)
        for h in host[:n_flags]:
            if h.item() != 0:
                self._reset_flags()
                return False
        if self.norms_mode and params:
            got = host[n_flags:]
            self.param_norms = (params, (got[0] if len(got) == 1 else np.concatenate(got)
                                         ).astype(np.float64))
        return True

    def _one_device_finite(self, refs: list[Tensor], params: list[tuple[str, Tensor]],
                           grads: list[Tensor]) -> bool | None:
        """:meth:`_all_finite` for the usual model: one list of parameter gradients, screened
        tensors of their device and dtype; None when that is not the case."""
        head = grads[0]
        dtype, device = head.dtype, head.device
        flag = self._flags.get(device)
        if flag is None or dtype in HALF:
            return None
        for t in refs:
            if t.dtype != dtype or t.device != device:
                return None
        grad_mode = torch.is_grad_enabled()
        compat.set_grad_enabled(False)  # no graph for the reductions
        try:
            sums = [t.sum() for t in refs]
            if self.norms_mode:
                norms = self.params.norms(grads)
                ok = compat.flag_nonfinite_([norms, *sums], flag)
                host = _host.to_host([flag, norms])
            else:
                ok = compat.flag_nonfinite_(grads + sums, flag)
                host = _host.to_host([flag])
        finally:
            compat.set_grad_enabled(grad_mode)
        if ok and host[0].item() == 0:
            if self.norms_mode:
                self.param_norms = (params, host[1].astype(np.float64))
            return True
        self._reset_flags()
        return False

    def _reset_flags(self) -> None:
        for flag in self._flags.values():
            flag.zero_()

    def new_step(self) -> None:
        """Forget this step's calls (``det.step()``)."""
        self.params.new_step()
        self.calls = []
        self._open = []  # a call that raised left its entry
        self.quiet_params = False
        self.backward_checked = False
        if self._leaf_hooks:
            self._remove_leaf_hooks()

    def remove(self) -> None:
        self.hooks.remove()
        self._remove_leaf_hooks()
        self.calls = []
        self._open = []
        self._forward = _Pending()
        self._grads = _Pending()
