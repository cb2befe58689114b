"""The dense output of every adaptive method keeps the method's order, in every path that solves with it.

An adaptive step overshoots the output times and reads them (``y(T)`` too) off its interpolant, so an
interpolant of lower order than the method caps every output. torchdiffeq's ``bosh3`` (order 3) interpolates
through a second-order midpoint, its ``fehlberg2`` and ``adaptive_heun`` (order 2) through a first-order one;
cde_nets uses the cubic Hermite midpoint for all three (solvers/steppers/tableaux.py). torchdiffeq's ``dopri8``
(order 8) reads a quartic; cde_nets' stepper a seventh-order extension of its own (solvers/steppers/dopri8.py).
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.fields import Hamiltonian
from cde_nets.solvers.adapter import integrate
from cde_nets.solvers.gradients import Backprop, as_gradient
from cde_nets.solvers.options import ADAPTIVE_METHODS, SolverOptions
from cde_nets.solvers.steppers import fast_rk
from cde_nets.solvers.steppers.order_conditions import order_defects
from cde_nets.solvers.steppers.tableaux import TABLEAUX, dense_at

# the order of each method's dense output (global): the error at mid-step of one step is O(h^(order + 1))
INTERPOLANT_ORDER = {"dopri8": 7, "dopri5": 4, "tsit5": 4, "bosh3": 3, "fehlberg2": 2, "adaptive_heun": 2}
# in the solves left to torchdiffeq's own loop (the event search, the adjoint's backward solve, states the stepper
# does not take), dopri8 still reads torchdiffeq's quartic
TORCHDIFFEQ_ORDER = {**INTERPOLANT_ORDER, "dopri8": 4}
# step sizes whose mid-step errors stay well above rounding and in the asymptotic range
STEPS = {"dopri8": (1.2, 0.8, 0.6, 0.4), "dopri5": (0.2, 0.1, 0.05, 0.025)}


def _growth(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.cos(t) * y  # y(t) = y(0) exp(sin t)


def test_the_table_covers_every_adaptive_method():
    assert set(INTERPOLANT_ORDER) == set(ADAPTIVE_METHODS)


@pytest.mark.parametrize("path", ["fast", "adjoint", "torchdiffeq"])
@pytest.mark.parametrize("method", sorted(ADAPTIVE_METHODS))
def test_interpolant_order_by_fitted_slope(method, path, monkeypatch):
    """One step of size h (tolerances so loose it is accepted), the state read at h/2: the error against
    ``exp(sin(h/2))`` falls as ``h^(order + 1)``. ``"adjoint"``: the adjoint's forward solve (the library's
    stepper, without a graph); ``"torchdiffeq"``: torchdiffeq's loop with the interpolants cde_nets gives it."""
    monkeypatch.setattr(fast_rk, "ENABLED", path != "torchdiffeq")
    hs = STEPS.get(method, (0.2, 0.1, 0.05, 0.025))
    errors = []
    for h in hs:
        y0 = torch.ones(1, dtype=torch.float64, requires_grad=path == "adjoint")
        t = torch.tensor([0.0, h / 2, h], dtype=torch.float64)
        gradient = "adjoint" if path == "adjoint" else Backprop(steps="torchdiffeq")  # no graph: nothing held fixed
        with torch.set_grad_enabled(path == "adjoint"):
            solver = SolverOptions(method, rtol=1e3, atol=1e3, options={"first_step": h})
            ys, stats = integrate(_growth, y0, t, solver=solver, gradient=as_gradient(gradient), params=[y0])
        assert stats.steps_forward == 1
        errors.append(abs(float(ys[1, 0].detach()) - math.exp(math.sin(h / 2))))
    slope = np.polyfit(np.log(hs), np.log(errors), 1)[0]
    order = (TORCHDIFFEQ_ORDER if path == "torchdiffeq" else INTERPOLANT_ORDER)[method]
    assert slope > order + 1 - 0.3, (slope, errors)


class _Ramp(nn.Module):
    """``y' = t/2 + 1``: ``y(t) = y(0) + t + t²/4``, integrated exactly by any third-order step."""

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (t / 2 + 1) * torch.ones_like(y)


