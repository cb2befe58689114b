"""Long-run conservation diagnostics: the drift fit, step Jacobians, and Noether's a·F along discrete adjoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cde_nets.diagnostics import energy_error_fit, long_run_energy, noether_drift, step_jacobians
from cde_nets.fields import Hamiltonian

D = torch.float64


def _quasi_periodic(t, a):
    return a * np.abs(np.sin(t)) + 0.5 * a * np.abs(np.sin(np.sqrt(2) * t + 0.3))


def test_energy_error_fit_recovers_slope_and_amplitude():
    t = np.linspace(0, 1000, 100_001)  # the first 1 % (t <= 10) holds three peaks of |sin|
    err = 1e-3 * np.abs(np.sin(t)) + 2e-7 * t
    fit = energy_error_fit(t, err)
    assert abs(fit["slope"] - 2e-7) < 2e-10 and abs(fit["amplitude"] - 1e-3) < 3e-6
    assert fit["ratio"] == pytest.approx(fit["max"] / fit["amplitude"])
    with pytest.raises(ValueError, match=r"N = len\(t\)"):
        energy_error_fit([0, 1], [0, 1, 2])


@pytest.mark.parametrize("drift", [1e-9, 1e-8])
def test_secular_slope_recovers_a_small_drift_under_a_large_oscillation(drift):
    """A bounded quasi-periodic error of amplitude a = 1e-3 plus a drift d t that adds only 1e-3 a (or 1e-2 a)
    over the run T = 1000: the tapered fit recovers d to 1e-3; without a drift it reads below 1e-4 a / T, where
    the unit-weight fit of the same data reads 1.8 a / T² (the cut first and last periods)."""
    t = np.linspace(0, 1000, 100_001)[1:]
    a, T = 1e-3, 1000.0
    fit = energy_error_fit(t, _quasi_periodic(t, a) + drift * t)
    assert abs(fit["slope"] - drift) < 1e-3 * drift, fit
    flat = energy_error_fit(t, _quasi_periodic(t, a))
    assert abs(flat["slope"]) < 1e-4 * a / T and abs(flat["pointwise_slope"]) > 1e-3 * a / T, flat


def _beating_batch(t: np.ndarray, a: float = 1e-4, B: int = 16) -> np.ndarray:
    """``B`` samples' quasi-periodic energy errors ``(N, B)`` whose frequencies differ by 3e-4: their maximum beats
    with periods of order 2e4 / k, near the run's length."""
    b = np.arange(B)
    amp, om, ph = a * (1 + 0.01 * b), 1 + 3e-4 * b, 0.37 * b
    return amp * (np.sin(np.outer(t, om) + ph) + 0.5 * np.sin(np.sqrt(2) * np.outer(t, om) + 2 * ph))


@pytest.mark.parametrize("relative_drift", [0.0, 1e-2, 1e-1])
def test_per_sample_fit_separates_a_drift_from_the_beats_of_the_batch_maximum(relative_drift):
    """16 bounded quasi-periodic errors (amplitude a = 1e-4, 10⁵ steps of 0.1: T = 10⁴) with slightly different
    frequencies. Without drift each sample's tapered slope is below 1e-6 a / T, while the same fit of the maximum
    over the batch reads 0.1 a / T: the beats between samples, not a trend. With a drift d_b t (d_b from d down to
    d / 2, d = 1e-2 or 1e-1 a / T), the per-sample fit returns d to 1e-6, where the batch maximum's fit is off by
    more than 100 % (and of the wrong sign)."""
    t = 0.1 * np.arange(1, 100_001)
    a, T = 1e-4, t[-1]
    d = relative_drift * a / T
    drift = d * (1 - np.arange(16) / 32)
    fit = energy_error_fit(t, _beating_batch(t, a) + np.outer(t, drift))
    if d == 0:
        assert abs(fit["slope"]) < 1e-6 * a / T and abs(fit["batch_max_slope"]) > 0.1 * a / T, fit
    else:
        assert abs(fit["slope"] - d) < 1e-6 * d and abs(fit["batch_max_slope"] - d) > d, fit


def test_secular_slope_keeps_the_drift_of_drifting_methods():
    """H1 field, 2000 steps of h = 0.25, every step's error: rk4's linear drift reads the same tapered per sample
    (the worst sample's signed slope) as unweighted on the batch maximum (within 2 %), and euler's, which bends,
    within 10 %: the taper removes oscillation, not trend."""
    f = Hamiltonian(4, K="full", generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    for method, rel in (("rk4", 0.02), ("euler", 0.1)):
        fit = long_run_energy(f, method, y0, 0.25, 2000)["fit"]
        assert abs(fit["slope"]) == pytest.approx(fit["pointwise_slope"], rel=rel), (method, fit)
        assert fit["ratio"] > 30, (method, fit)


def test_step_jacobians_of_a_linear_map():
    M = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(0))
    Phi = step_jacobians(lambda y: y @ M.T, torch.randn(5, 3, dtype=D))
    assert torch.allclose(Phi, M.expand(5, 3, 3), atol=1e-15)


@pytest.mark.parametrize(("scheme", "order"), [("verlet", 2), ("yoshida4", 4), ("gl4", 4)])
def test_noether_drift_falls_as_the_order(scheme, order):
    """a·F along the discrete adjoint drifts by O(h^p) over a fixed time; halving h divides it by 2^p (within 10 %):
    the adjoint is re-rooted per step, so split schemes (whose last half step reads the new q) are not
    mis-measured."""
    f = Hamiltonian(4, K="blockdiag", generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(4, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    d1, d2 = (noether_drift(f, scheme, y0, 1.0 / N, 5 * N) for N in (10, 20))
    assert abs(np.log2(d1 / d2) - order) < 0.15


def test_long_run_energy_counts_and_refuses_piecewise_fields():
    f = Hamiltonian(4, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(2, 4, dtype=D)
    r = long_run_energy(f, "rk4", y0, 0.1, 50, samples=10)
    assert r["nfe"] == 200 and r["t"][-1] == pytest.approx(5.0) and len(r["t"]) == len(r["error"])
    with pytest.raises(ValueError, match="one parameter piece"):
        long_run_energy(Hamiltonian(4, layers=2).double(), "rk4", y0, 0.1, 5)
