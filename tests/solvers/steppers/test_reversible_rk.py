"""The reversible Runge-Kutta methods (McCallum & Foster 2024, arXiv:2410.11648): the rebuild's gradient equals
backpropagation through the same steps, the rebuild is exact to rounding, the scheme keeps its base's order, and
memory held for backward does not grow with the steps (:mod:`cde_nets.solvers.steppers.reversible_rk`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.diagnostics import SavedTensorMemory
from cde_nets.solvers.steppers.reversible_rk import base_of, reconstruction_error, rev_inverse, rev_step

F64 = torch.float64


class _Field(nn.Module):
    """A small non-autonomous MLP field: ``tanh(W y + b) + 0.3 sin(t)``."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(2, 2, generator=g, dtype=F64))
        self.b = nn.Parameter(torch.randn(2, generator=g, dtype=F64))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(y @ self.w.T + self.b) + 0.3 * torch.sin(t)


T_OUT = torch.tensor([0.0, 0.4, 1.5, 2.0], dtype=F64)
CASES = {
    "reversible_dopri5": dict(rtol=1e-7, atol=1e-9),
    "reversible_tsit5": dict(rtol=1e-7, atol=1e-9, options={"coupling": 0.99}),
    "reversible_rk4": dict(step_size=0.05),
}


def _grads(method: str, gradient: str):
    field = _Field()
    y0 = torch.tensor([[0.3, -0.7], [1.1, 0.2]], dtype=F64, requires_grad=True)
    sol = ODEBlock(field, 2.0, method=method, gradient=gradient, **CASES[method]).solve(y0, t=T_OUT)
    w = torch.linspace(-1.0, 1.0, sol.ys.numel(), dtype=F64).reshape(sol.ys.shape)
    return sol, torch.autograd.grad((sol.ys * w).sum(), [y0, *field.parameters()])


@pytest.mark.parametrize("method", list(CASES))
def test_reversible_gradient_equals_backprop_through_the_same_steps(method: str) -> None:
    sol_r, g_r = _grads(method, "reversible")
    sol_b, g_b = _grads(method, "backprop")
    assert sol_r.stats["steps_forward"] == sol_b.stats["steps_forward"] == sol_r.stats["steps_backward"] > 10
    assert torch.equal(sol_r.ys, sol_b.ys)
    for a, b in zip(g_r, g_b):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_both_doors_agree_and_the_gradient_is_the_discrete_map_s() -> None:
    field = _Field()
    y0 = torch.tensor([[0.3, -0.7]], dtype=F64, requires_grad=True)
    kw = dict(method="reversible_rk4", options={"step_size": 0.1})
    ys = odeint(field, y0, T_OUT, gradient="reversible", **kw)
    block = ODEBlock(field, 2.0, method="reversible_rk4", step_size=0.1, gradient="reversible")
    torch.testing.assert_close(ys, block.solve(y0, t=T_OUT).ys, rtol=1e-14, atol=1e-14)
    (g,) = torch.autograd.grad(ys[-1, 0, 0], [field.b])
    eps = 1e-6
    with torch.no_grad():  # central differences of the same fixed-step solve
        diffs = []
        for s in (eps, -eps):
            field.b[1] += s
            diffs.append(odeint(field, y0, T_OUT, **kw)[-1, 0, 0])
            field.b[1] -= s
    assert abs(float(g[1]) - float(diffs[0] - diffs[1]) / (2 * eps)) < 1e-8


