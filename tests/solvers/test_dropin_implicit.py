"""The implicit Runge-Kutta methods through ``cde_nets.odeint``: torchdiffeq master's fixed-grid semantics
(``step_size``, ``grid_constructor``, ``perturb``, ``interp``), values fixed by each method's stability function,
gradients by the implicit function theorem against closed forms and finite differences (float64)."""

import math

import pytest
import torch
from torch import nn

from cde_nets import odeint, odeint_adjoint, odeint_event
from cde_nets.solvers.steppers.implicit_tableaux import IMPLICIT_TABLEAUX

F64 = torch.float64
METHODS = list(IMPLICIT_TABLEAUX)
LAM = -1.3


def _power(method: str, h: float, n: int) -> float:
    """``R(hλ)^n``: ``n`` steps of ``y' = λ y`` from ``y = 1`` multiply by the method's stability function."""
    return IMPLICIT_TABLEAUX[method].stability(h * LAM).real ** n


@pytest.mark.parametrize("method", METHODS)
def test_values_are_the_stability_function(method):
    """Over increasing and decreasing times (``t = 0 → 1`` and ``1 → 0``), any shape of state."""
    y0 = torch.ones(2, 3, dtype=F64)
    for t, h in ((torch.tensor([0.0, 0.5, 1.0], dtype=F64), 0.1), (torch.tensor([1.0, 0.0], dtype=F64), -0.1)):
        ys = odeint(lambda t, y: LAM * y, y0, t, method=method, options=dict(step_size=0.1))
        assert ys.shape == (len(t), 2, 3)
        assert abs(float(ys[-1, 1, 2]) - _power(method, h, 10)) < 1e-12


class Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([[0.3, -1.1], [0.9, -0.4]], dtype=F64))

    def forward(self, t, y):
        return torch.tanh(y @ self.w.T) * (1 + 0.5 * t)


@pytest.mark.parametrize(
    "method, gradient",
    [(m, g) for m in ("gl4", "radauIIA3", "sdirk2") for g in ("backprop", "checkpoint", "adjoint")]
    + [("gl4", "reversible")],
)
def test_gradients_against_finite_differences(method, gradient):
    """∂L/∂y0 and ∂L/∂w of the discrete solution (step 0.25, outputs between grid points read by the cubic
    interpolant) against central differences; ``reversible`` rebuilds the grid states backwards, exact to the Newton
    tolerance for the symmetric gl4; ``adjoint`` (torchdiffeq's ``odeint_adjoint``) is that backsolve for every
    method, exact for gl4 and within the local error for the others."""
    f = Field()
    y0 = torch.tensor([0.7, -0.2], dtype=F64, requires_grad=True)
    t = torch.tensor([0.0, 0.6, 1.5], dtype=F64)
    opts = dict(step_size=0.25, interp="cubic")

    def loss(y0_, w=None):
        if w is not None:
            with torch.no_grad():
                f.w.copy_(w)
        return odeint(f, y0_, t, method=method, options=opts, gradient=gradient)[1:].pow(2).sum()

    g_y0, g_w = torch.autograd.grad(loss(y0), (y0, f.w))
    w0, eps = f.w.detach().clone(), 1e-6
    tol = 1e-8 if gradient != "adjoint" or method == "gl4" else 1e-3
    with torch.no_grad():
        for i in range(2):
            e = torch.zeros(2, dtype=F64)
            e[i] = eps
            fd = (loss(y0 + e, w0) - loss(y0 - e, w0)) / (2 * eps)
            assert abs(float(fd - g_y0[i])) < tol
            E = torch.zeros(2, 2, dtype=F64)
            E[i, 1 - i] = eps
            fd = (loss(y0, w0 + E) - loss(y0, w0 - E)) / (2 * eps)
            assert abs(float(fd - g_w[i, 1 - i])) < tol
        f.w.copy_(w0)


def test_perturb_and_grid_options():
    """``perturb=True``: no evaluation at a grid point, forwards or backwards; ``False``: the Newton predictor
    evaluates at each step's start. A ``grid_constructor``'s grid is the one stepped on."""
    for perturb in (True, False):
        seen: list[float] = []

        def f(t, y, seen=seen):
            seen.append(float(t))
            return -y

        y0 = torch.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
        xs = odeint(
            f,
            y0,
            torch.tensor([0.0, 1.0]),
            method="trapezoid",
            options=dict(step_size=0.5, perturb=perturb),
            gradient="reversible",
            adjoint_params=(),
        )
        assert (0.0 in seen) != perturb and (0.5 in seen) != perturb
        seen.clear()
        xs.sum().backward()
        assert (1.0 in seen) != perturb and (0.5 in seen) != perturb
    grid = torch.tensor([0.0, 0.1, 0.5, 1.0], dtype=F64)
    ys = odeint(
        lambda t, y: LAM * y,
        torch.ones(1, dtype=F64),
        grid[[0, -1]],
        method="implicit_euler",
        options=dict(grid_constructor=lambda f, y0, t: grid),
    )
    expect = math.prod(1 / (1 - h * LAM) for h in (0.1, 0.4, 0.5))
    assert abs(float(ys[-1, 0]) - expect) < 1e-14


