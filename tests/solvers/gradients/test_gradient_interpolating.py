"""The interpolating adjoint (solvers/gradients/interpolating.py): the continuous adjoint solved backwards along the
forward solve's dense output. Where the backsolve adjoint's time-reversed solve fails (stiff Van der Pol) it
matches backprop; on a linear system it matches the closed form (expm) and central differences; both doors agree;
the plain and checkpointed variants read the same dense output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.errors import Reason, SolverError
from cde_nets.solvers.gradients import Interpolating, as_gradient

F64 = torch.float64


class VdP(torch.nn.Module):
    """Van der Pol per sample, ``x'' = μ (1 − x²) x' − x``, one ``μ`` per sample as a parameter."""

    def __init__(self, mu: torch.Tensor):
        super().__init__()
        self.mu = torch.nn.Parameter(mu)

    def forward(self, t, y):
        x, v = y[..., 0], y[..., 1]
        return torch.stack([v, self.mu * (1 - x * x) * v - x], -1)


class Linear(torch.nn.Module):
    def __init__(self, A: torch.Tensor):
        super().__init__()
        self.A = torch.nn.Parameter(A)

    def forward(self, t, y):
        return y @ self.A.T


def _vdp_grads(gradient, times):
    mu = torch.linspace(1.0, 25.0, 8, dtype=F64)
    field = VdP(mu)
    y0 = torch.stack([torch.full((8,), 2.0, dtype=F64), torch.zeros(8, dtype=F64)], -1).requires_grad_()
    ys = odeint(field, y0, times, rtol=1e-5, atol=1e-5, method="dopri5", gradient=gradient)
    ys[1:].square().sum().backward()
    return torch.cat([field.mu.grad, y0.grad.flatten()])


@pytest.mark.slow  # about 2 s, most of it the backsolve adjoint's steps before it underflows
def test_stiff_van_der_pol_where_the_backsolve_adjoint_underflows():
    """A batch of 8 with μ from 1 to 25 over [0, 2], dopri5 at 1e-5: the backsolve adjoint's time-reversed solve
    (the state integrated backwards beside the adjoint) underflows; the interpolating adjoint, which reads the
    state off the forward dense output, is within 1e-4 of backprop's gradient in both variants."""
    times = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    with pytest.raises(SolverError, match="underflow") as info:
        _vdp_grads("adjoint", times)
    assert info.value.reason is Reason.UNDERFLOW
    ref = _vdp_grads("backprop", times)
    for gradient in (Interpolating(), Interpolating(checkpoints=True)):
        g = _vdp_grads(gradient, times)
        assert torch.isfinite(g).all()
        assert (g - ref).norm() / ref.norm() < 1e-4, gradient


def _linear_problem():
    gen = torch.Generator().manual_seed(0)
    A = 0.5 * torch.randn(3, 3, dtype=F64, generator=gen) - 0.3 * torch.eye(3, dtype=F64)
    y0 = torch.randn(4, 3, dtype=F64, generator=gen)
    w = torch.randn(3, 4, 3, dtype=F64, generator=gen)  # the loss's weights at t = 0.4, 0.7, 1
    return A, y0, w


def _loss(ys, w):
    return (ys[1:] * w).sum()


def _exact(A, y0, w, times):
    """The loss and its gradient through ``y(t) = y0 expm(A t)ᵀ`` (autograd of ``matrix_exp``: its Fréchet
    derivative)."""
    A, y0 = A.clone().requires_grad_(), y0.clone().requires_grad_()
    ys = torch.stack([y0 @ torch.linalg.matrix_exp(A * t).T for t in times])
    _loss(ys, w).backward()
    return torch.cat([A.grad.flatten(), y0.grad.flatten()])


def _odeint_grads(A, y0, w, times, gradient, **kw):
    field, y = Linear(A.clone()), y0.clone().requires_grad_()
    _loss(odeint(field, y, times, gradient=gradient, **kw), w).backward()
    return torch.cat([field.A.grad.flatten(), y.grad.flatten()])


