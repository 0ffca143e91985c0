"""hvp, hessian_trace and top_eigenvalue against torch.func.hessian of tiny conv nets (float64)."""

from __future__ import annotations

import doctest
import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

import gradtap as gt
from gradtap.errors import SelectionError

DT = torch.float64



def tiny_net(seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(),
        nn.Conv2d(2, 4, 2, stride=2, groups=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(4 * 3 * 3, 3),
    ).to(DT)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return (
        model,
        torch.randn(3, 1, 6, 6, generator=g, dtype=DT),
        torch.randint(0, 3, (3,), generator=g),
    )


def exact_hessian(model: nn.Module, x: Tensor, y: Tensor, names: list[str]) -> Tensor:
    """The Hessian of the loss w.r.t. the named parameters (flattened, in order), by torch.func."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    shapes = [params[n].shape for n in names]
    flat = torch.cat([params[n].detach().flatten() for n in names])

    def loss(flat: Tensor) -> Tensor:
        chunks = flat.split([math.prod(s) for s in shapes])
        override = {n: c.view(s) for n, c, s in zip(names, chunks, shapes, strict=True)}
        return F.cross_entropy(functional_call(model, {**params, **override}, (x,)), y)

    return torch.func.hessian(loss)(flat)


def split(flat: Tensor, model: nn.Module, names: list[str]) -> list[Tensor]:
    params = dict(model.named_parameters())
    chunks = flat.split([params[n].numel() for n in names])
    return [c.view(params[n].shape) for n, c in zip(names, chunks, strict=True)]


def flatten(tensors: list[Tensor]) -> Tensor:
    return torch.cat([t.flatten() for t in tensors])


def close(actual: Tensor, expected: Tensor, atol: float = 1e-10) -> None:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual, expected, rtol=0.0, atol=atol)


@pytest.mark.parametrize("explicit", [False, True], ids=["native", "explicit"])
def test_hvp_matches_torch_func_hessian(explicit: bool) -> None:
    model, x, y = tiny_net()
    names = [n for n, _ in model.named_parameters()]
    H = exact_hessian(model, x, y, names)
    v = torch.randn(H.shape[0], dtype=DT, generator=torch.Generator().manual_seed(1))

    if explicit:
        with gt.explicit_conv(model):
            loss = F.cross_entropy(model(x), y)
    else:
        loss = F.cross_entropy(model(x), y)
    out = gt.hvp(loss, model, split(v, model, names))
    assert isinstance(out, list)
    close(flatten(out), H @ v)
    # The graph is kept by default: a second product and a backward still work.
    close(flatten(gt.hvp(loss, model, split(2 * v, model, names))), 2 * (H @ v))
    loss.backward()


def test_hvp_on_selected_layers_and_input_forms() -> None:
    model, x, y = tiny_net(1)
    block = ["2.weight", "2.bias"]
    H = exact_hessian(model, x, y, block)
    v = torch.randn(H.shape[0], dtype=DT, generator=torch.Generator().manual_seed(2))
    vs = split(v, model, block)

    loss = F.cross_entropy(model(x), y)
    by_name = gt.hvp(loss, model, dict(zip(block, vs, strict=True)), select="2.*")
    assert isinstance(by_name, dict) and list(by_name) == block
    close(flatten([by_name[n] for n in block]), H @ v)
    close(
        flatten(gt.hvp(loss, model[2], dict(zip(["weight", "bias"], vs, strict=True))).values()),
        H @ v,
    )  # type: ignore[union-attr]
    close(flatten(gt.hvp(loss, [model[2].weight, model[2].bias], vs)), H @ v)

    w_only = exact_hessian(model, x, y, ["2.weight"])
    lone = gt.hvp(loss, model[2].weight, vs[0])
    assert isinstance(lone, Tensor)
    close(lone.flatten(), w_only @ vs[0].flatten())


def test_hvp_of_a_parameter_outside_the_graph_is_zero() -> None:
    model, x, y = tiny_net()
    unused = torch.randn(4, dtype=DT, requires_grad=True)
    linear_only = torch.randn(3, dtype=DT, requires_grad=True)
    loss = F.cross_entropy(model(x), y) + (linear_only * 2.0).sum()
    out = gt.hvp(
        loss,
        [model[5].bias, unused, linear_only],
        [torch.ones(3, dtype=DT), torch.ones(4, dtype=DT), torch.ones(3, dtype=DT)],
    )
    assert torch.equal(out[1], torch.zeros(4, dtype=DT))
    assert torch.equal(out[2], torch.zeros(3, dtype=DT))
    H = exact_hessian(model, x, y, ["5.bias"])
    close(out[0], H @ torch.ones(3, dtype=DT))


def _hutchinson_bound(H: Tensor, rows: slice, samples: int) -> float:
    """Five standard errors of the Rademacher estimate of the trace of the block ``H[rows, rows]``.

    The block estimate is ``v_b^T (H v)_b``; its variance is ``2 * sum H_ij^2`` over pairs
    ``i != j`` inside the block plus ``sum H_ij^2`` over ``i`` inside and ``j`` outside.
    """
    off = H - torch.diag(torch.diagonal(H))
    inside = off[rows, rows].square().sum()
    across = off[rows, :].square().sum() - inside
    return 5.0 * math.sqrt(float(2.0 * inside + across) / samples) + 1e-9


@pytest.mark.parametrize(
    ("explicit", "samples"), [(False, 200), (True, 60)], ids=["native", "explicit"]
)
def test_hessian_trace_matches_torch_func_hessian(explicit: bool, samples: int) -> None:
    model, x, y = tiny_net(2)
    names = [n for n, _ in model.named_parameters()]
    H = exact_hessian(model, x, y, names)

    def loss_fn() -> Tensor:
        return F.cross_entropy(model(x), y)

    if explicit:
        with gt.explicit_conv(model):
            blocks = gt.hessian_trace(loss_fn, model, samples=samples, per_param=True, seed=3)
    else:
        blocks = gt.hessian_trace(loss_fn, model, samples=samples, per_param=True, seed=3)
    assert isinstance(blocks, dict) and list(blocks) == names
    everything = slice(0, H.shape[0])
    assert abs(sum(blocks.values()) - float(torch.trace(H))) <= _hutchinson_bound(
        H, everything, samples
    )
    start = 0
    for name, p in model.named_parameters():
        rows = slice(start, start + p.numel())
        assert abs(blocks[name] - float(torch.trace(H[rows, rows]))) <= _hutchinson_bound(
            H, rows, samples
        ), name
        start += p.numel()


def test_hessian_trace_total_blocks_and_seed() -> None:
    model, x, y = tiny_net(2)

    def loss_fn() -> Tensor:
        return F.cross_entropy(model(x), y)

    total = gt.hessian_trace(loss_fn, model, samples=4, seed=3)
    blocks = gt.hessian_trace(loss_fn, model, samples=4, per_param=True, seed=3)
    assert isinstance(total, float) and isinstance(blocks, dict)
    assert math.isclose(sum(blocks.values()), total, rel_tol=1e-12, abs_tol=1e-12)
    # Seeded: the same seed repeats the estimate, another seed gives another one.
    assert gt.hessian_trace(loss_fn, model, samples=4, seed=3) == total
    assert gt.hessian_trace(loss_fn, model, samples=4, seed=4) != total


def test_hessian_trace_is_exact_for_a_diagonal_hessian() -> None:
    # Rademacher probes give v^T H v = tr(H) exactly when H is diagonal.
    w = torch.randn(2, 3, 4, dtype=DT, generator=torch.Generator().manual_seed(5)).requires_grad_()
    b = torch.randn(5, dtype=DT, generator=torch.Generator().manual_seed(6)).requires_grad_()

    def loss_fn() -> Tensor:
        return w.sin().sum() + (b**4).sum()

    H = torch.func.hessian(lambda w, b: w.sin().sum() + (b**4).sum(), argnums=(0, 1))(
        w.detach(), b.detach()
    )
    tr_w = float(torch.diagonal(H[0][0].reshape(24, 24)).sum())
    tr_b = float(torch.diagonal(H[1][1]).sum())
    got = gt.hessian_trace(loss_fn, {"w": w, "b": b}, samples=3, per_param=True)
    assert got == pytest.approx({"w": tr_w, "b": tr_b}, rel=1e-12)


@pytest.mark.parametrize(("select", "explicit"), [(None, False), ("0.*", False), (None, True)])
def test_top_eigenvalue_matches_eigvalsh(select: str | None, explicit: bool) -> None:
    model, x, y = tiny_net(3)
    names = [n for n, _ in model.named_parameters() if select is None or n.startswith("0.")]
    eig = torch.linalg.eigvalsh(exact_hessian(model, x, y, names))
    expected = float(eig[eig.abs().argmax()])

    def loss_fn() -> Tensor:
        return F.cross_entropy(model(x), y)

    if explicit:
        with gt.explicit_conv(model):
            got = gt.top_eigenvalue(loss_fn, model, iters=3000, tol=1e-13, select=select)
    else:
        got = gt.top_eigenvalue(loss_fn, model, iters=3000, tol=1e-13, select=select)
    assert got == pytest.approx(expected, rel=1e-6)


def test_top_eigenvalue_keeps_the_sign_and_handles_a_zero_hessian() -> None:
    w = torch.tensor([1.0, 0.5, -0.2], dtype=DT, requires_grad=True)
    # H = diag(-6 w0, -6 w1, -6 w2) from -(w^3): the dominant eigenvalue is -6.
    assert gt.top_eigenvalue(lambda: -(w**3).sum(), [w], iters=500, tol=1e-14) == pytest.approx(
        -6.0, rel=1e-9
    )
    assert gt.top_eigenvalue(lambda: (3.0 * w).sum(), [w]) == 0.0


def _loss_and_model() -> tuple[Tensor, nn.Module]:
    model, x, y = tiny_net()
    return F.cross_entropy(model(x), y), model


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: gt.hvp(torch.ones(2, requires_grad=True) * 2, [torch.ones(2, requires_grad=True)], [torch.ones(2)]), ValueError, "loss must be a scalar tensor, got shape"),
        (lambda: gt.hvp(torch.tensor(1.0), [torch.ones(2, requires_grad=True)], [torch.ones(2)]), ValueError, "does not require grad"),
        (lambda: gt.hvp(*_loss_and_model(), [torch.ones(1)]), ValueError, "got 1 vectors for 6 parameters"),
        (lambda: gt.hvp(*_loss_and_model(), {"0.weight": torch.ones(1)}), ValueError, r"missing \['0.bias'"),
        (lambda: gt.hvp(_loss_and_model()[0], _loss_and_model()[1][0].weight, torch.ones(3)), ValueError, r"vector for parameter '0' must have shape \(2, 1, 3, 3\)"),
        (lambda: gt.hvp(_loss_and_model()[0], [torch.ones(2)], [torch.ones(2)]), ValueError, "parameter '0' does not require grad"),
        (lambda: gt.hvp(_loss_and_model()[0], [torch.ones(2, requires_grad=True)], [torch.ones(2)], select="*"), TypeError, "select= needs params to be an nn.Module"),
        (lambda: gt.hvp(*_loss_and_model(), [], select="conv9.*"), SelectionError, "conv9"),
        (lambda: gt.hvp(_loss_and_model()[0], 3, [torch.ones(2)]), TypeError, "params must be an nn.Module"),
        (lambda: gt.hessian_trace(lambda: torch.tensor(1.0), [torch.ones(1, requires_grad=True)], samples=0), ValueError, "samples must be a positive int"),
        (lambda: gt.top_eigenvalue(lambda: torch.tensor(1.0), [torch.ones(1, requires_grad=True)], iters=0), ValueError, "iters must be a positive int"),
        (lambda: gt.top_eigenvalue(lambda: torch.ones(2), [torch.ones(1, requires_grad=True)]), ValueError, "loss must be a scalar"),
    ],
)  # fmt: skip
def test_errors_name_what_was_expected(call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize(
    "name", ["gradtap.curvature", "gradtap.functional._conv", "gradtap.functional.explicit"]
)
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(
        importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.attempted > 0 and result.failed == 0
