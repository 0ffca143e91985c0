"""The Gaussian noise of a DP-SGD step: :func:`gaussian_noise` (:func:`add_gaussian_noise_` adds
it in place), and :func:`shared_generator` for drawing it once for a whole distributed job.

Under DDP every rank holds the same all-reduced clipped sum, and the job must add one draw of
noise to it, not one per rank (independent draws on ``W`` ranks would average to noise of
standard deviation ``1/sqrt(W)`` of the intended one, and leave the ranks' parameters apart).
Two ways give every rank the same draw: draw on one rank and broadcast it (a collective of
the model's size every step), or draw on every rank from generators seeded alike (no
communication after the seed). :func:`shared_generator` does the second: rank 0 of the group
picks the seed (from ``secrets`` unless one is given) and broadcasts it once; the ranks' draws
then agree as long as they draw the same shapes in the same order, which the identical
replicas of DDP do. Keep the seed secret: whoever knows it knows the noise. ``dp_sgd``
itself does the first without its cost: rank 0 adds its draw to its own clipped sum before
the all-reduce of the ranks' sums, which it needs anyway (:mod:`.distributed`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from gradtap._privacy.checks import check_number

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["add_gaussian_noise_", "gaussian_noise", "shared_generator"]


def gaussian_noise(tensors: Sequence[Tensor], std: float,
                   generator: torch.Generator | None = None) -> list[Tensor]:
    """A fresh tensor like each of ``tensors`` (its shape, device and dtype), each element an
    independent draw of ``N(0, std^2)``.

    The draws come from ``generator`` on its device (then move to the tensor's), or from
    torch's default generator of each tensor's device when ``None``; each is made in the
    tensor's dtype or float32, whichever is wider, then cast. Every tensor draws its own
    elements, in the order given, so a generator seeded alike gives the same noise.

    >>> import torch
    >>> from gradtap._privacy.noise import gaussian_noise
    >>> g = torch.Generator().manual_seed(0)
    >>> a, b = gaussian_noise([torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)], 0.5, g)
    >>> a.shape, b.dtype
    (torch.Size([2, 3]), torch.float64)
    """
    sigma = _checked(tensors, std, generator)
    return [_draw(t, sigma, generator) for t in tensors]


def add_gaussian_noise_(tensors: Sequence[Tensor], std: float,
                        generator: torch.Generator | None = None) -> None:
    """Add to each of ``tensors``, in place, the draw :func:`gaussian_noise` would give it
    (the same draws, in the same order), one tensor's draw at a time: at most one tensor's
    worth of noise is held, not a copy of them all.

    >>> import torch
    >>> from gradtap._privacy.noise import add_gaussian_noise_, gaussian_noise
    >>> a = [torch.ones(3), torch.ones(2)]
    >>> add_gaussian_noise_(a, 0.5, torch.Generator().manual_seed(0))
    >>> b = gaussian_noise([torch.ones(3), torch.ones(2)], 0.5, torch.Generator().manual_seed(0))
    >>> all(torch.equal(x, 1 + y) for x, y in zip(a, b))
    True
    """
    sigma = _checked(tensors, std, generator)
    for t in tensors:
        t.add_(_draw(t, sigma, generator))


def _checked(tensors: Sequence[Tensor], std: float,
             generator: torch.Generator | None) -> float:
    sigma = check_number("std", std, 0.0, math.inf, low_open=False, high_open=True,
                         meaning="the noise's standard deviation")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, "
                        f"got {type(generator).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor) or not t.is_floating_point():
            what = f"a {t.dtype} tensor" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"gaussian_noise: tensors[{i}] must be a floating-point tensor, "
                            f"got {what}")
    return sigma


def _draw(t: Tensor, sigma: float, generator: torch.Generator | None) -> Tensor:
    device = generator.device if generator is not None else t.device
    draw = torch.randn(t.shape, generator=generator, device=device,
                       dtype=torch.promote_types(t.dtype, torch.float32))
    return draw.mul_(sigma).to(device=t.device, dtype=t.dtype)


def shared_generator(device: torch.device | str = "cpu", seed: int | None = None,
                     group: ProcessGroup | None = None) -> torch.Generator:
    """A generator on ``device`` seeded alike on every rank of ``group`` (the default group).

    Rank 0 of the group picks the seed (``seed``, or 63 random bits from ``secrets``) and
    broadcasts it to the others (``torch.distributed.broadcast_object_list``, one collective
    every rank of the group must enter); without an initialised process group it seeds a
    generator of this process. Noise drawn from it is then the same on every rank.

    >>> from gradtap._privacy.noise import shared_generator
    >>> shared_generator(seed=7).initial_seed()
    7
    """
    import torch.distributed as dist

    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2 ** 63):
        raise ValueError(f"seed must be an int in [0, 2**63) or None, got {seed!r}")
    chosen = [seed if seed is not None else secrets.randbits(63)]
    if dist.is_available() and dist.is_initialized():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(chosen, src=src, group=group)
    return torch.Generator(device=device).manual_seed(int(chosen[0]))
