"""tsit5 (Tsitouras 2011, "Runge-Kutta pairs of order 5(4) satisfying only the first column simplifying
assumption"): its table checks its order conditions, its steps converge at order 5, its continuous extension at
order 4, and ``odeint(method="tsit5")`` serves every gradient mode (float64)."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from cde_nets import odeint, odeint_adjoint
from cde_nets.solvers.steppers.tableaux import TABLEAUX, MethodTableau, Tableau

F64 = torch.float64
TSIT5 = TABLEAUX["tsit5"]
W = 8.0  # y' = W cos(W t) y: y(t) = exp(sin(W t)), with derivatives of every order (W^k) to resolve


def _field(t, y):
    return W * torch.cos(W * t) * y


def _exact(t: float) -> float:
    return math.exp(math.sin(W * t))


def _fixed_steps(h: float, times: list[float]) -> torch.Tensor:
    """tsit5 held at step ``h``: every step accepted (loose tolerances) and capped at ``h``."""
    opts = dict(first_step=h, max_step=h)
    t = torch.tensor(times, dtype=F64)
    return odeint(_field, torch.tensor(1.0, dtype=F64), t, method="tsit5", rtol=1e3, atol=1e3, options=opts)


def _slope(hs, errs) -> float:
    return float(np.polyfit(np.log(hs), np.log(errs), 1)[0])


def test_tableau_checks_its_order_conditions():
    """One coefficient off in its 8th digit breaks an order condition; the table refuses to build."""
    a = [list(r) for r in TSIT5.tableau.a]
    a[4][2] += 1e-8
    a[4][0] -= 1e-8  # keep the row sum (the simplest check) intact
    bad = Tableau(a=tuple(tuple(r) for r in a), b=TSIT5.tableau.b, c=TSIT5.tableau.c)
    with pytest.raises(ValueError, match="tsit5: b misses an order-5 condition"):
        dataclasses.replace(TSIT5, tableau=bad)
    dense = [list(r) for r in TSIT5.dense]
    dense[3][1] += 1e-6
    with pytest.raises(ValueError, match="dense"):
        dataclasses.replace(TSIT5, dense=tuple(tuple(r) for r in dense))
    # a true fifth-order pair with a fourth-order embedded solution and a fourth-order dense output
    assert isinstance(TSIT5, MethodTableau) and TSIT5.order == 5 and TSIT5.dense_order == 4 and TSIT5.fsal


def test_steps_converge_at_order_five():
    """Global error at ``t = 2`` over 128 to 512 steps (errors 1e-8 to 1e-11: past tsit5's sixth-order terms,
    above rounding)."""
    hs = [2.0 / n for n in (128, 181, 256, 362, 512)]
    errs = [abs(float(_fixed_steps(h, [0.0, 2.0])[-1]) - _exact(2.0)) for h in hs]
    assert abs(_slope(hs, errs) - 5) < 0.1, errs


def test_continuous_extension_is_fourth_order():
    """One step from the exact start: the dense output at θ = 0.3, 0.7 errs by O(h^5), an order-4 interpolant
    (the quartic through torchdiffeq's midpoint would do as well; a cubic Hermite would show O(h^4))."""
    hs = [0.03 / 2**k for k in range(5)]
    for theta in (0.3, 0.7):
        errs = [abs(float(_fixed_steps(h, [0.0, theta * h, h])[1]) - _exact(theta * h)) for h in hs]
        assert abs(_slope(hs, errs) - 5) < 0.1, (theta, errs)


@pytest.mark.parametrize("gradient", ["backprop", "adjoint", "checkpoint", "symplectic"])
def test_gradients_in_every_mode(gradient):
    """``y' = −t y``: ``y(2) = y0 e^{−2}``, so ``∂y(2)/∂y0 = e^{−2}``; and the output time's gradient
    ``∂y(2)/∂t_1 = −t_1 y(t_1)``."""
    y0 = torch.tensor([1.0, -2.0], dtype=F64, requires_grad=True)
    t = torch.tensor([0.0, 0.7, 2.0], dtype=F64, requires_grad=True)
    ys = odeint(lambda t, y: -t * y, y0, t, method="tsit5", gradient=gradient, adjoint_params=())
    g_y0, g_t = torch.autograd.grad(ys[-1].sum(), (y0, t))
    assert torch.allclose(g_y0, torch.full_like(g_y0, math.exp(-2)), atol=1e-7)
    assert abs(float(g_t[-1]) - 2 * math.exp(-2) * 1.0) < 1e-6  # −t y(t) summed over y0 = (1, −2)


def test_torchdiffeqs_own_solves_take_the_same_steps():
    """A custom ``norm`` sends the solve into torchdiffeq (cde_nets' tsit5 registered there): the same steps and
    interpolant as the fast path, equal to rounding."""
    t = torch.tensor([0.0, 0.37, 1.3, 2.0], dtype=F64)
    y0 = torch.ones(3, dtype=F64)
    fast = odeint(_field, y0, t, method="tsit5")
    inside = odeint(_field, y0, t, method="tsit5", options=dict(norm=lambda x: x.pow(2).mean().sqrt()))
    assert torch.allclose(fast, inside, rtol=0, atol=1e-13)
    adj = odeint_adjoint(_field, y0, t, method="tsit5", adjoint_params=())
    exact = torch.tensor([_exact(float(s)) for s in t], dtype=F64)
    assert torch.allclose(adj, exact[:, None].expand(4, 3), atol=1e-6)


@pytest.mark.parametrize("gradient", ["backprop", "adjoint", "checkpoint", "symplectic"])
def test_the_block_serves_the_same_tsit5(gradient):
    """One name, one method: ``ODEBlock(method="tsit5")`` on ``y' = a y``: ``y(1) = e^a y0``,
    ``∂(Σ y(1))/∂a = e^a Σ y0``."""
    from torch import nn

    from cde_nets import ODEBlock

    class Decay(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor(-1.0, dtype=F64))

        def forward(self, t, y):
            return self.a * y

    field = Decay()
    y0 = torch.ones(3, 2, dtype=F64)
    y = ODEBlock(field, T=1.0, method="tsit5", gradient=gradient, rtol=1e-9, atol=1e-11)(y0)
    y.sum().backward()
    assert torch.allclose(y, torch.full_like(y, math.exp(-1)), atol=1e-9)
    assert abs(float(field.a.grad) - 6 * math.exp(-1)) < 1e-8
