"""Projection onto invariants after each step (solvers/steppers/projection.py; Hairer, Lubich & Wanner 2006, §IV.4)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cde_nets import Projection, discretize, solve_projected
from cde_nets.fields import Hamiltonian, Kepler, canonical_J, kepler_orbit
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.schemes import Projected, get_scheme
from cde_nets.solvers.steppers.projection import ProjectionError

D = torch.float64


def _kepler(e: float = 0.5):
    f = Kepler().double()
    return f, kepler_orbit(0.0, e)[None], Projection(invariant=(f.energy, f.angular_momentum))


def test_energy_and_angular_momentum_held_to_rounding_at_every_step():
    """rk4 on Kepler (e = 0.5), 200 steps over one period: unprojected, energy and angular momentum drift by
    ~1e-4; projected onto both, each step's values equal the initial ones to 1e-12 (relative), and the orbit is
    closer to the exact one."""
    f, y0, proj = _kepler()
    t = torch.linspace(0, 2 * math.pi, 201, dtype=D)
    with torch.no_grad():
        sol = solve_projected(f, y0, t, method="rk4", projection=proj, step_size=2 * math.pi / 200)
    H, L = f.energy(0.0, sol.ys[:, 0]), f.angular_momentum(0.0, sol.ys[:, 0])
    assert float((H - H[0]).abs().max()) <= 1e-12 * abs(float(H[0]))
    assert float((L - L[0]).abs().max()) <= 1e-12 * abs(float(L[0]))
    with torch.no_grad():
        y = y0
        rk4, bound = get_scheme("rk4"), BoundField(f)
        for _ in range(200):
            y = rk4.step(bound, 0, (y,), 2 * math.pi / 200)[0]
    assert float((f.energy(0.0, y) - f.energy(0.0, y0)).abs()) > 1e-6
    exact = kepler_orbit(2 * math.pi, 0.5)
    assert float((sol.y[0] - exact).abs().max()) < float((y[0] - exact).abs().max())


@pytest.mark.parametrize(("method", "order", "Ns"), [("rk4", 4, (100, 141, 200, 283)), ("verlet", 2, (100, 141, 200))])
def test_projected_method_keeps_its_order(method, order, Ns):
    """Kepler (e = 0.5) over one period against the closed form, projected onto energy and angular momentum:
    the fitted order is the method's, within 0.1 (HLW Thm. IV.4.2)."""
    f, y0, proj = _kepler()
    exact = kepler_orbit(2 * math.pi, 0.5)
    errs = []
    for N in Ns:
        with torch.no_grad():
            y = solve_projected(f, y0, method=method, projection=proj, step_size=2 * math.pi / N).y
        errs.append(float((y[0] - exact).abs().max()))
    fitted = -np.polyfit(np.log(Ns), np.log(errs), 1)[0]
    assert abs(fitted - order) < 0.1, (fitted, errs)


