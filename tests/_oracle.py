"""An independent oracle for per-call gradient records.

For one target module, a second run adds a zero leaf tensor ``z`` to every tensor argument
that requires grad, to every output, and to every parameter under the module while it runs;
``torch.autograd.grad(loss, z)`` then is exactly "the gradient via this call" of that slot.
Argument names come from ``inspect.signature(...).bind`` and outputs are named here, so the
naming is checked independently of gradtap's own flattening.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def _named_leaves(obj: Any, path: str, out: dict[str, Tensor]) -> None:
    if isinstance(obj, Tensor):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _named_leaves(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            _named_leaves(v, f"{path}.{i}" if path else str(i), out)


def _shift(obj: Any, zeros: dict[str, Tensor], path: str) -> Any:
    """Return obj with ``t + z`` for each grad-requiring tensor leaf, recording the z leaves."""
    if isinstance(obj, Tensor):
        if obj.requires_grad:
            zeros[path] = z = torch.zeros_like(obj, requires_grad=True)
            return obj + z
        return obj
    if isinstance(obj, dict):
        return {k: _shift(v, zeros, f"{path}.{k}" if path else str(k)) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_shift(v, zeros, f"{path}.{i}" if path else str(i)) for i, v in enumerate(obj)]
        return type(obj)(items) if isinstance(obj, list) else tuple(items)
    return obj


def oracle_calls(
    model: nn.Module, target: str, run: Callable[[], Tensor]
) -> list[dict[str, dict[str, Tensor | None]]]:
    """Run ``run()`` (forward + scalar loss) once, returning per-call gradients of ``target``."""
    module = dict(model.named_modules())[target]
    sig = inspect.signature(module.forward)
    calls: list[dict[str, Any]] = []
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple:
        bound = sig.bind(*args, **kwargs)
        zin: dict[str, Tensor] = {}
        for name, value in list(bound.arguments.items()):
            kind = sig.parameters[name].kind
            if kind == inspect.Parameter.VAR_KEYWORD:
                bound.arguments[name] = {k: _shift(v, zin, k) for k, v in value.items()}
            else:
                # *args are named "<name>.<i>" and tuples nested under their argument's name.
                bound.arguments[name] = _shift(value, zin, name)
        zpar: dict[str, Tensor] = {}
        if not isinstance(mod, nn.RNNBase):
            # One zero leaf per parameter object, named by its first name (tied weights share it).
            first_name = {id(p): n for n, p in mod.named_parameters()}
            by_id: dict[int, Tensor] = {}
            for sub in mod.modules():
                for p_name, p in list(sub._parameters.items()):
                    if p is None or not p.requires_grad:
                        continue
                    if id(p) not in by_id:
                        by_id[id(p)] = zpar[first_name[id(p)]] = torch.zeros_like(p, requires_grad=True)
                    swapped.append((sub, p_name, p))
                    sub._parameters[p_name] = p + by_id[id(p)]  # type: ignore[assignment]
        calls.append({"zin": zin, "zpar": zpar, "params": dict(mod.named_parameters())})
        return bound.args, bound.kwargs

    def post(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        while swapped:
            sub, p_name, p = swapped.pop()
            sub._parameters[p_name] = p
        zout: dict[str, Tensor] = {}
        shifted = _shift(output, zout, "output" if isinstance(output, Tensor) else "")
        calls[-1]["zout"] = zout
        calls[-1]["param_names"] = [n for n, _ in mod.named_parameters()]
        return shifted

    h1 = module.register_forward_pre_hook(pre, with_kwargs=True)
    h2 = module.register_forward_hook(post, with_kwargs=True)
    try:
        loss = run()
    finally:
        h1.remove()
        h2.remove()
    leaves: list[Tensor] = []
    for c in calls:
        leaves += list(c["zin"].values()) + list(c["zpar"].values()) + list(c["zout"].values())
    rnn_params = []
    if isinstance(module, nn.RNNBase):
        rnn_params = [p for p in module.parameters() if p.requires_grad]
    if not leaves + rnn_params:  # never called, or nothing in the call requires grad
        grads: tuple = ()
    else:
        grads = torch.autograd.grad(loss, leaves + rnn_params, allow_unused=True)
    it = iter(grads)
    result = []
    for c in calls:
        gin = {k: next(it) for k in c["zin"]}
        gpar = {k: next(it) for k in c["zpar"]}
        gout = {k: next(it) for k in c["zout"]}
        result.append({"grad_inputs": gin, "param_grads": gpar, "grad_outputs": gout,
                       "param_names": c["param_names"]})
    if rnn_params:
        assert len(calls) == 1, "the RNN oracle covers a single call"
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        result[0]["param_grads"] = {n: next(it) for n in names}
    return result


def assert_close_or_none(actual: Tensor | None, expected: Tensor | None, what: str,
                         atol: float = 1e-10, rtol: float = 1e-8) -> None:
    """Both None, or both tensors and close."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: {actual} vs oracle {expected}"
        return
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
