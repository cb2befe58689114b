"""Second derivatives under torch.autograd (``create_graph=True``, ``torch.autograd.functional.hessian``, a grad of
a grad) through every gradient method: the right number, or a ``ValueError`` naming ``gradient=`` and the fix.

The reference is backpropagation through the solver's steps, which autograd differentiates to any order. Forward
sensitivities take the same steps, so their Hessian is backprop's to rounding; the continuous adjoint's is the
derivative of its backward solve (Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5), right to
the solves' tolerance. Passing ``create_graph=True`` without differentiating the gradient changes nothing."""

from __future__ import annotations

from functools import cache

import pytest
import torch
from torch import nn
from torch.autograd.functional import hessian

from cde_nets import odeint
from cde_nets.fields import Hamiltonian

F64 = torch.float64
Y0 = torch.tensor([0.3, -0.2], dtype=F64)
T = torch.tensor([0.0, 0.5, 1.0], dtype=F64)
W = torch.tensor([[0.8, -0.6], [0.4, 0.5]], dtype=F64)
TOL = dict(rtol=1e-6, atol=1e-8)


def field(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(y @ W.T)


LOSSES = {
    "square": lambda ys: ys.pow(2).sum(),  # its cotangent depends on the states
    "linear": lambda ys: ys.sum(),  # its cotangent is a constant: only the backward pass's own dependence remains
    "last": lambda ys: ys[-1].pow(2).sum(),
}


def solve(y0: torch.Tensor, gradient: str, **kw) -> torch.Tensor:
    return odeint(field, y0, T, gradient=gradient, adjoint_params=(), **{**TOL, **kw})


@cache
def backprops(loss: str) -> torch.Tensor:
    return hessian(lambda y: LOSSES[loss](solve(y, "backprop")), Y0)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float) -> None:
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= rtol, f"relative error {err:.3g} above {rtol:.0e}"


# forward sensitivities take backprop's steps: to rounding; the adjoint's backward solve: to the tolerance (measured
# 6e-6 at rtol 1e-6, 2e-7 at 1e-8)
SERVED = [("forward", 1e-12), ("adjoint", 1e-4)]


@pytest.mark.parametrize(
    ("gradient", "rtol", "loss"), [(*SERVED[0], "square"), (*SERVED[1], "square"), (*SERVED[1], "linear")]
)
def test_served_hessians_in_y0_are_backprops(gradient: str, rtol: float, loss: str) -> None:
    close(hessian(lambda y: LOSSES[loss](solve(y, gradient)), Y0), backprops(loss), rtol)
    # create_graph=True alone leaves the first derivative bit for bit
    y = Y0.clone().requires_grad_()
    (plain,) = torch.autograd.grad(LOSSES[loss](solve(y, gradient)), y)
    (graphed,) = torch.autograd.grad(LOSSES[loss](solve(y, gradient)), y, create_graph=True)
    assert torch.equal(plain, graphed) and graphed.requires_grad


class Tanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2).double()
        with torch.no_grad():
            self.lin.weight.copy_(W)
            self.lin.bias.copy_(torch.tensor([0.1, -0.3]))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(y))


def _mixed(gradient: str) -> torch.Tensor:
    """The derivative in the weight and y0 of a gradient penalty on the weight's gradient."""
    f = Tanh()
    y = Y0.clone().requires_grad_()
    ys = odeint(f, y, T, gradient=gradient, adjoint_params=tuple(f.parameters()), **TOL)
    (g_w,) = torch.autograd.grad(ys[-1].pow(2).sum(), f.lin.weight, create_graph=True)
    return torch.cat([x.reshape(-1) for x in torch.autograd.grad(g_w.pow(2).sum(), (f.lin.weight, y))])


@cache
def _backprops_mixed() -> torch.Tensor:
    return _mixed("backprop")


@pytest.mark.parametrize(("gradient", "rtol"), SERVED)
def test_served_second_derivatives_in_the_parameters_are_backprops(gradient: str, rtol: float) -> None:
    close(_mixed(gradient), _backprops_mixed(), rtol)


def test_a_third_derivative_through_a_served_second_is_refused() -> None:
    H = hessian(lambda y: solve(y, "forward").pow(2).sum(), Y0.clone().requires_grad_(), create_graph=True)
    with pytest.raises(ValueError, match=r"gradient='forward' serves first and second .* Use gradient='backprop'"):
        H.sum().backward()


SEPARABLE = dict(options={"step_size": 0.25})
REFUSED = [
    ("dopri5", "checkpoint", {}),
    ("dopri5", "symplectic", {}),
    ("dopri5", "interpolating", {}),
    ("dopri5", "gauss", {}),
    ("reversible_rk4", "reversible", SEPARABLE),
    ("dopri5", "checkpoint", dict(controller="per_sample")),
    ("gl4", "backprop", SEPARABLE),
    ("gl4", "checkpoint", SEPARABLE),
    ("yoshida4", "checkpoint", SEPARABLE),
]


@pytest.mark.parametrize(("method", "gradient", "kw"), REFUSED)
def test_unserved_second_derivatives_are_refused_by_name(method: str, gradient: str, kw: dict) -> None:
    torch.manual_seed(0)
    f = Hamiltonian(2, K="blockdiag").double()  # separable: the compositions take it too
    y0 = Y0.reshape(1, 2)

    def total(y: torch.Tensor) -> torch.Tensor:
        return odeint(f, y, T, method=method, gradient=gradient, rtol=1e-4, atol=1e-6, **kw).sum()  # constant cotangent

    y = y0.clone().requires_grad_()
    (plain,) = torch.autograd.grad(total(y), y)
    (graphed,) = torch.autograd.grad(total(y), y, create_graph=True)  # a first derivative only: served
    assert torch.equal(plain, graphed)
    with pytest.raises(ValueError, match=rf"gradient='{gradient}' gives first derivatives only .* [Uu]se "):
        torch.autograd.grad(graphed.sum(), y)
    with pytest.raises(ValueError, match=rf"gradient='{gradient}' gives first derivatives only"):
        hessian(total, y0)


def test_the_states_gradient_through_differentiated_times_keeps_its_graph() -> None:
    t = T.clone().requires_grad_()
    got = hessian(lambda y: odeint(field, y, t, gradient="backprop", **TOL)[-1].pow(2).sum(), Y0)
    close(got, backprops("last"), 1e-13)
    (g_t,) = torch.autograd.grad(odeint(field, Y0, t, **TOL)[-1].pow(2).sum(), t, create_graph=True)
    with pytest.raises(ValueError, match=r"second derivative with respect to the output times `t` is not served"):
        torch.autograd.grad(g_t[-1], t)
