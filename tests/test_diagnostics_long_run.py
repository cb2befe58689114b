"""Long-run conservation diagnostics: the drift fit, step Jacobians, and Noether's a·F along discrete adjoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cde_nets.diagnostics import energy_error_fit, long_run_energy, noether_drift, step_jacobians
from cde_nets.fields import Hamiltonian

D = torch.float64


def test_energy_error_fit_recovers_slope_and_amplitude():
    t = np.linspace(0, 1000, 100_001)  # the first 1 % (t <= 10) holds three peaks of |sin|
    err = 1e-3 * np.abs(np.sin(t)) + 2e-7 * t
    fit = energy_error_fit(t, err)
    assert abs(fit["slope"] - 2e-7) < 2e-9 and abs(fit["amplitude"] - 1e-3) < 3e-6
    assert fit["ratio"] == pytest.approx(fit["max"] / fit["amplitude"])
    with pytest.raises(ValueError, match="same length"):
        energy_error_fit([0, 1], [0, 1, 2])


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
