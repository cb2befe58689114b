"""The generic continuous adjoint (solvers/gradients/rk_adjoint.py: a backward norm over every part, a norm of the
user's, times that require grad) runs both solves on the library's stepper and takes torchdiffeq's ``odeint_adjoint``'s
steps: its backward state ``(τ, y, a, g)`` and norms are torchdiffeq's, ``τ`` integrating ``−aᵀ∂F/∂t`` even when
``t`` needs no gradient (the norm measures it). For ``dopri5`` the gradients are then torchdiffeq's bits."""

import pytest
import torch
from torch import nn

import cde_nets
from cde_nets.solvers.gradients.rk_adjoint import odeint_adjoint_rk

torchdiffeq = pytest.importorskip("torchdiffeq")


def _generic(f, y0, t, *, adjoint_options, adjoint_params, rtol, atol):
    """The generic adjoint itself (``cde_nets.odeint_adjoint`` differentiates the times on its own)."""
    kw = dict(method="dopri5", options=None, adjoint_method="dopri5", adjoint_rtol=rtol, adjoint_atol=atol)
    return odeint_adjoint_rk(
        f, y0, t, rtol=rtol, atol=atol, adjoint_options=adjoint_options, adjoint_params=adjoint_params, **kw
    )


class Field(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.W1 = nn.Parameter(torch.randn(3, 8, generator=g, dtype=dtype) * 0.5)
        self.W2 = nn.Parameter(torch.randn(8, 3, generator=g, dtype=dtype) * 0.5)
        self.nfe = 0

    def forward(self, t, y):
        self.nfe += 1
        return torch.tanh((y + torch.sin(t)) @ self.W1) @ self.W2


def _largest_rms(state):
    return max(x.abs().pow(2).mean().sqrt() for x in state)


def _gradients(lib, dtype, t_grad: bool):
    f = Field(dtype)
    y0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=dtype).requires_grad_()
    t = torch.tensor([0.0, 0.7, 1.5], dtype=dtype, requires_grad=t_grad)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-7, atol=1e-9)
    solve = lib.odeint_adjoint if lib is not None else _generic
    ys = solve(f, y0, t, adjoint_options={"norm": _largest_rms}, adjoint_params=tuple(f.parameters()), **tol)
    forward = f.nfe
    wrt = (y0, f.W1, f.W2, t) if t_grad else (y0, f.W1, f.W2)
    grads = torch.autograd.grad((ys**2).sum(), wrt)
    return ys.detach(), grads, f.nfe - forward


@pytest.mark.parametrize("dtype, t_grad", [(torch.float32, False), (torch.float64, True)])
def test_generic_adjoint_is_torchdiffeqs_bit_for_bit(dtype, t_grad):
    ys, grads, backward = _gradients(None if t_grad else cde_nets, dtype, t_grad)
    ref_ys, ref_grads, ref_backward = _gradients(torchdiffeq, dtype, t_grad)
    assert backward == ref_backward
    assert torch.equal(ys, ref_ys)
    for g, ref in zip(grads, ref_grads):
        assert torch.equal(g, ref)


def test_fixed_step_adjoint_lays_its_grid_out_in_the_backward_solve_time():
    """``step_size`` of a fixed-step adjoint: the backward solve (over decreasing times) builds its grid after the
    negation of time, as torchdiffeq does; the gradients agree with torchdiffeq's to rounding (``rk4`` is written
    as a tableau here, as formulas there), the evaluations are the same."""
    runs = []
    for lib in (cde_nets, torchdiffeq):
        f = Field(torch.float64)
        y0 = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64).requires_grad_()
        t = torch.tensor([0.0, 0.7, 1.5], dtype=torch.float64)
        opts = {"step_size": 0.1}
        ys = lib.odeint_adjoint(f, y0, t, method="rk4", options=opts, adjoint_params=tuple(f.parameters()))
        grads = torch.autograd.grad((ys**2).sum(), (y0, f.W1, f.W2))
        runs.append((grads, f.nfe))
    (grads, nfe), (ref_grads, ref_nfe) = runs
    assert nfe == ref_nfe
    for g, ref in zip(grads, ref_grads):
        assert float((g - ref).abs().max()) <= 1e-13 * float(ref.abs().max())