@pytest.mark.parametrize("gradient", ["adjoint", "backprop", "checkpoint", "symplectic"])
def test_bosh3_is_exact_where_its_steps_are(f64, gradient):
    """bosh3's steps integrate a quadratic solution exactly, and so must its outputs: ``y(T)``, states at output
    times, the event ``y = 3`` (at ``t = 2``) and the dense output. torchdiffeq's interpolant gave ``y(4)`` =
    12.22 for 8, event times off by 0.2."""
    block = ODEBlock(_Ramp(), T=4.0, method="bosh3", rtol=1e-8, atol=1e-8, gradient=gradient)
    y0 = torch.tensor([[0.0], [1.0]], requires_grad=True)
    exact = lambda t: y0.detach() + t + t**2 / 4  # noqa: E731
    assert torch.allclose(block(y0), exact(4.0), rtol=0, atol=1e-12)
    t = torch.tensor([0.0, 0.3, 1.7, 2.5, 4.0])
    sol = block.solve(y0, t=t)
    assert sol.ys is not None
    for j, tj in enumerate(t.tolist()):
        assert torch.allclose(sol.ys[j], exact(tj), rtol=0, atol=1e-12)
    ev = block.solve(y0, event=lambda s, y: y[:, 0] - 3.0, event_tol=1e-12)
    assert ev.stop_times is not None
    # y(0) = 0 reaches 3 at t = 2; y(0) = 1 at t = 2√3 − 2
    want = torch.tensor([2.0, 2 * math.sqrt(3) - 2])
    assert torch.allclose(ev.stop_times.detach(), want, rtol=0, atol=1e-9)
    dense = block.solve(y0, dense=True)
    for tj in (0.1, 1.3, 3.9):
        assert torch.allclose(dense.evaluate(tj).detach(), exact(tj), rtol=0, atol=1e-10)


def _sine(t, y):
    return 2 * y / t + t**4 * torch.sin(2 * t) - t**2 + 4 * t**3


def _sine_exact(t):
    c, s = torch.cos(2 * t), torch.sin(2 * t)
    return -0.5 * t**4 * c + 0.5 * t**3 * s + 0.25 * t**2 * c - t**3 + 2 * t**4 + (math.pi - 0.25) * t**2


def _linear_problem():
    g = torch.Generator().manual_seed(0)
    M = 0.3 * torch.randn(10, 10, generator=g, dtype=torch.float64)
    A = M - M.T  # skew: a rotation, y(t) = expm(A t) y0
    y0 = torch.randn(1, 10, generator=g, dtype=torch.float64)
    t = torch.linspace(0, 4, 9, dtype=torch.float64)
    exact = torch.stack([y0 @ torch.linalg.matrix_exp(A * float(s)).T for s in t])
    return (lambda s, y: y @ A.T), y0, t, exact


@pytest.mark.parametrize("path", ["fast", "torchdiffeq"])
@pytest.mark.parametrize("problem", ["sine", "linear"])
def test_bosh3_meets_its_tolerance_on_classic_problems(problem, path):
    """torchdiffeq's sine problem from t = 1 and a 10x10 rotation: every output within 50 (atol + rtol |y|)
    at rtol = atol = 1e-6 (4.5 and 21 measured; torchdiffeq's interpolant gave 171 and 168)."""
    if problem == "sine":
        t = torch.linspace(1, 8, 15, dtype=torch.float64)
        f, y0, exact = _sine, _sine_exact(t[:1])[:, None], _sine_exact(t)[:, None, None]
    else:
        f, y0, t, exact = _linear_problem()
    y0 = y0.clone().requires_grad_(path == "torchdiffeq")
    gradient = "adjoint" if path == "torchdiffeq" else "backprop"
    with torch.set_grad_enabled(path == "torchdiffeq"):
        solver = SolverOptions("bosh3", rtol=1e-6, atol=1e-6)
        ys, _ = integrate(f, y0, t, solver=solver, gradient=as_gradient(gradient), params=[y0])
    ratio = ((ys.detach() - exact).abs() / (1e-6 + 1e-6 * exact.abs())).max()
    assert float(ratio) < 50, float(ratio)


class _Rotation(nn.Module):
    """``y' = A y``, ``A = [[0, 1], [−1, 0]]``: ``y(t) = (cos t, −sin t)`` from ``y(0) = (1, 0)``."""

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.stack([y[..., 1], -y[..., 0]], dim=-1)


