"""The privacy spent by DP-SGD, from Google's ``dp-accounting`` package (the ``privacy`` extra).

A step of DP-SGD is a Poisson-subsampled Gaussian mechanism: each example joins the batch with
probability ``sample_rate`` (:func:`~gradtap._privacy.sampling.poisson_batches`), and the
clipped sum gets Gaussian noise of standard deviation ``noise_multiplier`` times the clipping
bound. ``steps`` of them compose into::

    SelfComposedDpEvent(PoissonSampledDpEvent(sample_rate, GaussianDpEvent(noise_multiplier)), steps)

(:func:`composed_event`), whose epsilon at a delta one of the package's accountants gives,
under its default settings and add-or-remove-one neighbouring datasets:

- ``"rdp"``: ``dp_accounting.rdp.RdpAccountant`` (Renyi DP at the package's default orders,
  converted to (epsilon, delta); an upper bound, looser than the others);
- ``"pld"``: ``dp_accounting.pld.PLDAccountant`` (the privacy loss distribution, discretised
  at interval 1e-4 and composed by FFT; its pessimistic estimate);
- ``"prv"`` (the default): the privacy loss random variable accountant. The PRV accountant of
  Gopi, Lee and Wutschitz (2021), which Opacus implements, composes the distribution of the
  privacy loss random variable numerically; that distribution is the one ``"pld"`` composes,
  so ``"prv"`` computes with the same ``PLDAccountant`` and gives the same numbers as
  ``"pld"``, with ``dp-accounting`` alone. On the example Opacus publishes figures for
  (noise 1.5, rate 0.04, 2250 steps, delta 1e-5) it gives 6.769; Opacus publishes 6.777, and
  its PRV accountant computes 6.779.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

from gradtap._privacy.checks import (
    check_delta,
    check_noise,
    check_number,
    check_rate,
    check_steps,
)
from gradtap.errors import missing_extra

__all__ = ["ACCOUNTANTS", "Accountant", "calibrate_noise", "composed_event", "epsilon"]

ACCOUNTANTS = ("prv", "pld", "rdp")
CALIBRATION_RTOL = 1e-4  # the calibrated noise is within this relative distance of the smallest
_MAX_NOISE = 1e6


def _dp_accounting() -> ModuleType:
    try:
        import dp_accounting
    except ImportError as err:
        raise missing_extra("privacy accounting", "dp-accounting", "privacy") from err
    return dp_accounting


def _check_accountant(accountant: str) -> str:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}: choose one of "
                         f"{', '.join(repr(a) for a in ACCOUNTANTS)}")
    return accountant


def _fresh(accountant: str) -> Any:
    dpa = _dp_accounting()
    return dpa.rdp.RdpAccountant() if accountant == "rdp" else dpa.pld.PLDAccountant()


def composed_event(noise_multiplier: float, sample_rate: float, steps: int) -> Any:
    """The ``dp_accounting.DpEvent`` of ``steps`` Poisson-subsampled Gaussian steps (a
    ``NoOpDpEvent`` for none)."""
    dpa = _dp_accounting()
    sigma, q, n = check_noise(noise_multiplier), check_rate(sample_rate), check_steps(steps)
    if n == 0:
        return dpa.NoOpDpEvent()
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), n)


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            accountant: str = "prv") -> float:
    """The epsilon at ``delta`` of ``steps`` Poisson-subsampled Gaussian steps, from
    ``accountant`` (``"prv"``, ``"pld"`` or ``"rdp"``): 0 for no steps, ``inf`` without noise.

    >>> from gradtap._privacy.accounting import epsilon
    >>> round(epsilon(1.5, 0.04, 2250, 1e-5, accountant="rdp"), 3)
    7.329
    """
    _check_accountant(accountant)
    event = composed_event(noise_multiplier, sample_rate, steps)
    d = check_delta(delta)
    if steps == 0:
        return 0.0
    return float(_fresh(accountant).compose(event).get_epsilon(d))


def calibrate_noise(target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
                    accountant: str = "prv") -> float:
    """The smallest noise multiplier whose ``steps`` Poisson-subsampled Gaussian steps spend
    at most ``target_epsilon`` at ``target_delta`` under ``accountant``.

    ``dp_accounting.calibrate_dp_mechanism`` (Brent's method, then a bisection that keeps the
    epsilon at or under the target) searches a bracket found first: for ``"rdp"`` by doubling
    and halving from 1, for the others between the RDP answer (RDP's epsilon bounds theirs from
    above) and a fraction of it. The answer spends at most ``target_epsilon`` and lies within a
    relative ``CALIBRATION_RTOL`` (1e-4) of the smallest noise multiplier that does.

    >>> from gradtap._privacy.accounting import calibrate_noise, epsilon
    >>> sigma = calibrate_noise(2.0, 1e-5, 0.01, 100, accountant="rdp")
    >>> epsilon(sigma, 0.01, 100, 1e-5, accountant="rdp") <= 2.0
    True
    """
    dpa = _dp_accounting()
    _check_accountant(accountant)
    target = check_number("target_epsilon", target_epsilon, 0.0, math.inf, low_open=True,
                           high_open=True, meaning="the privacy budget")
    delta, q = check_delta(target_delta), check_rate(sample_rate)
    n = check_steps(steps, least=1)

    def eps(sigma: float, kind: str) -> float:
        return epsilon(sigma, q, n, delta, accountant=kind)

    def over(sigma: float, kind: str) -> bool:
        if sigma > _MAX_NOISE:
            raise ValueError(f"no noise multiplier up to {_MAX_NOISE:g} spends at most "
                             f"epsilon={target:g} at delta={delta:g} over {n} steps at "
                             f"sample_rate={q:g}")
        return eps(sigma, kind) > target

    if accountant == "rdp":
        hi = 1.0
        while over(hi, "rdp"):
            hi *= 2.0
        lo = hi / 2.0
    else:
        hi = calibrate_noise(target, delta, q, n, accountant="rdp")
        while over(hi, accountant):  # not expected: RDP's bound is the looser one
            hi *= 1.25
        lo = 0.8 * hi
    while not over(lo, accountant):
        hi, lo = lo, lo / 2.0
    return float(dpa.calibrate_dp_mechanism(
        lambda: _fresh(accountant),
        lambda sigma: composed_event(sigma, q, n),
        target, delta, bracket_interval=dpa.ExplicitBracketInterval(lo, hi),
        tol=CALIBRATION_RTOL * lo))


class Accountant:
    """The privacy spent by a run of DP-SGD so far, counted step by step.

    ``step()`` counts a step (``step(k)``: ``k``); ``epsilon(delta)`` is the epsilon at
    ``delta`` of the steps counted so far, equal to :func:`epsilon` with those steps (the
    composed accountant of one count is kept, so asking at other deltas composes nothing
    again). ``state_dict()`` and ``load_state_dict()`` carry the count through a checkpoint.

    >>> from gradtap._privacy.accounting import Accountant
    >>> acc = Accountant(noise_multiplier=1.0, sample_rate=0.01, accountant="rdp")
    >>> acc.epsilon(1e-5)
    0.0
    >>> acc.step(100)
    >>> acc.steps, acc.epsilon(1e-5) > 0
    (100, True)
    """

    def __init__(self, noise_multiplier: float, sample_rate: float,
                 accountant: str = "prv") -> None:
        _dp_accounting()
        self.noise_multiplier = check_noise(noise_multiplier)
        self.sample_rate = check_rate(sample_rate)
        self.accountant = _check_accountant(accountant)
        self.steps = 0
        self._composed: tuple[int, Any] | None = None

    def step(self, count: int = 1) -> None:
        """Count ``count`` more steps."""
        self.steps += check_steps(count, name="count")

    def event(self) -> Any:
        """The ``dp_accounting.DpEvent`` of the steps counted so far."""
        return composed_event(self.noise_multiplier, self.sample_rate, self.steps)

    def epsilon(self, delta: float) -> float:
        """The epsilon at ``delta`` of the steps counted so far."""
        d = check_delta(delta)
        if self.steps == 0:
            return 0.0
        if self._composed is None or self._composed[0] != self.steps:
            self._composed = (self.steps, _fresh(self.accountant).compose(self.event()))
        return float(self._composed[1].get_epsilon(d))

    def state_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "sample_rate": self.sample_rate,
                "accountant": self.accountant, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the count of :meth:`state_dict`, checking it is of the same mechanism."""
        mine = self.state_dict()
        differ = [k for k in ("noise_multiplier", "sample_rate", "accountant")
                  if state.get(k) != mine[k]]
        if differ:
            raise ValueError("the state is of another accountant: "
                             + ", ".join(f"{k}={state.get(k)!r} (this one: {mine[k]!r})"
                                         for k in differ))
        self.steps = check_steps(state["steps"])

    def __repr__(self) -> str:
        return (f"Accountant(noise_multiplier={self.noise_multiplier}, sample_rate="
                f"{self.sample_rate}, accountant={self.accountant!r}, steps={self.steps})")
