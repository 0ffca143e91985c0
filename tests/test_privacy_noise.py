"""The Gaussian noise of a DP-SGD step: its standard deviation, fresh draws, seeded draws that
repeat, each tensor's device and dtype; and under gloo ranks, the same draw on every rank."""

from __future__ import annotations

import pytest
import torch

from gradtap._privacy.noise import add_gaussian_noise_, gaussian_noise, shared_generator
from tests._dist import gloo_available, run_ranks

SHAPES = [(300, 400), (60_000,), (20, 30, 50)]  # 210k elements


def _flat(noise: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([n.double().flatten() for n in noise])


def test_standard_deviation_and_independence_on_large_tensors(device):
    std = 0.7
    tensors = [torch.zeros(s, device=device) for s in SHAPES]
    x = _flat(gaussian_noise(tensors, std, generator=None))
    n = x.numel()
    # the sample std's own standard deviation is std / sqrt(2n) (0.15% here)
    assert x.std().item() == pytest.approx(std, rel=0.01)
    assert abs(x.mean().item()) < 6 * std / n ** 0.5
    # neighbouring elements (within and across tensors) uncorrelated
    z = x / std
    assert abs((z[1:] * z[:-1]).mean().item()) < 6 / n ** 0.5
    # Gaussian tails: P(|z| > 2) = 4.55%
    assert (z.abs() > 2).double().mean().item() == pytest.approx(0.0455, abs=6 * (0.0455 / n) ** 0.5)


def test_fresh_each_call_and_repeated_with_a_seeded_generator():
    tensors = [torch.zeros(s) for s in SHAPES]
    a, b = _flat(gaussian_noise(tensors, 1.0)), _flat(gaussian_noise(tensors, 1.0))
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02
    g = torch.Generator().manual_seed(5)
    first, second = gaussian_noise(tensors, 1.0, g), gaussian_noise(tensors, 1.0, g)
    assert not torch.equal(_flat(first), _flat(second))
    again = gaussian_noise(tensors, 1.0, torch.Generator().manual_seed(5))
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    # two tensors of one shape get their own draws
    p, q = gaussian_noise([torch.zeros(100), torch.zeros(100)], 1.0, g)
    assert not torch.equal(p, q)


def test_each_tensor_keeps_its_dtype_and_device(device):
    tensors = [torch.zeros(3, 4, device=device, dtype=dt)
               for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)]
    g = torch.Generator().manual_seed(0)
    noise = gaussian_noise(tensors, 2.0, g)
    for t, n in zip(tensors, noise):
        assert n.shape == t.shape and n.dtype == t.dtype and n.device == t.device
        assert n.data_ptr() != t.data_ptr()
    # drawn on the generator's device in float32 or wider, scaled, then cast
    g = torch.Generator().manual_seed(0)
    want = [2.0 * torch.randn(3, 4, generator=g, dtype=torch.promote_types(t.dtype, torch.float32))
            for t in tensors]
    for n, w in zip(noise, want):
        torch.testing.assert_close(n.cpu(), w.to(n.dtype), rtol=0, atol=0)
    assert all(torch.equal(n, torch.zeros_like(n)) for n in gaussian_noise(tensors, 0.0))


def test_added_in_place_the_same_draws_in_the_same_order(device):
    # The step adds its noise one tensor at a time: the same draws as gaussian_noise (same
    # generator state, same order), each added to its tensor, in its dtype.
    tensors = [torch.randn(s, device=device) for s in SHAPES] + [
        torch.randn(7, dtype=torch.float64, device=device)]
    noisy = [t.clone() for t in tensors]
    add_gaussian_noise_(noisy, 1.3, torch.Generator(device=device).manual_seed(11))
    noise = gaussian_noise(tensors, 1.3, torch.Generator(device=device).manual_seed(11))
    for t, n, got in zip(tensors, noise, noisy, strict=True):
        assert got.dtype == t.dtype
        assert torch.equal(got, t + n)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a floating-point tensor"):
        add_gaussian_noise_([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], 1.0)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"std \(the noise's standard deviation\) must be in \[0, inf\)"):
        gaussian_noise([torch.zeros(2)], -1.0)
    with pytest.raises(TypeError, match=r"tensors\[1\] must be a floating-point tensor, got a torch.int64"):
        gaussian_noise([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], 1.0)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        gaussian_noise([torch.zeros(2)], 1.0, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\) or None, got -1"):
        shared_generator(seed=-1)


def test_shared_generator_without_a_process_group():
    assert shared_generator(seed=11).initial_seed() == 11
    assert shared_generator().initial_seed() != shared_generator().initial_seed()


def _ranks_draw(rank: int, world: int) -> dict:
    """Two shared generators (fresh seeds from rank 0) and the noise each draws on this rank;
    then an unshared draw (each rank's own default generator, seeded by rank)."""
    torch.manual_seed(rank)
    tensors = [torch.zeros(s) for s in [(64, 32), (100,)]]
    out = {}
    for name in ("first", "second"):
        g = shared_generator()
        out[name] = {"seed": g.initial_seed(),
                     "noise": torch.cat([n.flatten() for n in gaussian_noise(tensors, 1.5, g)])}
    out["own"] = torch.cat([n.flatten() for n in gaussian_noise(tensors, 1.5)])
    return out


def test_ranks_draw_the_same_noise_from_a_shared_generator():
    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not in this torch build")
    r0, r1 = run_ranks(_ranks_draw, 2, timeout=90)
    for name in ("first", "second"):
        assert r0[name]["seed"] == r1[name]["seed"]
        assert r0[name]["noise"] == r1[name]["noise"]
        g = torch.Generator().manual_seed(r0[name]["seed"])  # the oracle: the seed's own draw
        want = torch.cat([1.5 * torch.randn(64, 32, generator=g).flatten(),
                          1.5 * torch.randn(100, generator=g)])
        assert torch.tensor(r0[name]["noise"]).tolist() == want.tolist()
    assert r0["first"]["seed"] != r0["second"]["seed"]
    assert r0["own"] != r1["own"]  # what unshared generators would have added
