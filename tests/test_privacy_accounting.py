"""The privacy accountant: dp-accounting's own answer for the composed Poisson-subsampled
Gaussian event, Opacus's published figures (and, where Opacus is installed, its accountants),
steps counted as training goes, calibration from a target epsilon, and clear errors."""

from __future__ import annotations

import math
import sys

import dp_accounting as dpa
import pytest

from gradtap._privacy import accounting
from gradtap._privacy.accounting import Accountant, calibrate_noise, composed_event, epsilon
from gradtap.errors import MissingExtraError

CASES = [(1.5, 0.04, 2250, 1e-5), (0.8, 0.01, 1000, 1e-6), (2.0, 0.25, 40, 1e-3),
         (1.1, 1.0, 5, 1e-5)]
# The example Opacus publishes epsilons for: noise 1.5, rate 0.04, 2250 steps, delta 1e-5
OPACUS_EXAMPLE = (1.5, 0.04, 2250, 1e-5)
OPACUS_PUBLISHED = {"rdp": 7.329, "prv": 6.777}


def _reference(sigma: float, q: float, steps: int, delta: float, kind: str) -> float:
    """dp-accounting's answer, the event built here from the package's own classes."""
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)),
                                    steps)
    acc = dpa.rdp.RdpAccountant() if kind == "rdp" else dpa.pld.PLDAccountant()
    return acc.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), CASES)
def test_epsilon_is_dp_accountings_answer(kind, sigma, q, steps, delta):
    want = _reference(sigma, q, steps, delta, kind)
    assert epsilon(sigma, q, steps, delta, accountant=kind) == pytest.approx(want, rel=1e-6)


def test_prv_is_the_privacy_loss_distribution_and_the_default():
    sigma, q, steps, delta = CASES[1]
    want = _reference(sigma, q, steps, delta, "pld")
    assert epsilon(sigma, q, steps, delta, accountant="prv") == pytest.approx(want, rel=1e-6)
    assert epsilon(sigma, q, steps, delta) == pytest.approx(want, rel=1e-6)
    assert Accountant(sigma, q).accountant == "prv"


def test_opacus_published_values_within_two_percent():
    sigma, q, steps, delta = OPACUS_EXAMPLE
    for kind, published in OPACUS_PUBLISHED.items():
        assert epsilon(sigma, q, steps, delta, accountant=kind) == pytest.approx(published,
                                                                                 rel=0.02)
    # the PLD answer is tighter than RDP's bound
    assert epsilon(sigma, q, steps, delta, "pld") < epsilon(sigma, q, steps, delta, "rdp")


@pytest.mark.parametrize(("sigma", "q", "steps", "delta"), [OPACUS_EXAMPLE, CASES[1]])
def test_opacus_accountants_agree(sigma, q, steps, delta):
    opacus = pytest.importorskip("opacus.accountants")  # the bench extra
    for ours, theirs in [("rdp", opacus.RDPAccountant), ("prv", opacus.PRVAccountant)]:
        acc = theirs()
        for _ in range(steps):
            acc.step(noise_multiplier=sigma, sample_rate=q)
        # different RDP orders, and Opacus's PRV is its own discretisation of the same PLD
        assert epsilon(sigma, q, steps, delta, ours) == pytest.approx(acc.get_epsilon(delta),
                                                                      rel=0.01)


