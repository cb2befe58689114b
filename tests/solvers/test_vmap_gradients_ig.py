"""The interpolating and Gauss adjoints under ``torch.vmap`` (solvers.gradients.vmap_interpolating, vmap_gauss):
each instance's forward and backward solves on its own steps, as its single solve takes them, so the vmapped
gradient equals the loop of single solves with the same gradient method (float64, rtol 1e-9, to 1e-7 relative)
over ``y0``, over a stacked-parameter ensemble of a small MLP (named parameters or a closure over them), in both
doors, and under ``vmap(jacrev)``. What they cannot serve there is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from vmap_cases import MLP, close

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.gradients import Interpolating

D = torch.float64
TOL = dict(rtol=1e-6, atol=1e-8)
T3 = torch.tensor([0.0, 0.3, 1.0], dtype=D)
A = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(1))
Y = torch.randn(3, 3, dtype=D, generator=torch.Generator().manual_seed(2))
CELLS = [(g, m) for g in ("interpolating", "gauss") for m in ("dopri5", "tsit5")]


def field(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(y @ A.T) + 0.1 * torch.sin(t)


def check_members(got: dict, members: list[nn.Module], loss) -> None:
    """Each member's slice of the stacked gradient ``got`` against autograd through its own single solve."""
    for i, member in enumerate(members):
        wants = torch.autograd.grad(loss(member), list(member.parameters()))
        for (k, _), want in zip(member.named_parameters(), wants):
            close(got[k][i], want)


def single_grad(y: torch.Tensor, gradient: str, method: str) -> torch.Tensor:
    y = y.clone().requires_grad_()
    out = odeint(field, y, T3, method=method, gradient=gradient, adjoint_params=(), **TOL)
    return torch.autograd.grad(out[-1].sum(), y)[0]


@pytest.mark.parametrize("gradient,method", CELLS)
def test_vmap_over_y0_equals_the_loop_of_single_solves(gradient, method):
    def loss(y):
        return odeint(field, y, T3, method=method, gradient=gradient, adjoint_params=(), **TOL)[-1].sum()

    close(vmap(grad(loss))(Y), torch.stack([single_grad(y, gradient, method) for y in Y]))


@pytest.mark.parametrize("gradient,method", CELLS)
def test_a_stacked_parameter_ensemble_equals_the_loop_of_single_solves(gradient, method):
    """The ensemble's parameters named in ``adjoint_params`` (dopri5) or only closed over (tsit5: tracked, so
    taken as inputs): each member's gradient is that of its own single solve."""
    torch.manual_seed(0)
    members = [MLP(h=6).double() for _ in range(2)]
    params, _ = stack_module_state(members)
    base = MLP(h=6).double().to("meta")
    y0 = torch.tensor([0.5, -1.0], dtype=D)

    def loss(p, named):
        func = lambda t, x: functional_call(base, p, (t, x))  # noqa: E731
        given = tuple(p.values()) if named else ()
        return odeint(func, y0, T3, method=method, gradient=gradient, adjoint_params=given, **TOL)[-1].sum()

    got = vmap(grad(loss), in_dims=(0, None))(params, method == "dopri5")
    check_members(got, members, lambda m: odeint(m, y0, T3, method=method, gradient=gradient, **TOL)[-1].sum())


@pytest.mark.parametrize("gradient", ["interpolating", "gauss"])
def test_the_block_door_and_jacrev_inside_vmap(gradient):
    """ODEBlock's parameters stacked under functional_call, and vmap(jacrev) (the backward pass itself vmapped
    over the Jacobian's rows), each equal to the loop of single solves."""
    torch.manual_seed(1)
    blocks = [ODEBlock(MLP(h=6).double(), T=1.0, gradient=gradient, **TOL) for _ in range(2)]
    stacked, _ = stack_module_state(blocks)
    X = torch.randn(2, 2, dtype=D, generator=torch.Generator().manual_seed(7))
    got = vmap(grad(lambda p: functional_call(blocks[0], p, (X,)).sum()))(stacked)
    check_members(got, blocks, lambda b: b(X).sum())

    def end(y):
        return odeint(field, y, T3, gradient=gradient, adjoint_params=(), **TOL)[-1]

    jac = vmap(jacrev(end))(Y[:2])
    for y, J in zip(Y[:2], jac):
        y = y.clone().requires_grad_()
        out = odeint(field, y, T3, gradient=gradient, adjoint_params=(), **TOL)[-1]
        close(J, torch.stack([torch.autograd.grad(out[r], y, retain_graph=True)[0] for r in range(3)]))


def test_what_the_vmapped_adjoints_cannot_serve_is_refused_by_name():
    def back(y):
        return odeint(field, y, T3, gradient=Interpolating(method="rk4"), adjoint_params=(), **TOL)[-1].sum()

    with pytest.raises(ValueError, match="Interpolating\\(method='rk4'\\) under torch.func.*adaptive loop"):
        vmap(grad(back))(Y)