@pytest.mark.parametrize("checkpoints", [False, True])
def test_linear_system_matches_expm_and_central_differences_through_both_doors(checkpoints):
    """``y' = A y``: the gradient is within the tolerance's reach of the closed form (dopri5 at 1e-9); on rk4's
    fixed grid, whose solve is smooth in the inputs, it agrees with central differences of that solve; the block
    and ``cde_nets.odeint`` give the same gradient."""
    A, y0, w = _linear_problem()
    times = torch.tensor([0.0, 0.4, 0.7, 1.0], dtype=F64)
    exact = _exact(A, y0, w, times)
    gradient = Interpolating(checkpoints=checkpoints)
    kw: dict = dict(rtol=1e-9, atol=1e-11, method="dopri5")
    got = _odeint_grads(A, y0, w, times, gradient, **kw)
    assert (got - exact).norm() / exact.norm() < 1e-7
    # the block's door: the same gradient, the loss read off Solution.ys
    field, y = Linear(A.clone()), y0.clone().requires_grad_()
    block = ODEBlock(field, T=1.0, gradient=gradient, **kw)
    _loss(block.solve(y, t=times).ys, w).backward()
    assert torch.allclose(torch.cat([field.A.grad.flatten(), y.grad.flatten()]), got, rtol=1e-12, atol=1e-14)
    if checkpoints:  # on rk4's steps both variants read the same interpolant (the test below)
        return
    # central differences of rk4's solve (step 0.05) in A[0, 1] and y0[2, 0]
    kw = dict(method="rk4", options=dict(step_size=0.05))
    got = _odeint_grads(A, y0, w, times, gradient, **kw)
    eps = 1e-4
    for k in (1, 9 + 6):
        fd = []
        for sign in (1, -1):
            Ap, yp = A.clone(), y0.clone()
            (Ap.view(-1) if k < 9 else yp.view(-1))[k % 9 if k < 9 else k - 9] += sign * eps
            with torch.no_grad():
                fd.append(_loss(odeint(Linear(Ap), yp, times, **kw), w))
        assert abs(float(got[k] - (fd[0] - fd[1]) / (2 * eps))) < 1e-6 * float(exact.abs().max())


@pytest.mark.parametrize("method", ["dopri5", "tsit5", "bosh3", "fehlberg2", "dopri8", "rk4", "midpoint"])
def test_plain_and_checkpointed_read_the_same_dense_output(method):
    """With the backward solve on the forward's step grid (rk4), both variants take the same backward steps on
    the same interpolant (with dopri5's adaptive backward solve too): the plain one's caught stages and the
    checkpointed replays' rebuilt ones agree to rounding (every tableau kind: FSAL, own extension, carried
    slope, dense stages, fixed steps)."""
    A, y0, w = _linear_problem()
    times = torch.tensor([0.0, 0.4, 0.7, 1.0], dtype=F64)
    kw: dict = dict(rtol=1e-4, atol=1e-6, method=method)
    if method in ("rk4", "midpoint"):
        kw = dict(method=method, options=dict(step_size=0.05))
    plain = _odeint_grads(A, y0, w, times, Interpolating(method="rk4"), **kw)
    if method == "rk4":  # the block's door catches the stages through its own wrapper's callbacks
        field, y = Linear(A.clone()), y0.clone().requires_grad_()
        block = ODEBlock(field, T=1.0, method="rk4", step_size=0.05, gradient=Interpolating(method="rk4"))
        _loss(block.solve(y, t=times).ys, w).backward()
        assert torch.allclose(torch.cat([field.A.grad.flatten(), y.grad.flatten()]), plain, rtol=1e-12, atol=1e-14)
    for k in (True, 3):
        rebuilt = _odeint_grads(A, y0, w, times, Interpolating(checkpoints=k, method="rk4"), **kw)
        assert torch.allclose(plain, rebuilt, rtol=1e-11, atol=1e-13), (method, k)
    if method == "dopri5":  # and with the adaptive backward solve: the same steps on the same interpolant
        ours = _odeint_grads(A, y0, w, times, Interpolating(), **kw)
        rebuilt = _odeint_grads(A, y0, w, times, Interpolating(checkpoints=True), **kw)
        assert torch.allclose(ours, rebuilt, rtol=1e-11, atol=1e-13)
    exact = _exact(A, y0, w, times)
    assert (plain - exact).norm() / exact.norm() < 1e-3  # the ODE's gradient, to the steps' error (4e-4 at most)


