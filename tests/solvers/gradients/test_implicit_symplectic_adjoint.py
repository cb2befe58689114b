"""The symplectic adjoint of the implicit Runge-Kutta methods: exact gradients of the integrator's map (float64),
memory held in backward independent of the number of steps, and refusal where no partner is defined here."""

from __future__ import annotations

import pytest
import torch

from cde_nets import ODEBlock
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.fields import Hamiltonian
from cde_nets.solvers.gradients.implicit_adjoint import pairs_with_partner
from cde_nets.solvers.steppers.implicit_tableaux import ImplicitTableau

D = torch.float64


def _grads(method, gradient, steps=10, options=None):
    f = Hamiltonian(4, layers=3, T=1.0, generator=torch.Generator().manual_seed(8)).double()
    y0 = torch.randn(5, 4, dtype=D, generator=torch.Generator().manual_seed(9)).requires_grad_(True)
    blk = ODEBlock(f, method=method, gradient=gradient, step_size=1.0 / steps, options=options or {})
    params = list(f.parameters())
    sol = blk.solve(y0)
    out = torch.autograd.grad((sol.y**2).sum(), [y0, *params])
    return out, sol.stats


@pytest.mark.parametrize("method", ["implicit_midpoint", "gl4", "gl6", "radauIIA3"])
def test_symplectic_adjoint_equals_backprop(method):
    """Backprop differentiates each step by the implicit function theorem; the symplectic adjoint integrates the
    adjoint system with the partner method from re-solved stages. Same map, same gradient: to 1e-10 relative
    (gl6, gl4 and implicit midpoint are their own partners; radauIIA3's partner is another method)."""
    ref, _ = _grads(method, "backprop")
    got, stats = _grads(method, "symplectic")
    for a, r in zip(got, ref):
        assert float((a - r).abs().max()) <= 1e-10 * float(r.abs().max()), method
    assert stats["steps_backward"] == stats["steps_forward"] == 12 and stats["nfe_backward"] > 0


def test_symplectic_adjoint_with_fixed_point_newton_equals_backprop():
    ref, _ = _grads("gl4", "backprop", options={"newton": "fixed_point"})
    got, _ = _grads("gl4", "symplectic", options={"newton": "fixed_point"})
    for a, r in zip(got, ref):
        assert float((a - r).abs().max()) <= 1e-10 * float(r.abs().max())


def test_symplectic_adjoint_equals_finite_differences():
    f = Hamiltonian(4, T=0.6, generator=torch.Generator().manual_seed(3)).double()
    y0 = torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(4))
    blk = ODEBlock(f, method="gl4", gradient="symplectic", step_size=0.2)
    y = y0.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((blk(y) ** 2).sum(), y)
    eps = 1e-6
    with torch.no_grad():
        for idx in [(0, 0), (1, 3)]:
            e = torch.zeros_like(y0)
            e[idx] = eps
            fd = ((blk(y0 + e) ** 2).sum() - (blk(y0 - e) ** 2).sum()) / (2 * eps)
            assert abs(float(fd) - float(g[idx])) < 1e-7 * max(1.0, abs(float(fd)))


def test_symplectic_adjoint_backward_memory_does_not_grow_with_steps():
    """Bytes autograd holds at once during the backward pass (the graphs built there): the same for 5 and 40 steps,
    and below checkpoint's, which rebuilds a whole step's graph (s evaluations and the stage Jacobians). Simplified
    Newton: the fixed point's retained graph saves its own output, which the counting hooks would hold in a
    reference cycle until garbage collection."""
    f = Hamiltonian(8, T=1.0, generator=torch.Generator().manual_seed(0)).double()
    y0 = torch.randn(16, 8, dtype=D, generator=torch.Generator().manual_seed(1))
    peak = {}
    for gradient in ("symplectic", "checkpoint"):
        for steps in (5, 40):
            blk = ODEBlock(f, method="gl6", gradient=gradient, step_size=1.0 / steps, options={"newton": "simplified"})
            loss = (blk(y0) ** 2).sum()
            mem = SavedTensorMemory(exclude=[*f.parameters(), y0])
            with mem:
                loss.backward()
            peak[gradient, steps] = mem.peak_bytes
    assert peak["symplectic", 5] == peak["symplectic", 40] > 0, peak
    assert peak["symplectic", 40] < peak["checkpoint", 40], peak


def test_symplectic_adjoint_refusals_name_the_fix():
    f = Hamiltonian(4, K="blockdiag", T=1.0).double()
    with pytest.raises(ValueError, match="symplectic composition of Störmer-Verlet steps.*gradient='reversible'"):
        ODEBlock(f, method="yoshida4", gradient="symplectic", step_size=0.1)
    zero_weight = ImplicitTableau(
        name="zero_weight", a=((0.0, 0.0), (0.5, 0.5)), b=(0.0, 1.0), c=(0.0, 1.0), order=1, properties=frozenset()
    )
    assert not pairs_with_partner(zero_weight)
