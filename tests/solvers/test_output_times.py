"""Gradients with respect to the output times of ``ODEBlock.solve(y0, t=t)``: ``∂y(t_i)/∂t_i = F(t_i, y(t_i))``,
and for a first time that is the start, minus the sensitivity through ``y0`` — in every gradient mode."""

import math

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock

MODES = [("dopri5", "adjoint"), ("dopri5", "backprop"), ("dopri5", "checkpoint"), ("dopri5", "symplectic")]
MODES += [("alf", "reversible")]


class Decay(nn.Module):
    def forward(self, t, y):
        return -y


class Driven(nn.Module):
    """A non-autonomous, nonlinear field: ``y' = sin(3t) tanh(W y) + cos(t)``."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W = nn.Parameter(torch.randn(3, 3, generator=g, dtype=torch.float64) * 0.7)

    def forward(self, t, y):
        return torch.sin(3 * t) * torch.tanh(y @ self.W.T) + torch.cos(t)


def _block(field, method, gradient, T=1.0):
    tol = {} if method == "alf" else dict(rtol=1e-11, atol=1e-13)
    if method == "alf":
        return ODEBlock(field, T=T, method="alf", gradient=gradient, step_size=1e-3)
    return ODEBlock(field, T=T, method=method, gradient=gradient, **tol)


@pytest.mark.parametrize("method,gradient", MODES)
def test_decay_closed_form(method, gradient):
    """``y(t_1) = y_0 e^{−(t_1 − t_0)}``: ``∂y(t_1)/∂(t_0, t_1) = (+e^{−1}, −e^{−1})`` at ``t = [0, 1]``, y_0 = 1."""
    block = _block(Decay(), method, gradient)
    t = torch.tensor([0.0, 1.0], dtype=torch.float64, requires_grad=True)
    y0 = torch.ones(1, 1, dtype=torch.float64)
    block.solve(y0, t=t).ys[-1].sum().backward()
    tol = 1e-6 if method == "alf" else 1e-9
    assert t.grad is not None
    torch.testing.assert_close(
        t.grad, torch.tensor([math.exp(-1), -math.exp(-1)], dtype=torch.float64), atol=tol, rtol=0
    )


@pytest.mark.parametrize("method,gradient", MODES[:2])
def test_decay_later_and_decreasing_times(method, gradient):
    """Times after the origin are output times only: ``∂ℒ/∂t_i = −e^{−t_i}`` for ``ℒ = Σ y(t_i)``. Decreasing
    times start from ``y0`` at ``T``: ``y(t) = e^{T − t}``, so ``∂ℒ/∂t = −e^{T − t}`` for later times and the
    first (the start, ``T``) gets ``+Σ_i e^{T − t_i}``, minus its own output term ``−1``."""
    block = _block(Decay(), method, gradient)
    y0 = torch.ones(1, 1, dtype=torch.float64)
    t = torch.tensor([0.25, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    block.solve(y0, t=t).ys.sum().backward()
    torch.testing.assert_close(t.grad, -torch.exp(-t.detach()), atol=1e-9, rtol=0)

    t = torch.tensor([1.0, 0.5, 0.25], dtype=torch.float64, requires_grad=True)
    block.solve(y0, t=t).ys.sum().backward()
    e = torch.exp(1.0 - t.detach())
    expected = -e
    expected[0] = -1.0 + e.sum()
    torch.testing.assert_close(t.grad, expected, atol=1e-9, rtol=0)


@pytest.mark.parametrize("method", ["dopri5", "rk4"])
@pytest.mark.parametrize("gradient", ["checkpoint", "symplectic"])
def test_replay_runs_backwards_in_time(method, gradient):
    """Decreasing times start from ``y0`` at ``T = 1``: ``y(t) = y0 e^{1 − t}``, so for ``t = [1, 0.5, 0.25]``
    ``∂Σy(t_i)/∂y0 = Σ e^{1 − t_i} = 4.77`` (the replay read its steps forwards and gave 2.08 before), and the
    replayed gradient is backprop's through the same steps."""
    y0 = torch.ones(1, 1, dtype=torch.float64, requires_grad=True)
    t = [1.0, 0.5, 0.25]
    grads = {}
    for g in (gradient, "backprop"):
        block = ODEBlock(Decay(), T=1.0, method="rk4", gradient=g, step_size=0.05) if method == "rk4" else None
        block = block or _block(Decay(), method, g)
        (grads[g],) = torch.autograd.grad(block.solve(y0, t=t).ys.sum(), y0)
    exact = sum(math.exp(1.0 - ti) for ti in t)
    tol = 1e-6 if method == "dopri5" else 1e-5
    assert abs(float(grads[gradient]) - exact) < tol
    torch.testing.assert_close(grads[gradient], grads["backprop"], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("method,gradient", MODES[:4])
def test_against_finite_differences(method, gradient):
    """A non-autonomous nonlinear field: ``∂ℒ/∂t`` against central differences of the solve (float64). (A
    first time at the origin is the start time, as in ``test_decay_closed_form``; the functional ``odeint``'s
    tests difference a moving start.)"""
    torch.manual_seed(0)
    block = _block(Driven(), method, gradient, T=2.0)
    y0 = torch.randn(2, 3, dtype=torch.float64)
    w = torch.randn(3, 2, 3, dtype=torch.float64)
    # the block starts at its origin 0 whatever t[0] (> 0) is: every time here is an output time
    t = torch.tensor([0.3, 0.7, 1.9], dtype=torch.float64, requires_grad=True)
    (block.solve(y0, t=t).ys * w).sum().backward()

    def loss(tt):
        with torch.no_grad():
            return float((block.solve(y0, t=tt).ys * w).sum())

    h = 1e-5
    fd = []
    for i in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[i] = h
        fd.append((loss(t.detach() + e) - loss(t.detach() - e)) / (2 * h))
    torch.testing.assert_close(t.grad, torch.tensor(fd, dtype=torch.float64), atol=1e-6, rtol=1e-6)


def test_sde_block_refuses_times_that_require_grad():
    """The SDE block cannot differentiate its output times: a clear error instead of a silently dropped gradient."""
    from cde_nets import SDEBlock, SDESettings

    block = SDEBlock(
        Decay(),
        T=1.0,
        noise="additive",
        sigma=0.1,
        method="euler",
        step_size=0.25,
        seed=0,
        settings=SDESettings(channels=1),
    )
    t = torch.tensor([0.5, 1.0], requires_grad=True)
    with pytest.raises(ValueError, match="does not differentiate its output times"):
        block.solve(torch.ones(2, 1), t=t)
    assert block.solve(torch.ones(2, 1), t=t.detach()).ys.shape == (2, 2, 1)


def test_piecewise_field_agrees_across_modes_and_with_finite_differences():
    """A 4-piece Hamiltonian field (times off the piece boundaries): every mode gives the central difference."""
    from cde_nets.fields import Hamiltonian

    torch.manual_seed(0)
    field = Hamiltonian(dim=4, layers=4, T=1.0).double()
    y0 = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(3, 3, 4, dtype=torch.float64)
    tol = dict(rtol=1e-11, atol=1e-13)
    grads = []
    for gradient in ("adjoint", "backprop", "checkpoint", "symplectic"):
        t = torch.tensor([0.1, 0.6, 0.9], dtype=torch.float64, requires_grad=True)
        (ODEBlock(field, gradient=gradient, **tol).solve(y0, t=t).ys * w).sum().backward()
        grads.append(t.grad)
    block = ODEBlock(field, gradient="backprop", **tol)
    h, fd = 1e-6, []
    for i in range(3):
        e = torch.zeros(3, dtype=torch.float64)
        e[i] = h
        with torch.no_grad():
            hi = (block.solve(y0, t=torch.tensor([0.1, 0.6, 0.9], dtype=torch.float64) + e).ys * w).sum()
            lo = (block.solve(y0, t=torch.tensor([0.1, 0.6, 0.9], dtype=torch.float64) - e).ys * w).sum()
        fd.append(float(hi - lo) / (2 * h))
    for g in grads:
        torch.testing.assert_close(g, torch.tensor(fd, dtype=torch.float64), atol=1e-6, rtol=1e-6)