@pytest.mark.parametrize("tol", [1e-10, 1e-13])
@pytest.mark.parametrize("door", ["odeint", "backprop", "checkpoint", "symplectic", "adjoint"])
def test_dopri8_meets_tight_tolerances_on_a_rotation(door, tol):
    """``y(2)`` within the tolerance of ``(cos 2, −sin 2)`` through both doors and every gradient mode's forward
    solve (measured 8.6e-12 at rtol = atol = 1e-10, 2.9e-14 at 1e-13). torchdiffeq's dopri8 reads ``y(2)`` off its
    quartic: 5.6e-8 and 1.3e-9."""
    y0 = torch.tensor([[1.0, 0.0]], dtype=torch.float64, requires_grad=door != "odeint")
    if door == "odeint":
        y = odeint(
            _Rotation(), y0[0], torch.tensor([0.0, 2.0], dtype=torch.float64), method="dopri8", rtol=tol, atol=tol
        )[-1]
    else:
        y = ODEBlock(_Rotation(), T=2.0, method="dopri8", rtol=tol, atol=tol, gradient=door)(y0)[0]
    exact = torch.tensor([math.cos(2.0), -math.sin(2.0)], dtype=torch.float64)
    assert float((y.detach() - exact).abs().max()) < tol


@pytest.mark.parametrize("tol", [1e-10, 1e-13])
def test_dopri8_conserves_a_separable_h2_energy(tol):
    """A separable H2 field (``K = blockdiag(K_p, K_q)``, canonical ``J``, one piece: Galimberti et al. eqs.
    H12-13) conserves ``H(y) = Σ log cosh(K y + b)``: dopri8 keeps it to 10 (rtol + atol |H|) over ``[0, 2]``
    (measured 4.8e-12 at 1e-10, 7.8e-14 at 1e-13; torchdiffeq's quartic: 9.9e-9 and 3.2e-9), closer than dopri5
    at the same tolerance."""
    g = torch.Generator().manual_seed(1)
    field = Hamiltonian(4, K="blockdiag", T=2.0).double()
    assert field.separable
    with torch.no_grad():
        for p in field.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        y0 = torch.randn(3, 4, dtype=torch.float64, generator=g)
        H0 = field.energy(0.0, y0)
        drift = {}
        for method in ("dopri8", "dopri5"):
            y = ODEBlock(field, T=2.0, method=method, rtol=tol, atol=tol)(y0)
            drift[method] = float((field.energy(2.0, y) - H0).abs().max())
    assert drift["dopri8"] < 10 * tol * max(1.0, float(H0.abs().max()))
    assert drift["dopri8"] < drift["dopri5"]


def test_dopri8_extension_is_c1_seventh_order_and_small():
    """dopri8's continuous extension ``y_0 + h Σ b_i(θ) k_i`` over its 14 stages and 5 of its own: order 7 at
    every ``θ`` (the 85 conditions of trees with at most 7 vertices, Hairer, Nørsett & Wanner I, eq. II.6.11)
    but not 8, ``b(1) = b``, slopes ``b'(0) = e_1`` and ``b'(1) = e_14`` (the field at the step's ends: C¹
    across steps), and ``Σ_i |b_i(θ)|`` never above the step's own ``Σ_i |b_i| = 3.1`` (rounding no larger than a
    step's)."""
    tab = TABLEAUX["dopri8"]
    assert tab.stages == 14 and len(tab.all_c) == 19 and tab.fsal and tab.dense is not None
    slope = [sum((p + 1) * row[i] for p, row in enumerate(tab.dense)) for i in range(19)]
    assert list(tab.dense[0]) == [1.0] + [0.0] * 18
    assert max(abs(x - (i == 13)) for i, x in enumerate(slope)) < 1e-12
    for theta in np.linspace(0.05, 1.0, 20):
        weights = dense_at(tab, float(theta))
        assert max(abs(d) for d, _ in order_defects(tab.all_a, weights, 7, float(theta))) < 1e-12
        assert sum(abs(w) for w in weights) <= sum(abs(b) for b in tab.tableau.b) + 1e-12
    assert max(abs(d) for d, _ in order_defects(tab.all_a, dense_at(tab, 0.5), 8, 0.5)) > 1e-7
    assert max(abs(x - y) for x, y in zip(dense_at(tab, 1.0), tab.tableau.b)) < 1e-12
