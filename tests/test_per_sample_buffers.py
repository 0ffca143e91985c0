"""Result buffers reused across backwards (``gradtap._samples.buffers``).

The contract: a backward reuses the memory of an earlier backward's per-sample gradients only
when nothing but the pool refers to it; results the user holds (the tensors, views of them,
their storage, numpy arrays) are never written into. Every result is checked against a
``torch.func.vmap(grad(...))`` oracle, in float64.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import gradtap as gt
from gradtap._samples import buffers

pytestmark = pytest.mark.usefixtures("float64_seeded")

N, T = 4, 3


class Net(nn.Module):
    """An embedding and two Linear layers over a sequence (per-sample weights by bmm)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(self.emb(tokens)))).mean(1)


def _batch(seed: int, n: int = N) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 7, (n, T), generator=g), torch.randint(0, 3, (n,), generator=g)


def _oracle(model: nn.Module, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    ref = Net()  # without the hooks of an open per_sample
    ref.load_state_dict(model.state_dict())
    model = ref
    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p: dict[str, Tensor], xn: Tensor, yn: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (xn[None],)), yn[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def _step(model: nn.Module, seed: int, own_grad: bool, n: int = N) -> dict[str, Tensor]:
    """One backward with a handle made for it; its per-sample gradients, checked."""
    x, y = _batch(seed, n)
    with gt.per_sample(model, quantities=("grad",), own_grad=own_grad) as ps:
        F.cross_entropy(model(x), y).backward()
        got = ps.grad
    model.zero_grad(set_to_none=True)
    want = _oracle(model, x, y)
    for k, g in got.items():
        torch.testing.assert_close(g, want[k], rtol=1e-10, atol=1e-12, msg=k)
    return got


@pytest.mark.parametrize("own_grad", [False, True])
def test_dropped_results_are_reused_held_ones_are_not(own_grad: bool) -> None:
    model = Net()
    first = _step(model, 0, own_grad)
    kept = {k: g.clone() for k, g in first.items()}
    ptrs = {k: g.data_ptr() for k, g in first.items()}
    second = _step(model, 1, own_grad)  # `first` is held: new memory, `first` untouched
    for k in first:
        assert second[k].data_ptr() != ptrs[k], k
        torch.testing.assert_close(first[k], kept[k], rtol=0, atol=0, msg=k)
    ptrs = {k: g.data_ptr() for k, g in second.items()}
    del second
    third = _step(model, 2, own_grad)  # `second` dropped: its memory again, for the weights
    for k in ("emb.weight", "a.weight", "b.weight"):
        assert third[k].data_ptr() == ptrs[k], k
    for k in first:  # still untouched
        torch.testing.assert_close(first[k], kept[k], rtol=0, atol=0, msg=k)


def _holder(g: Tensor, hold: str) -> object:
    """Something other than ``g`` itself that holds its memory."""
    if hold == "view":
        return g.view(-1)
    if hold == "slice":
        return g[1:]
    if hold == "storage":
        return g.untyped_storage()
    if hold == "numpy":
        return g.numpy()
    return g.detach()


def _held(holder: object, hold: str, like: Tensor) -> Tensor:
    """What ``holder`` holds, as a tensor shaped as ``like`` (its last rows for a slice)."""
    if hold == "storage":
        return torch.empty(0, dtype=like.dtype).set_(holder, 0, like.shape)  # type: ignore[arg-type]
    t = torch.from_numpy(holder) if hold == "numpy" else holder  # type: ignore[arg-type]
    assert isinstance(t, Tensor)
    return t if hold == "slice" else t.view(like.shape)


@pytest.mark.parametrize("hold", ["view", "slice", "storage", "numpy", "detached"])
def test_memory_held_through_another_object_is_not_reused(hold: str) -> None:
    model = Net()
    g = _step(model, 0, True)["a.weight"]
    kept, ptr = g.clone(), g.data_ptr()
    holder = _holder(g, hold)
    del g
    again = _step(model, 1, True)["a.weight"]
    assert again.data_ptr() != ptr
    want = kept[1:] if hold == "slice" else kept
    torch.testing.assert_close(_held(holder, hold, kept), want, rtol=0, atol=0)


def test_results_are_tensors_of_their_own() -> None:
    model = Net()
    _step(model, 0, True)
    got = _step(model, 1, True)  # on reused memory
    for k in ("a.weight", "b.weight"):  # (Embedding's is a view of its [N * V, D] rows)
        assert got[k]._base is None and got[k].is_contiguous(), k


def test_a_persistent_handle_reuses_after_clear_and_keeps_only_the_last_backward() -> None:
    model = Net()
    ps = gt.per_sample(model, quantities=("grad",), own_grad=True)
    try:
        ptr = None
        for seed in range(3):
            ps.clear()
            x, y = _batch(seed)
            F.cross_entropy(model(x), y).backward()
            g = ps.grad["a.weight"]
            torch.testing.assert_close(g, _oracle(model, x, y)["a.weight"])
            assert ptr is None or g.data_ptr() == ptr
            ptr = g.data_ptr()
            del g
            model.zero_grad(set_to_none=True)
        pool = buffers.pool_for(model)
        ps.clear()
        x, y = _batch(5, n=2)  # another batch size: the pool keeps only these shapes
        F.cross_entropy(model(x), y).backward()
        torch.testing.assert_close(ps.grad["b.weight"], _oracle(model, x, y)["b.weight"])
        sizes = [p.numel() * 2 * 8 for p in (model.emb.weight, model.a.weight, model.b.weight)]
        assert sorted(pool._buckets) == sorted(sizes) and pool.bytes == sum(sizes)
    finally:
        ps.remove()


def test_memory_resized_through_a_result_is_not_handed_out() -> None:
    model = Net()
    g = _step(model, 0, False)["a.weight"]
    g.resize_(1000)  # its memory is reallocated, at another size
    del g
    _step(model, 1, False)  # checked against the oracle


def test_the_cap_and_the_model_bound_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Net()
    monkeypatch.setattr(buffers, "CAP", 0)
    _step(model, 0, True)
    assert len(buffers.pool_for(model)) == 0
    monkeypatch.undo()
    _step(model, 1, True)
    pool = weakref.ref(buffers.pool_for(model))
    assert len(pool()) == 3  # type: ignore[arg-type]
    del model
    gc.collect()
    assert pool() is None
