"""Adjoint state and Noether (eqs. R24-25), traces and log-density (eqs. R28, R32), Hutchinson's estimator."""

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.diagnostics import adjoint_state, exact_trace, hutchinson_trace, log_density_change
from cde_nets.fields import CubicFriction, Hamiltonian


def test_noether_aF_constant_for_time_invariant_parameters(f64):
    g = torch.Generator().manual_seed(0)
    f = CubicFriction(3, gamma=0.5, learn_gamma=False, zero_init=False, generator=g)
    y0 = torch.randn(5, 3, generator=g)
    r = adjoint_state(ODEBlock(f, rtol=1e-10, atol=1e-10), y0, torch.linspace(0, 1, 6), loss=lambda y: y.pow(2).sum())
    assert r["drift"] < 1e-6
    assert r["a"].abs().max() > 0.1


def test_adjoint_matches_closed_form_R90(f64):
    """w = 0, b = 0: a(t) = a(T) ((1 + 2γx0²t)/(1 + 2γx0²T))^{3/2} (eq. R90)."""
    gamma, T = 0.7, 1.5
    f = CubicFriction(2, gamma=gamma, learn_gamma=False)
    x0 = torch.tensor([[0.8, -1.3]])
    a_T = torch.tensor([[1.0, -2.0]])
    t = torch.linspace(0, T, 4)
    r = adjoint_state(ODEBlock(f, T=T, rtol=1e-10, atol=1e-10), x0, t, a_T=a_T)
    exact = a_T * ((1 + 2 * gamma * x0**2 * t[:, None, None]) / (1 + 2 * gamma * x0**2 * T)) ** 1.5
    assert torch.allclose(r["a"], exact, rtol=1e-7)


def test_extended_noether_constant_for_piecewise_parameters(f64):
    g = torch.Generator().manual_seed(1)
    f = Hamiltonian(4, layers=4, T=2.0, init_std=1.0, generator=g)
    y0 = torch.randn(5, 4, generator=g)
    r = adjoint_state(ODEBlock(f, rtol=1e-10, atol=1e-10), y0, torch.linspace(0, 2, 5), loss=lambda y: y.pow(2).sum())
    assert r["drift"] > 1e-2 and r["extended_drift"] < 1e-6


def test_hutchinson_within_three_standard_errors(f64):
    g = torch.Generator().manual_seed(2)
    f = Hamiltonian(6, J="learned", init_std=1.0, generator=g)
    y = torch.randn(5, 6, generator=g)

    def fn(v):
        return f.evaluate(0, v) + torch.sin(v) @ torch.ones(6, 6)

    exact = exact_trace(fn, y)
    est = hutchinson_trace(fn, y, probes=64, generator=g)
    assert ((est["estimate"] - exact).abs() <= 3 * est["stderr"]).all()
    assert (est["stderr"] > 0).all()


def test_log_density_change_matches_R87(f64):
    """x' = −γx³: Δ log P = −∫ Tr ∂F/∂x dt = (3/2) Σ_i log(1 + 2γ x0_i² T) (eqs. R28, R87)."""
    gamma, T = 0.7, 1.5
    f = CubicFriction(3, gamma=gamma, learn_gamma=False)
    x0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(3))
    r = log_density_change(ODEBlock(f, T=T, rtol=1e-10, atol=1e-10), x0)
    exact = 1.5 * torch.log1p(2 * gamma * x0**2 * T).sum(1)
    assert torch.allclose(r["delta_log_p"], exact, atol=1e-7)
    assert r["entropy_change"] == pytest.approx(-float(exact.mean()), abs=1e-7)
    assert torch.allclose(exact_trace(lambda v: f.evaluate(0, v), x0), f.divergence(0, x0), atol=1e-12)


def test_hutchinson_log_density_within_three_standard_errors(f64):
    g = torch.Generator().manual_seed(4)
    f = Hamiltonian(4, J="learned", init_std=1.0, generator=g)  # trace of J K^T diag K is not zero
    x0 = torch.randn(3, 4, generator=g)
    block = ODEBlock(f, rtol=1e-8, atol=1e-8)
    exact = log_density_change(block, x0)["delta_log_p"]
    est = log_density_change(block, x0, trace="hutchinson", probes=16, generator=g)
    assert ((est["delta_log_p"] - exact).abs() <= 3 * est["stderr"]).all()


def test_bad_arguments(f64):
    block = ODEBlock(CubicFriction(2))
    with pytest.raises(ValueError, match="exactly one of `a_T`"):
        adjoint_state(block, torch.zeros(1, 2), [0.0, 1.0])
    with pytest.raises(ValueError, match="`probes` must be an integer >= 2"):
        hutchinson_trace(lambda v: v, torch.zeros(1, 2), probes=1)
    with pytest.raises(ValueError, match="`trace` must be"):
        log_density_change(block, torch.zeros(1, 2), trace="approx")
