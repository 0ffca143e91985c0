"""Every private torch API gradtap touches, probed once, each with a tested fallback.

gradtap supports a range of torch releases (the README's "Supported versions"). What it needs
of torch beyond the public API is reached only through this module: each private name is
looked up once, at import, and where a release lacks it a fallback takes its place. A
fallback that loses something says so once, in a :class:`TorchCompatWarning`, the first time
it is used; :data:`APIS` lists every name, its fallback and what the fallback loses (the same
table is in ``docs/semantics.md``, "Torch versions").

Callers read the functions as attributes of this module at call time
(``compat.graph_task_id()``), so :func:`missing` can stand in for a torch that lacks a name:
the test suite runs each fallback that way.

Example:
    >>> from gradtap.capture import compat
    >>> compat.graph_task_id()  # no backward runs in this thread
    -1
    >>> with compat.missing("torch._C._current_graph_task_id"):
    ...     compat.graph_task_id()  # the fallback answers the same
    -1
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["APIS", "REQUIRED", "TorchCompatWarning", "available", "missing"]


class TorchCompatWarning(UserWarning):
    """A feature runs on a fallback that loses something on this torch release."""


@dataclass(frozen=True)
class Api:
    """One private torch API: where it lives, what gradtap uses it for, its fallback."""

    path: str
    used_for: str
    fallback: str
    loses: str = ""  # empty: the fallback gives the same answers


APIS: dict[str, Api] = {a.path: a for a in (
    Api("torch._C._current_graph_task_id", "which backward is running (one check per backward)",
        "an id made on the first query inside a backward, cleared by an end-of-backward callback",
        "a backward run inside a hook of another shares its id"),
    Api("torch._C._autograd._get_sequence_nr", "which graph nodes a module call created",
        "the sequence number of a throw-away op"),
    Api("torch._C._current_autograd_node", "whether a backward ends inside a node of another",
        "none", "a backward nested in a hook ends the enclosing backward's per-backward checks"),
    Api("torch._C._functions.AccumulateGrad", "telling parameters' gradient nodes apart",
        "the type of a leaf's gradient node, read off a throw-away op"),
    Api("torch._C._autograd._unsafe_set_version_counter",
        "a module's output keeps its version when gradtap marks it as a call's boundary",
        "no boundary node: the output's own node",
        "a call whose output is used inside it, or is a view of its input, gets grad_outputs "
        "that include the uses inside the call, or no record"),
    Api("torch._C._autograd.SavedTensor.unpack_hook",
        "reading forward tensors saved for backward (exact NaN/Inf counts in detect's reports)",
        "saved tensors are not read",
        "detect reports a forward tensor's non-finite count only where it kept the tensor"),
    Api("torch.Tensor._post_accumulate_grad_hooks",
        "leaving a parameter as it was after removing a post-accumulate-grad hook",
        "none needed (the attribute is what the hook leaves behind)"),
    Api("torch._C._set_grad_enabled", "switching grad mode in hot paths without a context object",
        "torch.set_grad_enabled"),
    Api("torch._amp_foreach_non_finite_check_and_unscale_",
        "one fused finiteness test over many gradients",
        "the norms of the gradients, summed, tested for finiteness",
        "speed: one norm per gradient"),
    Api("torch.amp.GradScaler._scale", "the scale of a step without a host read",
        "GradScaler.get_scale()", "one host read per step on a GPU"),
    Api("torch.amp.GradScaler._per_optimizer_states",
        "whether the scaler found inf/NaN, and whether an optimizer's gradients are unscaled",
        "none", "found-inf is unknown to gradtap; a watch made after unscale_ assumes scaled"),
    Api("torch.optim.Optimizer._step_supports_amp_scaling",
        "whether an optimizer unscales the gradients itself as it steps",
        "taking every optimizer as one that does not",
        "after a fused optimizer's step, its gradients are taken as still scaled"),
    Api("torch._dynamo.eval_frame.OptimizedModule", "finding torch.compile's wrapper",
        "a module holding the compiled module as _orig_mod"),
    Api("torch.nn.Module._compiled_call_impl", "running a module compiled in place eagerly",
        "none needed (a torch without it cannot compile a module in place)"),
    Api("torch._C._storage_Use_Count",
        "building per-sample results on CPU memory of earlier results that nothing refers to",
        "new memory for every result", "speed: fresh memory is faulted in at every backward"),
    Api("torch._C._functorch.is_functorch_wrapped_tensor",
        "building per-sample results on reused memory only outside torch.func's transforms",
        "new memory for every result", "speed: fresh memory is faulted in at every backward"),
)}

def _node_probe() -> Any:
    """A throw-away op on a leaf (its node and the leaf's gradient node, for probes)."""
    with torch.enable_grad():
        leaf = torch.ones(2, requires_grad=True)
        return leaf.exp()


#: What gradtap cannot work without, in every torch it supports (no fallback): checked by the
#: test suite on each torch CI runs, so a release that drops one fails there first.
REQUIRED: dict[str, Callable[[], bool]] = {
    "the engine's callback queue (torch.autograd.Variable._execution_engine.queue_callback)":
        lambda: callable(getattr(getattr(torch.autograd.Variable, "_execution_engine", None),
                                 "queue_callback", None)),
    "graph nodes' sequence numbers (Node._sequence_nr())":
        lambda: isinstance(_node_probe().grad_fn._sequence_nr(), int),
    "saved tensors as node attributes (Node._saved_*, Node._raw_saved_*)":
        lambda: hasattr(_node_probe().grad_fn, "_saved_result")
        and hasattr(_node_probe().grad_fn, "_raw_saved_result"),
    "tensors' version counters and view bases (Tensor._version, ._base, ._is_view())":
        lambda: all(hasattr(torch.Tensor, a) for a in ("_version", "_base", "_is_view")),
}


def required_present(name: str) -> bool:
    """Whether this torch has the required API ``name`` (a key of :data:`REQUIRED`)."""
    return REQUIRED[name]()


_HIDDEN: set[str] = set()
_WARNED: set[str] = set()


def _attr_chain(path: str) -> Any:
    """torch's object at the dotted ``path``, or None where this release lacks it."""
    obj: Any = torch
    for part in path.split(".")[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _on_scaler(name: str) -> Callable[[], Any]:
    """A probe for an attribute every enabled ``GradScaler`` sets in ``__init__``."""
    def probe() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scaler = torch.amp.GradScaler("cpu")
        return name if name in vars(scaler) else None
    return probe


def _compile_wrapper_type() -> Any:
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:
        return None
    return OptimizedModule


#: How each API is found (the default: an attribute chain from ``torch``).
_PROBES: dict[str, Callable[[], Any]] = {
    "torch.amp.GradScaler._scale": _on_scaler("_scale"),
    "torch.amp.GradScaler._per_optimizer_states": _on_scaler("_per_optimizer_states"),
    "torch._dynamo.eval_frame.OptimizedModule": _compile_wrapper_type,
    "torch.optim.Optimizer._step_supports_amp_scaling": lambda: "_step_supports_amp_scaling",
    "torch.nn.Module._compiled_call_impl":
        lambda: "_compiled_call_impl" if hasattr(torch.nn.Module(), "_compiled_call_impl") else None,
}
_FOUND: dict[str, Any] = {}


def _lookup(path: str) -> Any:
    """What the probe of ``path`` found (probed once), or None where this release lacks it (or
    a test hides it)."""
    if path in _HIDDEN:
        return None
    if path not in _FOUND:
        _FOUND[path] = _PROBES.get(path, lambda: _attr_chain(path))()
    return _FOUND[path]


def warn_fallback(path: str) -> None:
    """Say once that ``path``'s fallback loses something."""
    if path in _WARNED:
        return
    _WARNED.add(path)
    api = APIS[path]
    warnings.warn(f"gradtap: torch {torch.__version__} has no {path}; {api.used_for} falls back "
                  f"to: {api.fallback}. What that loses: {api.loses}.", TorchCompatWarning,
                  stacklevel=3)


def available(path: str) -> bool:
    """Whether this torch has the private API ``path`` (one of :data:`APIS`)."""
    return _lookup(path) is not None


# -- memory of per-sample results ------------------------------------------------------------

def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """How many tensors are on ``storage``, or None where this torch cannot tell."""
    count = _lookup("torch._C._storage_Use_Count")
    return None if count is None else int(count(storage._cdata))


def functorch_wrapped(t: Tensor) -> bool | None:
    """Whether ``t`` is wrapped by a ``torch.func`` transform, or None where this torch cannot
    tell."""
    wrapped = _lookup("torch._C._functorch.is_functorch_wrapped_tensor")
    return None if wrapped is None else bool(wrapped(t))


# -- the autograd engine ----------------------------------------------------------------------

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback  # type: ignore[attr-defined]
# The fallback's backward: one for the process, not per thread (on a GPU the engine runs hooks
# and end-of-backward callbacks on its device threads).
_tasks = types.SimpleNamespace(current=None, count=0)


def _task_fallback() -> int:
    if _tasks.current is not None:
        return _tasks.current
    try:  # refused outside a backward: that is how the fallback tells
        _queue_callback(_task_ended)
    except RuntimeError:
        return -1
    warn_fallback("torch._C._current_graph_task_id")
    _tasks.count += 1
    _tasks.current = _tasks.count
    return _tasks.current


def _task_ended() -> None:
    _tasks.current = None


def _sequence_fallback() -> int:
    return _node_probe().grad_fn._sequence_nr() + 1


def _no_node() -> None:
    warn_fallback("torch._C._current_autograd_node")


def _accumulate_grad_type() -> type:
    return type(_node_probe().grad_fn.next_functions[0][0])


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` when the backward now running has finished (only valid inside one). The
    engine's callback queue has been part of every torch release gradtap supports; torch's
    own DDP and FSDP rely on it, so it has no fallback."""
    _queue_callback(fn)


def compiled_autograd_active() -> bool:
    """Whether compiled autograd runs (or traces) the backward now: it refuses an
    end-of-backward callback. Without the module imported it cannot be on (no import here:
    importing dynamo costs seconds)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False)
                                   or getattr(ca, "in_compiled_autograd_region", False))


# -- grad mode, fused checks ------------------------------------------------------------------


def _set_grad_enabled_fallback(mode: bool) -> None:
    torch.set_grad_enabled(mode)  # the call itself sets the mode


#: ``amp_nonfinite_check_(tensors, found, inv_scale)``: the fused kernel, or None.
amp_nonfinite_check_: Callable[..., None] | None = None


def flag_nonfinite_(group: Sequence[Tensor], found: Tensor) -> bool:
    """Set ``found`` (a 0-d float32 tensor on the tensors' device) to 1 if an element of
    ``group`` (float32 or float64 tensors of one dtype) is NaN or +-Inf; leave it alone
    otherwise. One fused pass, no output per tensor, no host sync. False when the list is not
    such a list, the kernel refuses it or this torch lacks it (``found`` then says nothing).

    The pass is the check torch's GradScaler runs (``_amp_foreach_non_finite_check_and_unscale_``)
    with an inverse scale of exactly 1, for which it writes every value back as it was, bit for
    bit. Where that kernel moves version counters (which autograd checks), it goes through
    ``.data`` aliases, so that the tensors' own counters do not move.
    """
    if not group:
        return True
    kernel = amp_nonfinite_check_
    if kernel is None:
        warn_fallback("torch._amp_foreach_non_finite_check_and_unscale_")
        return False
    dtypes = {t.dtype for t in group}
    if len(dtypes) != 1 or group[0].dtype not in (torch.float32, torch.float64):
        return False  # e.g. a part of the model cast since the list was formed
    one = _ONES.get(found.device)
    if one is None:
        one = _ONES[found.device] = torch.ones((), dtype=torch.float32, device=found.device)
    tensors = (group if isinstance(group, list) else list(group)) if not _kernel_moves_versions() \
        else [t.data for t in group]
    try:
        kernel(tensors, found, one)
    except (RuntimeError, NotImplementedError):
        return False
    return True


#: The inverse scale of 1 that :func:`flag_nonfinite_` passes, one per device (never written).
_ONES: dict[torch.device, Tensor] = {}
_MOVES_VERSIONS: list[bool] = []


def _kernel_moves_versions() -> bool:
    """Whether the fused check moves its tensors' version counters in this build of torch
    (asked once, on a tensor of its own)."""
    if not _MOVES_VERSIONS:
        probe = torch.zeros(1)
        try:
            amp_nonfinite_check_([probe], torch.zeros(1), torch.ones(1))  # type: ignore[misc]
        except (RuntimeError, NotImplementedError):
            return True  # the callers' pass will be refused too; ask again next time
        _MOVES_VERSIONS.append(probe._version != 0)
    return _MOVES_VERSIONS[0]


# -- GradScaler internals ---------------------------------------------------------------------


def scaler_scale(scaler: Any) -> Tensor:
    """The scale of ``scaler``'s step as a 0-dim float32 tensor (no host read where torch keeps
    it as one; before the first ``scale()``, the scale it will use)."""
    if available("torch.amp.GradScaler._scale"):
        current = vars(scaler).get("_scale")
        if current is not None:
            return current.detach().reshape(()).float()
    else:
        warn_fallback("torch.amp.GradScaler._scale")
    return torch.tensor(float(scaler.get_scale()), dtype=torch.float32)


def scaler_optimizer_state(scaler: Any, optimizer: Any) -> tuple[list[Tensor], bool] | None:
    """What ``scaler`` holds for ``optimizer`` in this step: its found-inf tensors and whether
    its gradients were unscaled already; None where it holds nothing (or this torch does not
    say)."""
    if not available("torch.amp.GradScaler._per_optimizer_states"):
        warn_fallback("torch.amp.GradScaler._per_optimizer_states")
        return None
    state = scaler._per_optimizer_states.get(id(optimizer))
    if state is None:
        return None
    from torch.amp.grad_scaler import OptState
    return list(state["found_inf_per_device"].values()), state["stage"] is not OptState.READY


def steps_with_scale(optimizer: Any) -> bool:
    """Whether ``optimizer`` takes the scale and unscales as it steps (torch's fused
    optimizers): its gradients are still scaled when its ``step()`` starts."""
    if not available("torch.optim.Optimizer._step_supports_amp_scaling"):
        return False
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def scaler_found_infs(scaler: Any) -> dict[int, list[Tensor]]:
    """Every optimizer's found-inf tensors in ``scaler`` (by optimizer id), before ``update()``
    sums them in place; empty where this torch does not say."""
    if not available("torch.amp.GradScaler._per_optimizer_states"):
        warn_fallback("torch.amp.GradScaler._per_optimizer_states")
        return {}
    return {key: list(state["found_inf_per_device"].values())
            for key, state in scaler._per_optimizer_states.items()}


# -- saved tensors, version counters, compiled wrappers ---------------------------------------


def saved_tensors_readable() -> bool:
    """Whether this torch says which saved tensors unpack through a hook; where it does not,
    none is read (reading one could run an activation checkpoint's recomputation)."""
    if available("torch._C._autograd.SavedTensor.unpack_hook"):
        return True
    warn_fallback("torch._C._autograd.SavedTensor.unpack_hook")
    return False


def saved_tensor_hook_known(raw: Any) -> bool | None:
    """Whether the saved tensor ``raw`` (a ``_raw_saved_*`` value) unpacks through a hook; None
    where this torch does not say."""
    if not available("torch._C._autograd.SavedTensor.unpack_hook"):
        return None
    return raw.unpack_hook is not None


def restore_version(t: Tensor, version: int) -> bool:
    """Put ``t``'s version counter back to ``version``; False where this torch cannot (the
    caller then uses its fallback: see :func:`available`)."""
    setter = _lookup("torch._C._autograd._unsafe_set_version_counter")
    if setter is None:
        return False
    setter((t,), (version,))
    return True


def clear_post_accumulate_hooks(p: Tensor) -> None:
    """Leave ``p`` as it was before ``register_post_accumulate_grad_hook`` (which leaves an
    empty dict behind once its hooks are removed)."""
    if available("torch.Tensor._post_accumulate_grad_hooks") and \
            not p._post_accumulate_grad_hooks:
        p._post_accumulate_grad_hooks = None  # type: ignore[assignment]


def compiled_call(module: Any) -> Any:
    """What ``module.compile()`` made ``module`` call instead of its own call (None when it is
    not compiled in place). A torch without ``Module.compile()`` has no such attribute."""
    if not available("torch.nn.Module._compiled_call_impl"):
        return None
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: Any, call: Any) -> None:
    """Make ``module`` call ``call`` instead of its own call (None: its own call)."""
    module._compiled_call_impl = call


def is_compile_wrapper(module: Any) -> bool:
    """Whether ``module`` is ``torch.compile``'s wrapper of another module (asked only once
    torch's compiler has been imported: no model is compiled before)."""
    if "torch._dynamo" not in sys.modules:
        return False
    cls = _lookup("torch._dynamo.eval_frame.OptimizedModule")
    if cls is not None:
        return isinstance(module, cls)
    return "_orig_mod" in getattr(module, "_modules", {})


# -- binding ----------------------------------------------------------------------------------

graph_task_id: Callable[[], int]
sequence_nr: Callable[[], int]
current_node: Callable[[], Any]
set_grad_enabled: Callable[[bool], None]
AccumulateGrad: Any  # the type of a leaf's gradient node


def _bind() -> None:
    """(Re)bind the module's functions to torch's private APIs or their fallbacks."""
    g = globals()
    g["graph_task_id"] = _lookup("torch._C._current_graph_task_id") or _task_fallback
    g["sequence_nr"] = _lookup("torch._C._autograd._get_sequence_nr") or _sequence_fallback
    g["current_node"] = _lookup("torch._C._current_autograd_node") or _no_node
    g["set_grad_enabled"] = _lookup("torch._C._set_grad_enabled") or _set_grad_enabled_fallback
    g["AccumulateGrad"] = _lookup("torch._C._functions.AccumulateGrad") or _accumulate_grad_type()
    g["amp_nonfinite_check_"] = _lookup("torch._amp_foreach_non_finite_check_and_unscale_")


_bind()


@contextlib.contextmanager
def missing(*paths: str) -> Iterator[None]:
    """Run the block as on a torch without the private APIs ``paths`` (for tests of the
    fallbacks); the fallbacks' warnings are said again inside it."""
    unknown = [p for p in paths if p not in APIS]
    if unknown:
        raise ValueError(f"not a private API gradtap uses: {unknown}; known: {sorted(APIS)}")
    hidden, warned = set(_HIDDEN), set(_WARNED)
    _HIDDEN.update(paths)
    _WARNED.difference_update(paths)
    _bind()
    try:
        yield
    finally:
        _HIDDEN.clear()
        _HIDDEN.update(hidden)
        _WARNED.clear()
        _WARNED.update(warned)
        _bind()