def test_callbacks_tuple_states_and_errors():
    steps, back = [], []

    class F(nn.Module):
        def forward(self, t, y):
            return (-y[0], y[0].pow(2).sum().expand(1))

        def callback_step(self, t0, y0, dt):
            steps.append(float(dt))

        def callback_step_adjoint(self, t0, y0, dt):
            back.append(float(dt))

    z0 = torch.ones(2, 2, dtype=F64, requires_grad=True)
    z, logp = odeint(
        F(),
        (z0, torch.zeros(1, dtype=F64)),
        torch.tensor([0.0, 1.0], dtype=F64),
        method="gl4",
        options=dict(step_size=0.1),
        gradient="reversible",
    )
    assert z.shape == (2, 2, 2) and logp.shape == (2, 1) and len(steps) == 10
    # logp(1) = Σ ∫ z² = 4 (1 − e^{−2}) / 2, to gl4's order 4 at h = 0.1
    assert abs(float(logp[-1, 0].detach()) - 2 * (1 - math.exp(-2))) < 1e-6
    logp[-1].sum().backward()
    assert len(back) == 10 and all(abs(d + 0.1) < 1e-12 for d in back)
    y0, t = torch.ones(2, dtype=F64), torch.tensor([0.0, 1.0], dtype=F64)
    with pytest.raises(ValueError, match="unknown key.*'rtol_newton'.*'gl4'"):
        odeint(lambda t, y: -y, y0, t, method="gl4", options=dict(step_size=0.1, rtol_newton=1e-3))
    off_grid, f = torch.tensor([0.0, 0.55, 1.0], dtype=F64), lambda t, y: -y  # 0.55: between the 0.1 grid points
    with pytest.raises(ValueError, match="gradient='symplectic' steps to every output time.*grid"):
        odeint(f, y0, off_grid, method="gl4", options=dict(step_size=0.1), gradient="symplectic", adjoint_params=())
    with pytest.raises(ValueError, match="leave `adjoint_method`"):
        odeint_adjoint(lambda t, y: -y, y0, t, method="gl4", adjoint_method="dopri5", adjoint_params=())
    with pytest.raises(ValueError, match="leave `adjoint_method`"):
        odeint_adjoint(lambda t, y: -y, y0, t, method="gl4", adjoint_rtol=1e-9, adjoint_params=())
    with pytest.raises(ValueError, match="'max_iters'.*positive integer"):
        odeint(lambda t, y: -y, y0, t, method="gl4", options=dict(step_size=0.1, max_iters=0))
    with pytest.raises(ValueError, match="exclusive"):
        odeint(lambda t, y: -y, y0, t, method="gl4", options=dict(step_size=0.1, grid_constructor=lambda f, y, t: t))


@pytest.mark.parametrize("method", ["implicit_midpoint", "radauIIA5"])
def test_event_time_and_its_gradient(method):
    """``y' = −y`` until ``y = 1/2``: ``t* = ln(2 y0)``, ``∂t*/∂y0 = 1/y0``."""
    y0 = torch.tensor(1.5, dtype=F64, requires_grad=True)
    t_star, ys = odeint_event(
        lambda t, y: -y,
        y0,
        torch.tensor(0.0, dtype=F64),
        event_fn=lambda t, y: y - 0.5,
        method=method,
        options=dict(step_size=0.01, interp="cubic"),
        atol=1e-10,
    )
    assert abs(float(t_star.detach()) - math.log(3)) < 1e-5 and abs(float(ys[-1].detach()) - 0.5) < 1e-6
    (g,) = torch.autograd.grad(t_star, y0)
    assert abs(float(g) - 1 / 1.5) < 1e-4


@pytest.mark.parametrize("method", ["implicit_midpoint", "gl4", "gl6"])
def test_a_fixed_grid_evaluates_the_field_at_every_grid_point_as_torchdiffeqs_does(method):
    """torchdiffeq's implicit steps start from ``F(t_0, y_0)``, so without ``perturb`` the field sees every grid
    point even where no stage lies on it (its suite's ``test_odeint_perturb``); with ``perturb`` none."""
    from cde_nets.functional import odeint

    for perturb in (False, True):
        seen: list[float] = []

        def f(t, x, seen=seen):
            seen.append(float(t))
            return -x

        odeint(
            f,
            torch.tensor([1.0, 2.0]),
            torch.tensor([0.0, 1.0]),
            method=method,
            options={"step_size": 0.25, "perturb": perturb},
        )
        assert ({0.0, 0.25, 0.5, 0.75} <= set(seen)) is not perturb
        assert not ({0.0, 0.25, 0.5, 0.75} & set(seen)) or not perturb
