"""gradient='gauss', the quadrature adjoint (solvers/gradients/quadrature.py): the adjoint state alone solved
backwards, the parameter gradient by Gauss-Legendre quadrature on each backward step.

Checked against closed forms (``y' = Ay``: ``y(T) = e^{AT} y_0``, whose gradient in ``A`` is the Fréchet derivative
of the matrix exponential, here by autograd through ``torch.linalg.matrix_exp`` in float64), against backprop and
central differences on an MLP field, and for the quadrature's order on fixed steps.
"""

import math

import pytest
import torch
from torch import nn

import cde_nets
from cde_nets import ODEBlock
from cde_nets.fields import Field
from cde_nets.fields.pieces import Pieces
from cde_nets.solvers.gradients import GRADIENTS, Gauss
from cde_nets.solvers.gradients.quadrature import gauss_legendre

F64 = torch.float64


class _Linear(nn.Module):
    """``y' = A y`` on a ``(batch, n)`` state."""

    def __init__(self, A: torch.Tensor):
        super().__init__()
        self.A = nn.Parameter(A.clone())

    def forward(self, t, y):
        return y @ self.A.T


class _MLP(nn.Module):
    def __init__(self, width: int = 12, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.l1, self.l2 = nn.Linear(3, width).double(), nn.Linear(width, 2).double()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64) / math.sqrt(p.shape[-1]))

    def forward(self, t, y):  # non-autonomous: the time is an input
        return self.l2(torch.tanh(self.l1(torch.cat([y, t.expand(*y.shape[:-1], 1)], -1))))


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    A = 0.6 * torch.randn(3, 3, generator=g, dtype=F64)
    y0 = torch.randn(2, 3, generator=g, dtype=F64)
    c = torch.randn(4, 2, 3, generator=g, dtype=F64)  # one cotangent per output time
    return A, y0, c


def _exact(A, y0, c, t):
    """``∂/∂(A, y_0)`` of ``Σ_i c_i · e^{A t_i} y_0``, by autograd through the matrix exponential."""
    A, y0 = A.clone().requires_grad_(), y0.clone().requires_grad_()
    loss = sum((c[i] * (y0 @ torch.linalg.matrix_exp(A * ti).T)).sum() for i, ti in enumerate(t.tolist()))
    return torch.autograd.grad(loss, (A, y0))


def _grads_odeint(field, y0, c, t, gradient, **kw):
    y = y0.clone().requires_grad_()
    ys = cde_nets.odeint(field, y, t, gradient=gradient, **kw)
    loss = (c[: len(t)] * ys).sum()
    return torch.autograd.grad(loss, (*field.parameters(), y))


def _grads_block(field, y0, c, t, gradient, **kw):
    y = y0.clone().requires_grad_()
    ys = ODEBlock(field, T=float(t[-1]), gradient=gradient, **kw).solve(y, t=t).ys
    loss = (c[: len(t)] * ys).sum()
    return torch.autograd.grad(loss, (*field.parameters(), y))


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def test_linear_field_matches_the_closed_form_in_both_doors():
    A, y0, c = _problem()
    t = torch.tensor([0.0, 0.4, 1.0, 1.5], dtype=F64)
    gA, gy = _exact(A, y0, c, t)
    # the continuous gradient to the tolerance's reach: 1e-8 relative at rtol = atol = 1e-10 (measured 3e-10)
    kw = dict(method="dopri5", rtol=1e-10, atol=1e-10)
    via_odeint = _grads_odeint(_Linear(A), y0, c, t, "gauss", **kw)
    via_block = _grads_block(_Linear(A), y0, c, t, Gauss(), **kw)
    assert _rel(via_odeint[0], gA) < 1e-8 and _rel(via_odeint[1], gy) < 1e-8
    for a, b in zip(via_odeint, via_block):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # decreasing times, fixed steps: the same closed form (e^{A t} for t < 0)
    tb = torch.tensor([0.0, -0.5, -1.0], dtype=F64)
    gA, gy = _exact(A, y0, c, tb)
    got = _grads_odeint(_Linear(A), y0, c, tb, "gauss", method="rk4", options=dict(step_size=0.05))
    assert _rel(got[0], gA) < 1e-6 and _rel(got[1], gy) < 1e-6  # rk4's error, (0.05)^4 times a constant


