"""A complex state on the library's stepper: the Schrödinger equation ``y' = −iθHy`` (``H`` Hermitian), whose
solution ``y(T) = expm(−iθHT) y_0`` gives the values and, for the loss ``ℒ = Re(cᴴ y(T))``, the gradients
``∂ℒ/∂θ = Re(cᴴ (−iHT) y(T))`` and (torch's convention for a complex leaf, ``∂ℒ/∂Re y_0 + i ∂ℒ/∂Im y_0``)
``∂ℒ/∂y_0 = expm(iθHT) c``. Every gradient mode of ``cde_nets.odeint`` and the continuous adjoint of
``odeint_adjoint`` match them; so do the event search, the fixed-step methods and decreasing times."""

import pytest
import torch
from torch import nn

from cde_nets import odeint, odeint_adjoint, odeint_event

C128 = torch.complex128
T = 1.0


class Schrodinger(nn.Module):
    def __init__(self, H: torch.Tensor):
        super().__init__()
        self.H = H
        self.theta = nn.Parameter(torch.tensor(0.7, dtype=torch.float64))

    def forward(self, t, y):
        return -1j * self.theta * (self.H @ y)


def _problem():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(3, 3, dtype=C128, generator=g)
    H = (A + A.conj().T) / 2
    y0 = torch.randn(3, dtype=C128, generator=g)
    c = torch.randn(3, dtype=C128, generator=g)
    return Schrodinger(H), y0, c


def _closed_form(f: Schrodinger, y0: torch.Tensor, c: torch.Tensor):
    theta = float(f.theta.detach())
    yT = torch.linalg.matrix_exp(-1j * theta * f.H * T) @ y0
    d_theta = (c.conj() @ (-1j * f.H * T) @ yT).real
    d_y0 = torch.linalg.matrix_exp(1j * theta * f.H * T) @ c
    return yT, d_theta, d_y0


@pytest.mark.parametrize(
    "solve",
    [
        lambda f, y0, t: odeint(f, y0, t, rtol=1e-10, atol=1e-12),
        lambda f, y0, t: odeint(f, y0, t, rtol=1e-10, atol=1e-12, method="tsit5", gradient="adjoint"),
        lambda f, y0, t: odeint(f, y0, t, rtol=1e-10, atol=1e-12, method="dopri8", gradient="checkpoint"),
        lambda f, y0, t: odeint_adjoint(f, y0, t, rtol=1e-10, atol=1e-12, adjoint_params=(f.theta,)),
        # a backward norm over every part: the generic adjoint (solvers/gradients/rk_adjoint.py)
        lambda f, y0, t: odeint_adjoint(f, y0, t, rtol=1e-10, atol=1e-12, adjoint_options={}),
        lambda f, y0, t: odeint(f, y0, t, method="rk4", options={"step_size": 0.02}),
    ],
    ids=["backprop", "adjoint", "checkpoint", "odeint_adjoint", "full-norm-adjoint", "rk4"],
)
def test_values_and_gradients_are_the_closed_form(solve):
    f, y0, c = _problem()
    y0 = y0.clone().requires_grad_()
    t = torch.tensor([0.0, T], dtype=torch.float64)
    ys = solve(f, y0, t)
    yT, d_theta, d_y0 = _closed_form(f, y0.detach(), c)
    assert ys.dtype == C128 and ys.shape == (2, 3)
    assert float((ys[-1] - yT).abs().max()) < 1e-7
    loss = (c.conj() @ ys[-1]).real
    g_theta, g_y0 = torch.autograd.grad(loss, (f.theta, y0))
    assert abs(float(g_theta) - float(d_theta)) < 1e-7 * (1 + abs(float(d_theta)))
    assert float((g_y0 - d_y0).abs().max()) < 1e-7


def test_decreasing_times_and_the_event_search():
    """Backwards from ``y(T)`` the solve returns ``y_0``; the event ``Re y_1(t) = Re y_1(T)`` recurs at ``T``."""
    f, y0, _ = _problem()
    yT = _closed_form(f, y0, y0)[0]
    with torch.no_grad():
        back = odeint(f, yT, torch.tensor([T, 0.0], dtype=torch.float64), rtol=1e-10, atol=1e-12)
    assert float((back[-1] - y0).abs().max()) < 1e-7
    level = float(yT[1].real)
    start = torch.linalg.matrix_exp(-1j * float(f.theta.detach()) * f.H * (T - 0.05)) @ y0
    t_event, sol = odeint_event(
        f,
        start,
        torch.tensor(T - 0.05, dtype=torch.float64),
        event_fn=lambda t, y: y[1].real - level,
        rtol=1e-10,
        atol=1e-12,
    )
    assert abs(float(t_event) - T) < 1e-7 and float((sol[-1] - yT).abs().max()) < 1e-6


def test_the_event_times_gradient_is_its_derivative():
    """``t*(θ)`` where ``Re y_1 + Im y_1`` reaches a level: ``dt*/dθ`` by the implicit function theorem, which for
    a complex state reads ``dg/dt = Re(conj(∂g/∂y) · F)`` (torch's gradient of a real function of a complex tensor:
    without the conjugate the imaginary part's term changes sign), against the central difference of the search."""
    f, y0, _ = _problem()
    yT = _closed_form(f, y0, y0)[0]
    level, t0 = float(yT[1].real + yT[1].imag), torch.tensor(T - 0.05, dtype=torch.float64)
    start = torch.linalg.matrix_exp(-1j * float(f.theta.detach()) * f.H * (T - 0.05)) @ y0

    def event_time() -> torch.Tensor:
        kw = dict(rtol=1e-11, atol=1e-13)
        return odeint_event(f, start, t0, event_fn=lambda t, y: y[1].real + y[1].imag - level, **kw)[0]

    (grad,) = torch.autograd.grad(event_time(), f.theta)
    eps, theta = 1e-6, f.theta.detach().clone()
    with torch.no_grad():
        f.theta.copy_(theta + eps)
        up = event_time()
        f.theta.copy_(theta - eps)
        down = event_time()
        f.theta.copy_(theta)
    assert abs(float(grad) - float(up - down) / (2 * eps)) < 1e-5 * (1 + abs(float(grad)))
