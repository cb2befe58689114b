"""``torch.func``'s reverse- and forward-mode transforms without ``vmap`` (``grad``, ``jacrev``, ``jvp``) through a
solve with every gradient method: each gives torch.autograd's gradient of the same solve with the same method (the
gradient methods' own backward passes, which torch.func takes in their vmap-ready form, on the single solve's
steps); ``jvp`` gives the tangent of the solve itself. What torch.func cannot run is refused by name, and a solve
nothing differentiates runs with any gradient method (float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, vmap
from vmap_cases import close

from cde_nets import odeint
from cde_nets.solvers.gradients import gradient_names

D = torch.float64
T = torch.tensor([0.0, 0.4, 1.0], dtype=D)
TOL = dict(rtol=1e-9, atol=1e-10)
Y0 = torch.tensor([0.3, -0.8], dtype=D)
GRADIENTS = [g for g in gradient_names() if g != "reversible"]  # 'reversible' serves the reversible solvers only


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 2)).double()


@pytest.mark.parametrize("gradient", GRADIENTS)
def test_grad_and_jacrev_give_autograds_gradient_with_each_method(gradient):
    net = _mlp()
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p, y0):
        field = lambda t, y: functional_call(net, p, (y,))  # noqa: E731
        return odeint(field, y0, T, gradient=gradient, adjoint_params=tuple(p.values()), **TOL)[-1].square().sum()

    by_func = grad(loss, argnums=(0, 1))(params, Y0)
    y0 = Y0.clone().requires_grad_(True)
    end = odeint(lambda t, y: net(y), y0, T, gradient=gradient, adjoint_params=tuple(net.parameters()), **TOL)
    by_autograd = torch.autograd.grad(end[-1].square().sum(), (*net.parameters(), y0))
    for g, want in zip(by_func[0].values(), by_autograd[:-1]):  # the same method on the same steps: to rounding
        close(g, want, 1e-12)
    close(by_func[1], by_autograd[-1], 1e-12)
    rel = 1e-7 if gradient in ("adjoint", "interpolating", "gauss") else 1e-12  # continuous: to their tolerance
    jac = jacrev(lambda y: odeint(lambda t, x: net(x), y, T, gradient=gradient, adjoint_params=(), **TOL)[-1])(Y0)
    want = torch.autograd.functional.jacobian(lambda y: odeint(lambda t, x: net(x), y, T, **TOL)[-1], Y0)
    close(jac, want, rel)


def test_jvp_gives_the_tangent_of_the_solve_whatever_the_gradient_method():
    net = _mlp()
    f = lambda t, y: net(y)  # noqa: E731
    direction = torch.tensor([1.0, 0.5], dtype=D)
    _, want = jvp(lambda y: odeint(f, y, T, **TOL)[-1], (Y0,), (direction,))
    for gradient in ("adjoint", "checkpoint"):
        end = lambda y, g=gradient: odeint(f, y, T, gradient=g, adjoint_params=(), **TOL)[-1]  # noqa: E731
        close(jvp(end, (Y0,), (direction,))[1], want, 1e-12)


def test_fixed_step_methods_with_a_backward_pass_of_their_own_are_refused_by_name():
    def loss(y, gradient):
        end = odeint(
            lambda t, x: torch.tanh(x),
            y,
            T,
            method="rk4",
            options=dict(step_size=0.1),
            gradient=gradient,
            adjoint_params=(),
        )
        return end[-1].sum()

    refusal = "gradient='adjoint' with method='rk4' under a torch.func transform.*gradient='backprop'"
    with pytest.raises(ValueError, match=refusal):
        grad(lambda y: loss(y, "adjoint"))(Y0)
    with pytest.raises(ValueError, match=refusal):
        vmap(grad(lambda y: loss(y, "adjoint")))(Y0[None])
    y0 = Y0.clone().requires_grad_(True)
    close(grad(lambda y: loss(y, "backprop"))(Y0), torch.autograd.grad(loss(y0, "backprop"), y0)[0], 1e-14)


def test_a_solve_nothing_differentiates_runs_with_any_gradient_method_under_vmap():
    f = lambda t, x: torch.tanh(x)  # noqa: E731
    Y = torch.stack([Y0, -Y0, 2 * Y0])
    opts = dict(method="rk4", options=dict(step_size=0.1))
    want = torch.stack([odeint(f, y, T, **opts) for y in Y])
    for gradient in ("adjoint", "checkpoint"):
        got = vmap(lambda y, g=gradient: odeint(f, y, T, gradient=g, adjoint_params=(), **opts))(Y)
        assert torch.equal(got, want)


def test_a_blocks_default_under_torch_func_is_backprop_even_on_a_large_state():
    from cde_nets import ODEBlock

    class Tanh(nn.Module):
        def forward(self, t, y):
            return torch.tanh(y)

    block = ODEBlock(Tanh(), T=1.0, method="rk4", step_size=1 / 40).double()
    y0 = torch.zeros(65536, dtype=D)  # 512 KiB x 4 stages x 40 steps: past backprop's graph budget
    assert block.gradient_for(y0).name == "checkpoint"  # outside torch.func: the replay, for its memory
    chosen = []
    grad(lambda y: chosen.append(block.gradient_for(y).name) or y.sum())(y0)
    assert chosen == ["backprop"]  # under it: the replay's rk4 backward pass has no torch.func form


def test_a_first_large_solve_under_torch_func_probes_its_summation_order_on_plain_tensors():
    from cde_nets.solvers.steppers.rk_stages import sum_order

    y0 = torch.linspace(-1.0, 1.0, 8192, dtype=D)  # a state this large sums its stages in a probed order
    sum_order.cache_clear()  # the probe runs at the first such solve: here under grad

    def end(y):
        return odeint(lambda t, x: torch.tanh(x), y, T[:2], **TOL)[-1].sum()

    got = grad(end)(y0)
    y = y0.clone().requires_grad_(True)
    assert torch.equal(got, torch.autograd.grad(end(y), y)[0])


def test_second_derivatives_through_a_backward_pass_torch_func_cannot_differentiate_are_refused():
    from torch.func import hessian

    def total(gradient):
        f = lambda t, x: torch.tanh(x[[1, 0]]) * x  # noqa: E731
        return lambda y: odeint(f, y, T, gradient=gradient, adjoint_params=(), rtol=1e-8, atol=1e-9)[-1].sum()

    want = torch.autograd.functional.hessian(total("backprop"), Y0)
    close(jacrev(jacrev(total("adjoint")))(Y0), want, 1e-5)  # differentiable: to the solves' tolerance
    for gradient in ("checkpoint", "forward", "gauss"):  # a silent 1e-3 of the Hessian, zeros, zeros before
        with pytest.raises(ValueError, match=f"gradient='{gradient}' under nested torch.func transforms"):
            jacrev(jacrev(total(gradient)))(Y0)
    with pytest.raises(ValueError, match="gradient='adjoint' under nested torch.func transforms.*backprop"):
        hessian(total("adjoint"))(Y0)  # forward over reverse: the Function has no jvp


@pytest.mark.parametrize("gradient", ["checkpoint", "forward", "gauss"])
def test_the_block_door_serves_and_refuses_as_odeint_does(gradient):
    from cde_nets import ODEBlock

    torch.manual_seed(0)
    field = nn.Sequential(nn.Linear(2, 2), nn.Tanh()).double()
    block = ODEBlock(_as_field(field), T=1.0, gradient=gradient, **TOL)
    params = {k: v.detach() for k, v in block.named_parameters()}
    got = grad(lambda p, y: functional_call(block, p, (y,)).square().sum(), argnums=(0, 1))(params, Y0)
    y0 = Y0.clone().requires_grad_(True)
    want = torch.autograd.grad(block(y0).square().sum(), (*block.parameters(), y0))
    for g, w in zip([*got[0].values(), got[1]], want):  # the same method on the same steps: to rounding
        close(g, w, 1e-12)
    fixed = ODEBlock(_as_field(field), T=1.0, method="rk4", step_size=0.1, gradient=gradient)
    with pytest.raises(ValueError, match=f"gradient='{gradient}' with method='rk4' under a torch.func transform"):
        grad(lambda p: functional_call(fixed, p, (Y0,)).sum())(params)


def _as_field(net: nn.Module) -> nn.Module:
    class Field(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, t, y):
            return self.net(y)

    return Field()