def test_refusals_and_arguments_name_the_fix():
    with pytest.raises(ValueError, match="gradient='interpolating' reads y\\(t\\) off the dense output.*'dopri5'"):
        ODEBlock(Linear(torch.eye(2, dtype=F64)), T=1.0, method="gl4", gradient="interpolating")
    with pytest.raises(ValueError, match="`checkpoints` must be a positive integer"):
        Interpolating(checkpoints=0)
    with pytest.raises(ValueError, match="backward solve runs on the library's explicit Runge-Kutta stepper"):
        Interpolating(method="gl4")
    with pytest.raises(ValueError, match="replays the steps of a real state.*Use Interpolating\\(\\)"):
        y0 = torch.ones(2, dtype=torch.complex128, requires_grad=True)
        odeint(
            lambda t, y: -y, y0, torch.tensor([0.0, 1.0]), gradient=Interpolating(checkpoints=True), adjoint_params=()
        )
    assert as_gradient("interpolating") == Interpolating()
    assert Interpolating(checkpoints=4).describe() == "interpolating (checkpoints every 4)"


def test_memory_kept_is_four_states_a_step_plain_one_checkpointed_one_per_k_with_k():
    """rk4 on ``y' = A y``: the bytes saved for backward grow by the cubic Hermite's 4 coefficients a step (plain),
    by one state a step (``checkpoints=True``), by one state every ``k`` steps (``checkpoints=k``)."""
    from cde_nets.diagnostics import SavedTensorMemory

    A, y0, _ = _linear_problem()
    state = y0.numel() * y0.element_size()
    times = torch.tensor([0.0, 1.0], dtype=F64)

    def saved(gradient, steps: int) -> int:
        field, y = Linear(A.clone()), y0.clone().requires_grad_()
        mem = SavedTensorMemory(exclude=[*field.parameters(), y])
        with mem:
            ys = odeint(field, y, times, method="rk4", options=dict(step_size=1 / steps), gradient=gradient)
        ys[-1].sum().backward()
        return mem.peak_bytes

    for gradient, per_10_steps in (
        (Interpolating(), 40),
        (Interpolating(checkpoints=True), 10),
        (Interpolating(checkpoints=5), 2),
    ):
        assert saved(gradient, 20) - saved(gradient, 10) == per_10_steps * state, gradient


def test_a_piecewise_field_on_a_fixed_grid_converges_under_the_interpolating_adjoint():
    """Cubic friction with 16 parameter pieces on [0, 4], rk4 on the pieces' grid: the field jumps at every step's
    end, and the backward solve must read each step's own piece as the forward did (its stages nudged inside the
    step). Read at the jump it took the next piece: the error against backprop fell only 4x from 16 to 64 steps
    (4.9e-2 to 1.2e-2, first order). Now at least 8x (measured 16x: the Hermite interpolant's end slope, read on
    the jump's far side, still limits it to second order)."""
    from cde_nets.fields import CubicFriction

    def gradient(name: str, steps: int) -> torch.Tensor:
        torch.manual_seed(0)
        f = CubicFriction(4, layers=16, zero_init=False, T=4.0).double()
        with torch.no_grad():
            for p in f.parameters():
                p.mul_(0.3)
        block = ODEBlock(f, method="rk4", step_size=4.0 / steps, gradient=name)
        block(0.5 * torch.randn(32, 4, dtype=torch.float64)).square().sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in block.parameters()])

    def error(steps: int) -> float:
        ref = gradient("backprop", steps)
        return float((gradient("interpolating", steps) - ref).abs().max() / ref.abs().max())

    coarse, fine = error(16), error(64)
    assert coarse < 1e-2 and coarse / fine >= 8


@pytest.mark.parametrize("method", ["dopri5", "bosh3"])
def test_a_block_solving_backwards_in_time_records_the_slopes_its_solve_uses(method):
    # the block hands the engine decreasing times and the replay reverses them (s = -t); its stage recorder heard
    # the counter's F(-s, y) where the solve in s uses -F: each step's dense output ran the wrong way (0.7% off)
    from cde_nets import ODEBlock

    torch.manual_seed(0)

    class Field(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 2), nn.Tanh()).double()

        def forward(self, t, y):
            return self.net(y) + 0.1 * torch.sin(t)

    field, t = Field(), torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    tol = dict(rtol=1e-7, atol=1e-9, method=method)
    grads = []
    for solve in (
        lambda y: ODEBlock(field, T=1.0, gradient="interpolating", **tol).solve(y, t=t).ys,
        lambda y: odeint(field, y, t, gradient="interpolating", **tol),
    ):
        y0 = torch.tensor([1.0, 0.5], dtype=torch.float64, requires_grad=True)
        grads.append(torch.autograd.grad(solve(y0).sum(), y0)[0])
    assert torch.equal(grads[0], grads[1])
