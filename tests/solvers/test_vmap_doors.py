"""The doors' times, tolerances and messages under ``torch.func``: gradients with respect to the output times,
per-instance tolerances and times, and the refusals that name the fix (float64 throughout)."""

import pytest
import torch
from torch import nn
from torch.func import grad, jvp, vmap

from cde_nets import ODEBlock, odeint
from cde_nets.solvers.errors import SolverError

D = torch.float64
A = torch.tensor([[0.0, 1.0], [-1.0, -0.1]], dtype=D)
Y = torch.tensor([[1.0, 0.5], [0.2, -0.3]], dtype=D)
TOL = dict(rtol=1e-6, atol=1e-8)


def linear(t, y):
    return y @ A.T


def nonlinear(t, y):
    return torch.tanh(y @ A.T) + 0.1 * torch.sin(t)


def test_time_gradients_under_func_are_the_field():
    """∂y(t_i)/∂t_i = F(t_i, y(t_i)), ∂y(t_i)/∂t_0 = −Φ_y F(t_0, y_0): under grad(vmap), vmap(grad), a shared ``t``
    differentiated by torch.autograd through vmap, and jvp, as torch.autograd gives them on the loop of single
    solves (they were silently zero, or torch's setup_context error)."""
    TT = torch.tensor([[0.0, 0.5, 1.0], [0.3, 0.6, 2.0]], dtype=D)

    def loss(t, y):
        return odeint(nonlinear, y, t, **TOL)[-2:].sum()

    ref = []
    for t, y in zip(TT, Y):
        t = t.clone().requires_grad_()
        ref.append(torch.autograd.grad(loss(t, y), t)[0])
    ref = torch.stack(ref)
    assert ref[:, 0].abs().min() > 0.01 and ref[:, 2].abs().min() > 0.01
    torch.testing.assert_close(grad(lambda T: vmap(loss)(T, Y).sum())(TT), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(vmap(grad(loss))(TT, Y), ref, rtol=1e-10, atol=1e-12)
    shared = TT[0].clone().requires_grad_()
    vmap(lambda y: loss(shared, y))(Y).sum().backward()
    expect = torch.autograd.grad(sum(loss(shared, y) for y in Y), shared)[0]
    torch.testing.assert_close(shared.grad, expect, rtol=1e-10, atol=1e-12)


def test_time_derivatives_of_a_linear_flow():
    """y(T) = e^{AT} y_0: d/dT Σ y(T) = Σ A y(T) (jvp), d²/dT² Σ y(T) = Σ A² y(T) (grad of grad)."""
    y0 = Y[0]

    def end(T):
        return odeint(linear, y0, torch.stack([torch.zeros((), dtype=D), T]), rtol=1e-9, atol=1e-11)[-1]

    T = torch.tensor(0.3, dtype=D)
    yT = torch.linalg.matrix_exp(A * 0.3) @ y0
    _, tangent = jvp(end, (T,), (torch.ones((), dtype=D),))
    torch.testing.assert_close(tangent, A @ yT, rtol=1e-8, atol=1e-10)
    second = grad(grad(lambda T: end(T).sum()))(T)
    torch.testing.assert_close(second, (A @ A @ yT).sum(), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["rtol", "atol"])
def test_per_instance_tolerances_under_vmap(name):
    """Each instance at its own tolerance: the loop of single solves with ``float(r)`` (was torch's data pointer
    error from the tolerance check)."""
    R = torch.tensor([1e-3, 1e-9], dtype=D)
    other = {"atol": 1e-10} if name == "rtol" else {"rtol": 1e-6}
    loop = torch.stack([odeint(nonlinear, y, TT0, **{name: float(r)}, **other) for y, r in zip(Y, R)])
    got = vmap(lambda y, r: odeint(nonlinear, y, TT0, **{name: r}, **other))(Y, R)
    torch.testing.assert_close(got, loop, rtol=1e-13, atol=1e-14)
    coarse = odeint(nonlinear, Y[0], TT0, **{name: 1e-9}, **other)
    assert (got[0] - coarse).abs().max() > 1e-8  # the first instance did run at its own, looser tolerance


TT0 = torch.tensor([0.0, 0.5, 2.0], dtype=D)
PER_INSTANCE = torch.tensor([[0.0, 0.5, 1.0], [0.0, 0.2, 2.0]], dtype=D)


def test_fixed_step_method_with_per_instance_times_refused():
    with pytest.raises(ValueError, match=r"fixed-step method='rk4'.*adaptive method.*loop"):
        vmap(lambda y, t: odeint(linear, y, t, method="rk4", options={"step_size": 0.1}))(Y, PER_INSTANCE)


def test_times_in_opposite_directions_refused_naming_vmap():
    TT = torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.5, 0.0]], dtype=D)
    with pytest.raises(ValueError, match=r"torch\.vmap.*some increase and some decrease.*split the batch"):
        vmap(lambda y, t: odeint(linear, y, t))(Y, TT)
    block = ODEBlock(_Field(), T=1.0)
    with pytest.raises(ValueError, match=r"torch\.vmap.*some increase and some decrease.*split the batch"):
        vmap(lambda y, t: block.solve(y, t=t).ys)(Y, TT)