def test_gradients_equal_central_differences():
    """A 2-piece H1 field (non-separable), gl4 projected onto its energy, whose value and gradient both depend on
    the field's parameters: d Σ y(T)² / d y0 and / d K equal central differences (float64, 1e-6) to 1e-7, and
    ``checkpoint`` equals ``backprop`` to 1e-10."""
    f = Hamiltonian(4, layers=2, T=1.0, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    proj = Projection(invariant=f.energy)

    def loss(y, gradient="backprop"):
        return (solve_projected(f, y, method="rk4", projection=proj, step_size=0.25, gradient=gradient).y ** 2).sum()

    x = y0.clone().requires_grad_(True)
    K = f.K.data
    gx, gK = torch.autograd.grad(loss(x), [x, K])
    x2 = y0.clone().requires_grad_(True)
    gx2, gK2 = torch.autograd.grad(loss(x2, "checkpoint"), [x2, K])
    assert float((gx - gx2).abs().max()) <= 1e-10 and float((gK - gK2).abs().max()) <= 1e-10
    eps = 1e-6
    with torch.no_grad():
        for idx in ((0, 0), (2, 3)):
            e = torch.zeros_like(y0)
            e[idx] = eps
            fd = (loss(y0 + e) - loss(y0 - e)) / (2 * eps)
            assert abs(float(fd) - float(gx[idx])) <= 1e-7
        for idx in ((0, 1, 2), (1, 3, 0)):
            K[idx] += eps
            up = loss(y0)
            K[idx] -= 2 * eps
            down = loss(y0)
            K[idx] += eps
            assert abs(float((up - down) / (2 * eps)) - float(gK[idx])) <= 1e-7


def test_projection_breaks_symplecticity_and_says_so():
    """Verlet on an H2 field is symplectic to rounding; projected onto the energy it is not (defect > 1e-6 at
    h = 0.5) and its label and properties say so; its energy is kept to rounding."""
    f = Hamiltonian(4, K="blockdiag", T=0.5, generator=torch.Generator().manual_seed(2)).double()
    J = canonical_J(4, D)
    y = torch.randn(4, dtype=D, generator=torch.Generator().manual_seed(3))
    defects = {}
    for scheme in ("verlet", Projected("verlet", Projection(f.energy))):
        net = discretize(f, scheme)
        Phi = torch.autograd.functional.jacobian(lambda x, net=net: net(x[None])[0], y)
        defects[net.scheme.name] = float((Phi.T @ J @ Phi - J).abs().max())
        if net.scheme.name.endswith("projection"):
            assert net.properties == {"projected"} and net.order == 2
            assert net.architecture[0] == "Störmer-Verlet (leapfrog) net, projected onto energy"
            with torch.no_grad():
                assert float((f.energy(0, net(y[None])) - f.energy(0, y[None])).abs()) <= 1e-14
    assert defects["verlet"] <= 1e-14 and defects["verlet+projection"] > 1e-6


def test_discrete_layers_hold_each_pieces_energy():
    """Discrete mode on a 6-piece H1 field: each projected rk4 layer keeps the energy of its own piece,
    ``H_l(y_{l+1}) = H_l(y_l)`` to 1e-12, where plain rk4 layers miss by more than 1e-6."""
    f = Hamiltonian(4, layers=6, T=3.0, generator=torch.Generator().manual_seed(4)).double()
    y0 = torch.randn(5, 4, dtype=D, generator=torch.Generator().manual_seed(5))
    for scheme, bound in (("rk4", (1e-6, math.inf)), (Projected("rk4", Projection(f.energy)), (0.0, 1e-12))):
        with torch.no_grad():
            states = discretize(f, scheme).layer_states(y0)
            miss = max(float((f.energy_at(l, states[l + 1]) - f.energy_at(l, states[l])).abs().max()) for l in range(6))
        assert bound[0] < miss <= bound[1], (scheme, miss)


def test_bad_inputs_are_refused_with_the_fix():
    f, y0, _ = _kepler()
    with pytest.raises(TypeError, match=r"`invariant` must be a callable g\(t, y\)"):
        Projection(invariant=3)
    with pytest.raises(ValueError, match=r"one value per sample, shape \(1,\)"):
        solve_projected(f, y0, method="rk4", projection=Projection(lambda t, y: y), step_size=0.1)
    with pytest.raises(ProjectionError, match="singular"):
        solve_projected(f, y0, method="rk4", projection=Projection((f.energy, f.energy)), step_size=0.1)
    with pytest.raises(ProjectionError, match="did not reach its invariants in max_iters=1"):
        proj = Projection(invariant=lambda t, y: (y**3).sum(-1), max_iters=1)
        solve_projected(f, y0, method="rk4", projection=proj, step_size=0.5)
    with pytest.raises(ValueError, match="projection needs a one-step scheme"):
        Projected("lm2", Projection(f.energy))
    with pytest.raises(ValueError, match=r"takes gradient=\('backprop', 'checkpoint'\)"):
        solve_projected(f, y0, method="rk4", projection=Projection(f.energy), step_size=0.1, gradient="adjoint")

    class Boom(RuntimeError):
        pass

    def bad(t, y):
        raise Boom("the user's own error")

    with pytest.raises(Boom, match="the user's own error"):
        solve_projected(f, y0, method="rk4", projection=Projection(bad), step_size=0.1)
