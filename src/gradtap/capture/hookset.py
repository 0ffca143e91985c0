"""Events not tied to one module call, for consumers that need no records: a ``HookSet``.

Each method subscribes a function to one event: a parameter's gradient accumulated, the end
of a backward that accumulated into some parameters, an optimizer step about to run (of one
optimizer or of any), a grad scaler's step (of any), a call of a module starting or returning,
a tensor's gradient computed. The functions receive tensors, never hooks or graph nodes, and
the set removes every subscription at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from gradtap.capture import compat
from gradtap.capture.amp import ScalerWatch, around_any_scaler_step
from gradtap.capture.clipping import Clip, around_any_clip
from gradtap.capture.compiled import around_compiled_call, compiled_in_place
from gradtap.capture.engine import at_end_of_backward, current_node, graph_task_id
from gradtap.capture.modhooks import Subscription, subscribe
from gradtap.capture.replay import replay_running

__all__ = ["HookSet"]


class HookSet:
    """Subscriptions to events that are not tied to a module call; removed together.

    Every function subscribed through a ``HookSet`` runs only while the set is enabled, so a
    hook that outlives :meth:`remove` (for example on a graph still alive) does nothing; and,
    unless the set is made with ``sees_replays=True``, not during a replay (see
    :mod:`gradtap.capture.replay`).

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> with HookSet() as hooks:
        ...     hooks.post_accumulate_grad(w, lambda p: print(p.grad))
        ...     (2 * w).sum().backward()
        tensor([2., 2.])
    """

    def __init__(self, *, sees_replays: bool = False) -> None:
        self.enabled = True
        self.sees_replays = sees_replays
        self._handles: list[RemovableHandle | Subscription] = []
        self._params: list[Tensor] = []
        self._cleanups: list[Callable[[], None]] = []

    def _live(self) -> bool:
        return self.enabled and (self.sees_replays or not replay_running())

    def post_accumulate_grad(self, param: Tensor, fn: Callable[[Tensor], None]) -> None:
        """Run ``fn(param)`` after ``param.grad`` was accumulated in a backward."""

        def hook(p: Tensor) -> None:
            if self._live():
                fn(p)

        self._handles.append(param.register_post_accumulate_grad_hook(hook))
        self._params.append(param)

    def after_accumulation(self, groups: list[list[Tensor]],
                           fn: Callable[[list[int]], None],
                           each: Callable[[int, Tensor], None] | None = None) -> None:
        """Run ``fn(reached)`` once at the end of each backward that accumulated into at least
        one parameter of ``groups``; ``reached`` lists those groups' indices, in order.

        A backward nested inside a node of another backward (reentrant activation
        checkpointing) is not the end: ``fn`` waits for the enclosing backward, whose other
        gradients are still to come. Under compiled autograd, which refuses an end-of-backward
        callback, ``each(i, p)`` runs instead as parameter ``p`` of group ``i`` is accumulated
        (without ``each``, such a backward raises).
        """
        reached = [False] * len(groups)
        queued: list[int | None] = [None]  # the graph task whose end is already awaited

        def defer_to_enclosing(node: Any) -> None:
            fired = [False]

            def after_node(grad_inputs: Any, grad_outputs: Any) -> None:
                # One-shot: with retain_graph the node may run again in a later backward.
                if not fired[0] and self.enabled:
                    fired[0] = True
                    at_end_of_backward(end_of_backward)

            node.register_hook(after_node)

        def end_of_backward() -> None:
            if not self.enabled:
                return
            node = current_node()
            if node is not None:  # a nested backward ends inside a node of another one
                defer_to_enclosing(node)
                return
            queued[0] = None
            todo = [i for i, hit in enumerate(reached) if hit]
            reached[:] = [False] * len(groups)
            if todo:  # a nested backward's deferred end may have found them reported
                fn(todo)

        for i, params in enumerate(groups):
            for p in params:

                def on_accumulated(p: Tensor, _i: int = i) -> None:
                    if each is not None and compat.compiled_autograd_active():
                        each(_i, p)
                        return
                    reached[_i] = True
                    task = graph_task_id()
                    if task != queued[0]:
                        # Once per backward (a stale id left by a backward that raised is
                        # never reused: graph task ids only grow).
                        queued[0] = task
                        at_end_of_backward(end_of_backward)

                self.post_accumulate_grad(p, on_accumulated)

    def optimizer_step_pre(self, optimizer: torch.optim.Optimizer, fn: Callable[..., None]) -> None:
        """Run ``fn(optimizer, args, kwargs)`` right before ``optimizer.step()``."""

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._live():
                fn(opt, args, kwargs)

        self._handles.append(optimizer.register_step_pre_hook(hook))

    def any_optimizer_step_pre(self, fn: Callable[..., Any]) -> None:
        """Run ``fn(optimizer, args, kwargs)`` right before the ``step()`` of every
        ``torch.optim.Optimizer`` of the process, made before or after this call (torch's
        global optimizer pre-hook). ``fn`` may return new ``(args, kwargs)`` for the step (a
        wrapped ``closure``), as torch's pre-hooks may; ``None`` keeps them."""
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
            if self._live():
                return fn(opt, args, kwargs)
            return None

        self._handles.append(register_optimizer_step_pre_hook(hook))

    def any_optimizer_step_post(self, fn: Callable[..., None]) -> None:
        """Run ``fn(optimizer, args, kwargs)`` right after the ``step()`` of every
        ``torch.optim.Optimizer`` of the process (torch's global optimizer post-hook)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if self._live():
                fn(opt, args, kwargs)

        self._handles.append(register_optimizer_step_post_hook(hook))

    def module_calls(self, module: nn.Module, before: Callable[[tuple, dict], None] | None,
                     after: Callable[[Any], None], *, always: bool = False) -> None:
        """Run ``before(args, kwargs)`` and ``after(output)`` around each call of ``module``
        (``after`` only when the call returns; with ``always``, also when it raises, with
        ``None``, and even while the set stands aside, so that it can undo what ``before``
        did). On a module compiled in place (``module.compile()``) they run around its
        compiled call instead, outside compiled code, so they add no graph break (``before``
        then sees the arguments before any of the module's own pre-hooks); with ``always``
        they stay the module's own hooks (the caller runs that compiled code eagerly)."""
        if compiled_in_place(module) and not always:
            live = self._live

            def outer_before(args: tuple, kwargs: dict) -> None:
                if live() and before is not None:
                    before(args, kwargs)

            def outer_after(output: Any) -> None:
                if live():
                    after(output)

            self._cleanups.append(around_compiled_call(module, outer_before, outer_after))
            return
        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._live():
                before(args, kwargs)  # type: ignore[misc]

        def post(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if always or self._live():
                after(output)

        self._handles.append(subscribe(module, pre if before is not None else None, post,
                                       always=always))

    def gradient(self, t: Tensor, fn: Callable[..., None],
                 args: tuple = ()) -> RemovableHandle | None:
        """Run ``fn(*args, grad)`` with the gradient w.r.t. ``t`` as it is now, in each
        backward that computes it. On a non-leaf the hook lives as long as ``t``'s graph and
        ``None`` is returned. A leaf outlives any graph (an input tensor reused every step), so
        its hook's handle is returned: the caller removes it when the backward it waits for is
        over."""

        node, nr = t.grad_fn, t.output_nr
        if node is None:  # a leaf: its own hook (slower, but leaves are rare here)

            def leaf_hook(g: Tensor) -> None:
                if self._live():
                    fn(*args, g)

            return t.register_hook(leaf_hook)

        # A pre-hook on the node that made t (what Tensor.register_hook installs too, minus
        # the Python bookkeeping, which costs more than the rest of a light hook).
        def prehook(grad_outputs: tuple) -> None:
            if self.enabled and (self.sees_replays or not replay_running()):  # self._live()
                g = grad_outputs[nr]
                if g is not None:
                    fn(*args, g)

        node.register_prehook(prehook)
        return None

    def grad_scaler(self, scaler: torch.amp.GradScaler) -> ScalerWatch:
        """Follow ``scaler``'s calls (see :mod:`gradtap.capture.amp`) until :meth:`remove`."""
        watch = ScalerWatch(scaler)
        self._cleanups.append(watch.remove)
        return watch

    def around_any_grad_scaler_step(self, before: Callable[[Any, Any], None],
                                    after: Callable[[Any, Any], None]) -> None:
        """Run ``before(scaler, optimizer)`` and ``after(scaler, optimizer)`` around every
        ``torch.amp.GradScaler.step(optimizer)`` of the process (also the steps the scaler
        skips, on which ``optimizer.step()`` never runs); see
        :func:`gradtap.capture.amp.around_any_scaler_step`."""
        self._cleanups.append(around_any_scaler_step(before, after, self._live))

    def around_any_clip(self, around: Callable[[Clip], None],
                        on_error: Callable[[BaseException], None]) -> None:
        """Call ``around(clip)`` in place of every gradient clip of the process
        (``torch.nn.utils.clip_grad_norm_`` and the others); ``clip.run()`` runs the real one,
        which runs once whatever ``around`` does; see :mod:`gradtap.capture.clipping`."""
        self._cleanups.append(around_any_clip(around, self._live, on_error))

    def add(self, handle: RemovableHandle | Subscription) -> None:
        """Adopt a handle registered elsewhere in capture."""
        self._handles.append(handle)

    def add_cleanup(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on :meth:`remove`, after the handles are removed."""
        self._cleanups.append(fn)

    def remove(self) -> None:
        """Remove every hook; safe to call more than once."""
        self.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for p in self._params:
            compat.clear_post_accumulate_hooks(p)
        self._params.clear()
        for fn in self._cleanups:
            fn()
        self._cleanups.clear()

    def __enter__(self) -> HookSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