def _pendulum(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.stack([y[..., 1], -torch.sin(y[..., 0])], -1)


def test_the_start_is_rebuilt_to_rounding_over_many_steps() -> None:
    y0 = torch.tensor([1.0, 0.5], dtype=F64)
    assert reconstruction_error(_pendulum, "reversible_dopri5", y0, T=20.0, steps=200) < 1e-13
    # one step and its inverse are exact inverses for any coupling λ in (0, 1]
    tab = base_of("reversible_rk4")
    for lam in (1.0, 0.5):
        y1, z1 = rev_step(_pendulum, tab, lam, y0, 0.9 * y0, 0.0, 0.3)
        y, z = rev_inverse(_pendulum, tab, lam, y1, z1, 0.0, 0.3)
        torch.testing.assert_close(torch.stack([y, z]), torch.stack([y0, 0.9 * y0]), rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    ("method", "steps"),
    [("reversible_rk4", (32, 64, 128)), ("reversible_bosh3", (16, 32, 64)), ("reversible_dopri5", (8, 16, 32))],
)
def test_the_order_is_the_base_s(method: str, steps: tuple[int, ...]) -> None:
    """``y' = t − y``, ``y(0) = 1``: ``y(t) = t − 1 + 2e^{−t}``; the slope of log error against log h."""
    T, tab = 2.0, base_of(method)
    errs = []
    for n in steps:
        h = T / n
        y = z = torch.tensor([1.0], dtype=F64)
        for k in range(n):
            y, z = rev_step(lambda t, x: t - x, tab, 0.999, y, z, k * h, (k + 1) * h)
        errs.append(abs(float(y) - (T - 1 + 2 * math.exp(-T))))
    slope = np.polyfit(np.log([T / n for n in steps]), np.log(errs), 1)[0]
    assert abs(slope - tab.order) < 0.35, (errs, slope)


def test_memory_held_for_backward_does_not_grow_with_the_steps() -> None:
    field = _Field()
    y0 = torch.tensor([[0.3, -0.7]], dtype=F64, requires_grad=True)
    held = {}
    for gradient, n in [(g, n) for g in ("reversible", "backprop") for n in (10, 40)]:
        block = ODEBlock(field, 1.0, method="reversible_rk4", step_size=1.0 / n, gradient=gradient)
        mem = SavedTensorMemory(exclude=[*field.parameters(), y0])
        with mem:
            y = block(y0)
        y.sum().backward()
        held[gradient, n] = mem.peak_bytes
    assert held["reversible", 10] == held["reversible", 40] <= 2 * y0.numel() * 8
    assert held["backprop", 40] > 3 * held["backprop", 10]


def test_refusals_name_the_fix() -> None:
    field = _Field()
    with pytest.raises(ValueError, match="takes gradient='reversible'"):
        ODEBlock(field, 1.0, method="reversible_dopri5", gradient="checkpoint")
    with pytest.raises(ValueError, match="unknown option.*eta"):
        ODEBlock(field, 1.0, method="reversible_dopri5", options={"eta": 0.9})
    with pytest.raises(ValueError, match=r"options\['coupling'\].*\(0, 1\]"):
        ODEBlock(field, 1.0, method="reversible_dopri5", gradient="reversible", options={"coupling": 1.5})(
            torch.zeros(1, 2, dtype=F64)
        )
    with pytest.raises(ValueError, match="no error estimate.*step_size"):
        odeint(field, torch.zeros(1, 2, dtype=F64), T_OUT, method="reversible_rk4", gradient="reversible")


def test_piecewise_parameters_jump_between_steps() -> None:
    """A field whose parameters jump at T/4, T/2, 3T/4: the steps land on the jumps, and the rebuild's gradient
    (for every piece) is backprop's."""
    from cde_nets.fields import Hamiltonian

    g = torch.Generator().manual_seed(0)
    field = Hamiltonian(4, layers=4, T=1.0, generator=g).double()
    y0 = torch.randn(3, 4, generator=g, dtype=F64, requires_grad=True)
    out = []
    for gradient in ("reversible", "backprop"):
        block = ODEBlock(field, method="reversible_dopri5", rtol=1e-7, atol=1e-9, gradient=gradient)
        sol = block.solve(y0)
        out.append(torch.autograd.grad(sol.y.square().sum(), [y0, *field.parameters()]))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["reversible_rk4", "reversible_dopri5"])
def test_the_linearised_step_has_determinant_lambda_and_the_predicted_trace(method: str) -> None:
    """On ``y' = μ y`` a step maps ``(y, z)`` linearly: ``det = λ`` and ``trace = 1 + R − RS + λS``, with
    ``R = R(hμ)``, ``S = R(−hμ)`` the base's stability function (so the eigenvalues are ``R`` and ``λS`` where
    ``RS = 1``)."""
    tab, lam, h, mu = base_of(method), 0.9, 0.3, complex(-0.4, 1.3)
    f = lambda t, y: mu * y  # noqa: E731

    def stability(w: float) -> complex:
        one = torch.ones(1, dtype=torch.complex128)
        return complex((rev_step(f, tab, 1.0, one, one, 0.0, w)[0])[0])  # λ = 1, y = z: y_1 = R(hμ) y_0

    cols = [rev_step(f, tab, lam, *e, 0.0, h) for e in torch.eye(2, dtype=torch.complex128).reshape(2, 2, 1)]
    m = torch.tensor([[complex(c[i][0]) for c in cols] for i in range(2)], dtype=torch.complex128)
    r, s = stability(h), stability(-h)
    assert abs(complex(torch.linalg.det(m)) - lam) < 1e-14
    assert abs(complex(torch.trace(m)) - (1 + r - r * s + lam * s)) < 1e-14