def test_mlp_field_matches_backprop_and_central_differences():
    field = _MLP()
    g = torch.Generator().manual_seed(3)
    y0 = torch.randn(2, 2, generator=g, dtype=F64)
    c = torch.randn(3, 2, 2, generator=g, dtype=F64)
    t = torch.tensor([0.0, 0.4, 1.0], dtype=F64)
    got = _grads_odeint(field, y0, c, t, "gauss", method="dopri5", rtol=1e-9, atol=1e-9)
    ref = _grads_odeint(field, y0, c, t, "backprop", method="dopri5", rtol=1e-11, atol=1e-11)
    flat = lambda gs: torch.cat([x.reshape(-1) for x in gs])  # noqa: E731
    # the reach at rtol = atol = 1e-9: 1e-6 relative to backprop's gradient at 1e-11 (measured 1e-8)
    assert _rel(flat(got), flat(ref)) < 1e-6
    # central differences of the loss along a random direction of every parameter (float64, h = 1e-4)
    params = list(field.parameters())
    v = [torch.randn(p.shape, generator=g, dtype=F64) for p in params]

    def loss(shift: float) -> float:
        with torch.no_grad():
            for p, d in zip(params, v):
                p.add_(shift * d)
            ys = cde_nets.odeint(field, y0, t, method="dopri5", rtol=1e-12, atol=1e-12)
            for p, d in zip(params, v):
                p.sub_(shift * d)
        return float((c * ys).sum())

    h = 1e-4
    fd = (loss(h) - loss(-h)) / (2 * h)
    directional = sum(float((gp * d).sum()) for gp, d in zip(got[:-1], v))
    assert abs(directional - fd) < 1e-6 * abs(fd)  # measured 1e-7


def test_the_quadrature_order_on_fixed_steps():
    """rk4's steps, the parameter gradient's error against the closed form as the step halves: the ``m``-point
    rule's order ``2m`` shows (midpoint rule: 2) until the steps' own order (4) caps it."""
    A, y0, c = _problem(1)
    t = torch.tensor([0.0, 1.0], dtype=F64)
    gA, _ = _exact(A, y0, c[:2], t)

    def slope(nodes: int) -> float:
        errs = []
        for n in (8, 16, 32):
            got = _grads_odeint(_Linear(A), y0, c, t, Gauss(nodes=nodes), method="rk4", options=dict(step_size=1 / n))
            errs.append(_rel(got[0], gA))
        return math.log2(errs[0] / errs[-1]) / 2

    assert abs(slope(1) - 2) < 0.1  # measured 2.00
    assert abs(slope(2) - 4) < 0.2  # measured 4.02
    xs, ws = gauss_legendre(3)  # the rule itself: exact for degree 5, not 6
    assert abs(sum(w * x**5 for x, w in zip(xs, ws)) - 1 / 6) < 1e-15
    assert abs(sum(w * x**6 for x, w in zip(xs, ws)) - 1 / 7) > 1e-4


class _PiecewiseTanh(Field):
    """``y' = tanh(W_l y + c_l)`` with ``(W_l, c_l)`` constant on each of four pieces of ``[0, 1]``."""

    def __init__(self):
        super().__init__(T=1.0, layers=4)
        self.state_shape = (3,)
        g = torch.Generator().manual_seed(5)
        self.W = Pieces(self.grid, (3, 3), init=torch.randn(4, 3, 3, generator=g, dtype=F64))
        self.c = Pieces(self.grid, (3,), init=torch.randn(4, 3, generator=g, dtype=F64))

    def evaluate(self, l, x):
        return torch.tanh(x @ self.W[l].T + self.c[l])


@pytest.mark.parametrize("solver", [dict(method="rk4", step_size=0.05), dict(method="dopri5", rtol=1e-8, atol=1e-8)])
def test_parameters_constant_on_pieces(solver):
    """The field jumps at the piece boundaries: the dense output of the step that ends on one takes its end slope
    on the step's own side (the next step's first slope is read on the far side: taken from there, rk4's gradient
    was 5e-4 from backprop's, against 1.4e-7 now and 7e-8 for the adjoint)."""
    field = _PiecewiseTanh()
    y0 = torch.randn(2, 3, generator=torch.Generator().manual_seed(6), dtype=F64)

    def grads(gradient):
        field.zero_grad()
        y = y0.clone().requires_grad_()
        ODEBlock(field, gradient=gradient, **solver)(y).square().sum().backward()
        return torch.cat([y.grad.reshape(-1), *(p.grad.reshape(-1) for p in field.parameters())])

    # rk4 at h = 0.05: the continuous gradient is O(h^4) from the steps' (backprop's): measured 1.4e-7;
    # dopri5 at rtol 1e-8: 5e-8
    assert _rel(grads("gauss"), grads("backprop")) < (1e-6 if solver["method"] == "rk4" else 1e-7)


def test_refusals_name_the_argument_and_the_fix():
    assert GRADIENTS["gauss"] is Gauss
    field, y0 = _Linear(torch.eye(2, dtype=F64)), torch.ones(1, 2, dtype=F64)
    with pytest.raises(ValueError, match="gradient='gauss'.*method='implicit_adams'.*gradient='adjoint'"):
        cde_nets.odeint(field, y0, torch.tensor([0.0, 1.0], dtype=F64), method="implicit_adams", gradient="gauss")
    with pytest.raises(ValueError, match="method='alf'.*gradient='reversible'"):
        ODEBlock(field, T=1.0, method="alf", gradient="gauss")
    with pytest.raises(ValueError, match="`nodes` must be a positive integer"):
        Gauss(nodes=0)
    with pytest.raises(ValueError, match="`rtol` must be a finite number > 0"):
        Gauss(rtol=-1.0)