class _Field(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(2, 2).double()
        with torch.no_grad():
            self.net.weight.copy_(A)
            self.net.bias.fill_(0.1)

    def forward(self, t, y):
        return torch.tanh(self.net(y)) + 0.1 * torch.sin(t)


@pytest.mark.parametrize(
    "times",
    [[[0.0, 0.5, 1.0], [0.0, 0.2, 0.9]], [[0.3, 0.5, 1.0], [0.1, 0.2, 0.9]], [[1.0, 0.5, 0.0], [1.0, 0.2, 0.1]]],
    ids=["from-0", "later", "backwards"],
)
def test_block_solve_with_per_instance_times(times):
    """ODEBlock.solve(y0, t=t) under vmap over per-instance times, forwards or backwards: the loop of block
    solves, also the times' gradients (was torch's data-dependent control-flow error)."""
    TT = torch.tensor(times, dtype=D)
    block = ODEBlock(_Field(), T=1.0, **TOL)
    loop = torch.stack([block.solve(y, t=t).ys for y, t in zip(Y, TT)])
    torch.testing.assert_close(vmap(lambda y, t: block.solve(y, t=t).ys)(Y, TT), loop, rtol=1e-12, atol=1e-13)

    def loss(t, y):
        return block.solve(y, t=t).ys.sum()

    ref = []
    for t, y in zip(TT, Y):
        t = t.clone().requires_grad_()
        ref.append(torch.autograd.grad(loss(t, y), t)[0])
    ref = torch.stack(ref)
    torch.testing.assert_close(vmap(grad(loss))(TT, Y), ref, rtol=1e-10, atol=1e-12)


def test_block_per_instance_times_starting_apart_refused():
    TT = torch.tensor([[0.0, 0.5, 1.0], [0.1, 0.2, 0.9]], dtype=D)
    block = ODEBlock(_Field(), T=1.0)
    with pytest.raises(ValueError, match=r"torch\.vmap: some instances' times start at 0.*start every instance"):
        vmap(lambda y, t: block.solve(y, t=t).ys)(Y, TT)


def test_max_steps_message_names_the_option_and_the_transform():
    t = torch.tensor([0.0, 5.0], dtype=D)
    options = {"max_num_steps": 4}

    def loss(y):
        return odeint(nonlinear, y, t, **TOL, options=options, gradient="adjoint", adjoint_params=())[-1].sum()

    option = r"raise `options\['max_num_steps'\]`"
    with pytest.raises(SolverError, match=r"max_num_steps=4 reached in a solve under torch\.func; " + option):
        grad(loss)(Y[0])
    with pytest.raises(SolverError, match=r"max_num_steps=4 reached by an instance under torch\.vmap; " + option):
        vmap(grad(loss))(Y)
