"""The symplectic adjoint and forward sensitivities under ``torch.vmap`` (solvers.gradients.vmap_symplectic,
solvers.gradients.vmap_forward): each vmapped instance is solved and differentiated on its own steps, so the
vmapped gradient equals the loop of single solves with the same gradient method (float64, to 1e-7 relative; in
fact to rounding), over ``y0``, over a stacked-parameter ensemble of a small MLP field, with ``jacrev`` inside
``vmap``, in both doors. The step sizes are treated as outside ``vmap``: differentiated by default, held fixed
with ``steps="fixed"`` (whose gradient differs from the default's by ~1e-6 here, so each is pinned)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, jacrev, stack_module_state, vmap
from vmap_cases import MLP, close

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.gradients import Forward, Symplectic

D = torch.float64
TOL = dict(rtol=1e-5, atol=1e-7)
T = torch.tensor([0.0, 0.3, 0.7], dtype=D)
A = torch.randn(2, 2, dtype=D, generator=torch.Generator().manual_seed(1))
Y = torch.randn(2, 2, dtype=D, generator=torch.Generator().manual_seed(2))
GRADIENTS = ["symplectic", "forward"]


def field(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.tanh(y @ A.T) + 0.1 * torch.sin(t)


def members(n: int = 2) -> list[MLP]:
    torch.manual_seed(0)
    return [MLP(h=4).double() for _ in range(n)]


def single_grad(func, y0, gradient, method, wrt):
    """The loop's reference: one solve outside vmap, differentiated by autograd through `gradient`'s backward."""
    params = tuple(p for p in wrt if p is not y0)
    out = odeint(func, y0, T, gradient=gradient, adjoint_params=params, method=method, **TOL)
    return torch.autograd.grad((out[1:] ** 2).sum(), wrt)


# dopri5 and one more tableau each: tsit5 (its own continuous extension) for symplectic; bosh3 for forward, whose
# single solve outside vmap takes one tangent solve per direction on tsit5 (too slow for this file)
CASES = [("symplectic", "dopri5"), ("symplectic", "tsit5"), ("forward", "dopri5"), ("forward", "bosh3")]


@pytest.mark.parametrize(
    ("gradient", "method"), [*CASES, (Symplectic(steps="fixed"), "dopri5"), (Forward(steps="fixed"), "dopri5")]
)
def test_vmap_over_y0_equals_the_loop_of_single_solves(gradient, method):
    def loss(y):
        return (odeint(field, y, T, gradient=gradient, adjoint_params=(), method=method, **TOL)[1:] ** 2).sum()

    want = torch.stack([single_grad(field, y := x.clone().requires_grad_(), gradient, method, (y,))[0] for x in Y])
    close(vmap(grad(loss))(Y), want)


@pytest.mark.parametrize(("gradient", "method"), CASES)
def test_a_stacked_parameter_ensemble_equals_the_loop_of_single_solves(gradient, method):
    nets = members()
    params, _ = stack_module_state(nets)
    base = MLP(h=4).double().to("meta")
    y0 = Y[0]

    def loss(p):
        func = lambda t, x: functional_call(base, p, (t, x))  # noqa: E731
        # closed over, not named: tracked by vmap and grad, so the field's tensors are found and taken as inputs
        return (odeint(func, y0, T, gradient=gradient, adjoint_params=(), method=method, **TOL)[1:] ** 2).sum()

    got = vmap(grad(loss))(params)
    for k, net in enumerate(nets):
        names = [name for name, _ in net.named_parameters()]
        want = single_grad(net, y0, gradient, method, tuple(net.parameters()))
        for name, w in zip(names, want):
            close(got[name][k], w)


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_jacrev_inside_vmap_equals_the_loop_of_jacobians(gradient):
    def ends(y):
        return odeint(field, y, T, gradient=gradient, adjoint_params=(), **TOL)[-1]

    got = vmap(jacrev(ends))(Y)
    close(got, torch.stack([torch.autograd.functional.jacobian(ends, y) for y in Y]))


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_odeblock_over_stacked_parameters_equals_the_loop_of_blocks(gradient):
    blocks = [ODEBlock(net, T=1.0, gradient=gradient, **TOL) for net in members()]
    stacked, _ = stack_module_state(blocks)
    X = Y[:2]

    def loss(p):
        return functional_call(blocks[0], p, (X,)).pow(2).sum()

    got = vmap(grad(loss))(stacked)
    for k, block in enumerate(blocks):
        names = [name for name, _ in block.named_parameters()]
        want = torch.autograd.grad(block(X).pow(2).sum(), tuple(block.parameters()))
        for name, w in zip(names, want):
            close(got[name][k], w)


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_a_tensor_held_where_it_cannot_be_swapped_is_refused_by_name(gradient):
    W = torch.randn(2, 2, 2, dtype=D, generator=torch.Generator().manual_seed(3))

    def hidden(w, y):  # a tuple's entry cannot be swapped for an input
        held = (w,)
        return odeint(lambda t, x: torch.tanh(held[0] @ x), y, T, gradient=gradient, adjoint_params=(), **TOL)

    with pytest.raises(ValueError, match=f"gradient='{gradient}' under torch.func: the field reaches a tensor"):
        vmap(grad(lambda w, y: hidden(w, y)[-1].sum(), argnums=(0, 1)))(W, Y)
    with pytest.raises(ValueError, match="Symplectic\\(budget=2.*under torch.func.*drop `budget`"):
        vmap(grad(lambda y: odeint(field, y, T, gradient=Symplectic(budget=2), adjoint_params=(), **TOL)[-1].sum()))(Y)
