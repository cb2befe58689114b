"""The stage iteration of the implicit steps (float64): its stopping rule holds where increments go unchecked,
simplified Newton's matrix carried along a solve, and samples at rest."""

from __future__ import annotations

import pytest
import torch

import cde_nets.solvers.steppers.implicit as implicit
import cde_nets.solvers.steppers.implicit_linear as linear
from cde_nets import ODEBlock
from cde_nets.fields import Hamiltonian
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.schemes import get_scheme
from cde_nets.solvers.steppers.implicit import Newton, coefficients, get_tableau, implicit_step

D = torch.float64
EPS = torch.finfo(D).eps


def test_chained_stages_meet_the_stopping_rule_with_checks_skipped():
    """Chained gl4 layers on the H1 field (h = 0.1, batch 256) check an increment only where the observed rate
    allows convergence; the stages they return still solve ``G(Z) = Z − h (A ⊗ I) F(y + Z) = 0`` to each sample's
    tolerance ``4 ε max(‖y_b‖, ‖Z_b‖)``: the residual is the next increment, ``θ ≈ 0.03`` times the last."""
    f = Hamiltonian(4, generator=torch.Generator().manual_seed(0)).double()
    y = torch.randn(256, 4, dtype=D, generator=torch.Generator().manual_seed(1))
    sch, bound, tab = get_scheme("gl4").for_field(f), BoundField(f), get_tableau("gl4")
    A = coefficients(tab, y)[0]
    with torch.no_grad():
        for _ in range(6):
            y1 = sch.step(bound, 0, (y,), 0.1, None, 0.0)[0]
            Z = sch._chain._last[2]
            F = torch.stack([bound.evaluate(0, y + Zi, t=0.0) for Zi in Z])
            G = Z - 0.1 * torch.einsum("ij,jbn->ibn", A, F)
            tol = 4 * EPS * torch.maximum(y.abs().amax(1), Z.abs().amax((0, 2)))
            assert float((G.abs().amax((0, 2)) / tol).max()) <= 1.0
            y = y1


def test_simplified_newton_reuses_its_matrix_along_a_stiff_solve(monkeypatch):
    """Van der Pol with μ = 1000, 20 steps of radauIIA3 (h = 1) with Newton('simplified'): the Jacobian of the
    first step serves every later one while the iteration contracts at θ ≤ 0.05 (on the slow branch it does), so
    the solve evaluates fewer Jacobians than it takes steps, and lands on the solution of a Jacobian per step
    to the stopping rule's tolerance (4 ε ‖y‖)."""
    from cde_nets.benchmarks.implicit_methods import VanDerPol

    calls = []

    def counted(fun, t, y):
        calls.append(t)
        return jacobian(fun, t, y)

    jacobian = implicit.stage_jacobian
    monkeypatch.setattr(implicit, "stage_jacobian", counted)
    y0 = torch.tensor([[2.0, 0.0]], dtype=D)
    block = ODEBlock(VanDerPol(1000.0), T=20.0, method="radauIIA3", step_size=1.0, options={"newton": "simplified"})
    out = {}
    for reuse in (True, False):
        if not reuse:
            monkeypatch.setattr(linear, "REUSE_MAX_RATE", -1.0)
        calls.clear()
        with torch.no_grad():
            out[reuse] = (block.solve(y0).y, len(calls))
    assert out[False][1] == 20 and out[True][1] < 5, out
    assert float((out[True][0] - out[False][0]).abs().max()) <= 4 * 20 * EPS * 2.0


@pytest.mark.parametrize("kind", ["auto", "simplified", "fixed_point"])
def test_a_sample_at_rest_does_not_stop_the_batch(kind):
    """A sample at an equilibrium (``y_b = 0`` with ``F(0) = 0``) has a zero tolerance ``4 ε max(‖y_b‖, ‖Z_b‖)``
    and exact zero increments: it has converged, and the batch's other samples take their step (the rotation
    ``y' = W y``: gl4's ``R(iω h)`` to rounding; the 0/0 of the stopping test read as non-finite before)."""
    W = torch.tensor([[0.0, -1.0], [1.0, 0.0]], dtype=D)
    y0 = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=D)
    y1, _ = implicit_step(lambda t, y: y @ W.T, 0.0, y0, 0.1, get_tableau("gl4"), Newton(kind))
    z = 0.1j  # gl4 is the (2, 2) Padé approximant of exp: R(z) = (1 + z/2 + z²/12) / (1 − z/2 + z²/12)
    R = (1 + z / 2 + z**2 / 12) / (1 - z / 2 + z**2 / 12)
    expected = torch.tensor([[R.real, R.imag], [0.0, 0.0]], dtype=D)
    assert float((y1 - expected).abs().max()) <= 4 * EPS