def test_no_steps_spend_nothing_and_no_noise_spends_everything():
    for kind in accounting.ACCOUNTANTS:
        assert epsilon(1.0, 0.1, 0, 1e-5, accountant=kind) == 0.0
        assert epsilon(0.0, 0.1, 10, 1e-5, accountant=kind) == math.inf
    assert isinstance(composed_event(1.0, 0.1, 0), dpa.NoOpDpEvent)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_an_accountant_counts_steps_as_training_goes(kind):
    sigma, q, delta = 1.2, 0.02, 1e-5
    acc = Accountant(sigma, q, accountant=kind)
    assert acc.steps == 0 and acc.epsilon(delta) == 0.0
    spent = []
    for chunk in (1, 9, 90, 300):
        acc.step(chunk) if chunk > 1 else acc.step()
        spent.append(acc.epsilon(delta))
        assert spent[-1] == pytest.approx(_reference(sigma, q, acc.steps, delta, kind), rel=1e-6)
    assert acc.steps == 400
    assert spent == sorted(spent) and len(set(spent)) == 4
    assert acc.epsilon(1e-3) < acc.epsilon(1e-5)  # another delta, the same composition
    assert acc.epsilon(1e-3) == pytest.approx(_reference(sigma, q, 400, 1e-3, kind), rel=1e-6)
    assert acc.event() == composed_event(sigma, q, 400)

    again = Accountant(sigma, q, accountant=kind)
    again.load_state_dict(acc.state_dict())
    assert again.steps == 400 and again.epsilon(delta) == acc.epsilon(delta)
    with pytest.raises(ValueError, match=r"another accountant: noise_multiplier=1.2 \(this one: 1.3\)"):
        Accountant(1.3, q, accountant=kind).load_state_dict(acc.state_dict())


@pytest.mark.parametrize("kind", ["rdp", "pld"])  # "prv" computes as "pld" does
def test_calibration_gives_the_smallest_noise_for_the_target(kind):
    target, delta, q, steps = 0.5, 1e-5, 0.02, 100
    sigma = calibrate_noise(target, delta, q, steps, accountant=kind)
    assert epsilon(sigma, q, steps, delta, kind) <= target
    assert epsilon(sigma * 0.999, q, steps, delta, kind) > target
    assert target < epsilon(sigma * 0.99, q, steps, delta, kind) < 1.05 * target


def test_calibration_matches_dp_accountings_own_search():
    target, delta, q, steps = 1.0, 1e-6, 0.05, 200
    want = dpa.calibrate_dp_mechanism(dpa.rdp.RdpAccountant,
                                      lambda s: composed_event(s, q, steps), target, delta)
    assert calibrate_noise(target, delta, q, steps, "rdp") == pytest.approx(want, rel=1e-4)
    # a large budget: a small noise multiplier
    small = calibrate_noise(40.0, 1e-5, 0.5, 10, "rdp")
    assert small < 1.0 and epsilon(small, 0.5, 10, 1e-5, "rdp") <= 40.0


def test_bad_arguments_are_named():
    for delta in (0, 0.0, 1, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"delta \(.*\) must be in \(0, 1\)"):
            epsilon(1.0, 0.1, 10, delta)
        with pytest.raises(ValueError, match=r"delta \(.*\) must be in \(0, 1\)"):
            Accountant(1.0, 0.1).epsilon(delta)
    with pytest.raises(ValueError, match="unknown accountant 'gdp': choose one of 'prv', 'pld', 'rdp'"):
        epsilon(1.0, 0.1, 10, 1e-5, accountant="gdp")
    with pytest.raises(ValueError, match="unknown accountant 'RDP'"):
        Accountant(1.0, 0.1, accountant="RDP")
    with pytest.raises(ValueError, match=r"sample_rate \(.*\) must be in \(0, 1\], got 0"):
        epsilon(1.0, 0, 10, 1e-5)
    with pytest.raises(ValueError, match=r"noise_multiplier \(.*\) must be in \[0, inf\), got -1"):
        Accountant(-1, 0.1)
    with pytest.raises(TypeError, match="steps must be an int, got float"):
        epsilon(1.0, 0.1, 10.0, 1e-5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="count must be >= 0, got -2"):
        Accountant(1.0, 0.1).step(-2)
    with pytest.raises(ValueError, match=r"target_epsilon \(the privacy budget\) must be in \(0, inf\)"):
        calibrate_noise(0.0, 1e-5, 0.1, 10)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        calibrate_noise(1.0, 1e-5, 0.1, 0)


def test_without_dp_accounting_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # `import dp_accounting` fails
    for call in (lambda: epsilon(1.0, 0.1, 10, 1e-5), lambda: Accountant(1.0, 0.1),
                 lambda: calibrate_noise(1.0, 1e-5, 0.1, 10)):
        with pytest.raises(MissingExtraError, match=r'needs dp-accounting.*"gradtap\[privacy\]"'):
            call()
