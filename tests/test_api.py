"""One API for continuous and stochastic blocks: a tensor from every call, a Solution from ``solve``, the block
input passed per call (gradients reach it in every mode), settings a method would ignore refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cde_nets import ODEBlock, SDEBlock, Solution, SolverOptions, Stop
from cde_nets.blocks.models import Classifier
from cde_nets.fields import NAIS, Hamiltonian


def central_difference(f, x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    g = torch.zeros_like(x)
    flat = x.detach().reshape(-1)
    for i in range(flat.numel()):
        up, down = flat.clone(), flat.clone()
        up[i] += eps
        down[i] -= eps
        g.view(-1)[i] = (f(up.view_as(x)) - f(down.view_as(x))) / (2 * eps)
    return g


def nais(seed: int = 0) -> NAIS:
    return NAIS(3, 2, layers=2, T=1.0, generator=torch.Generator().manual_seed(seed)).double()


CONTINUOUS = {
    "adjoint": dict(gradient="adjoint", rtol=1e-10, atol=1e-12),
    "backprop": dict(gradient="backprop", rtol=1e-10, atol=1e-12),
    "fixed": dict(gradient="backprop", method="rk4", step_size=0.05),
    "stopping-adjoint": dict(gradient="adjoint", rtol=1e-10, atol=1e-12, stop=Stop(eps=0.3)),
    "stopping-backprop": dict(gradient="backprop", rtol=1e-10, atol=1e-12, stop=Stop(eps=0.3)),
}


@pytest.mark.parametrize("mode", list(CONTINUOUS))
def test_gradient_reaches_the_block_input_in_every_continuous_mode(mode):
    """The NAIS input ``u`` is a tensor of the call: d loss / d u equals central differences (float64)."""
    block = ODEBlock(nais(), **CONTINUOUS[mode])
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    u = torch.randn(4, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, generator=gen, dtype=torch.float64)

    def loss(v):
        return (block(x0, u=v) * w).sum()

    (grad,) = torch.autograd.grad(loss(u), u)
    with torch.no_grad():
        fd = central_difference(lambda v: loss(v).item(), u)
    assert torch.allclose(grad, fd, rtol=1e-5, atol=1e-7), (grad - fd).abs().max()


def test_embedding_in_front_of_a_nais_block_trains_with_the_default_adjoint():
    torch.manual_seed(0)
    model = Classifier(ODEBlock(NAIS(3, 3)), 2, 3, 2, input_as_u=True, embed=nn.Linear(2, 3))
    model(torch.randn(8, 2)).square().sum().backward()
    assert model.embed.weight.grad is not None and float(model.embed.weight.grad.abs().sum()) > 0


def test_the_input_is_never_stored():
    block = ODEBlock(nais(), method="rk4", gradient="backprop")
    x0 = torch.zeros(2, 3, dtype=torch.float64)
    u = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    block(x0, u=u)
    clone = copy.deepcopy(block)  # raised when a live graph was held on the field
    assert torch.equal(clone(x0, u=u), block(x0, u=u))
    with pytest.raises(ValueError, match="needs its block input: pass `u=`"):
        block(x0)
    assert not any(isinstance(v, torch.Tensor) for v in vars(block.field).values())


def test_calling_returns_a_tensor_and_solve_a_solution():
    f = Hamiltonian(4, layers=2).double()
    y0 = torch.randn(5, 4, dtype=torch.float64)
    stopping = ODEBlock(f, rtol=1e-8, atol=1e-9, stop=Stop(eps=10.0))
    assert isinstance(stopping(y0), torch.Tensor) and stopping(y0).shape == (5, 4)
    sol = stopping.solve(y0)
    assert isinstance(sol, Solution) and sol.stop_times.shape == (5,)
    assert sol.stop_times.dtype == torch.float64 and float(sol.stop_times.max()) <= 1.0
    plain = ODEBlock(f, rtol=1e-8, atol=1e-9)
    sol = plain.solve(y0, t=[0.25, 0.5, 1.0])  # need not start at 0
    assert sol.ys.shape == (3, 5, 4) and torch.equal(sol.ys[-1], sol.y)
    assert torch.allclose(sol.y, plain(y0), atol=1e-7)
    assert sol.stats["nfe_forward"] > 0


def test_a_stopping_block_works_inside_sequential_and_a_classifier():
    torch.manual_seed(0)
    block = ODEBlock(Hamiltonian(4, layers=2), rtol=1e-4, atol=1e-5, stop=Stop(eps=0.5))
    model = Classifier(nn.Sequential(block, nn.Tanh()), 2, 4, 3)
    out = model(torch.randn(6, 2))
    assert out.shape == (6, 3)
    out.sum().backward()


def test_a_plain_module_field_in_continuous_mode():
    class Decay(nn.Module):
        def forward(self, t, y):
            return -y

    y0 = torch.ones(2, 3, dtype=torch.float64)
    assert torch.allclose(ODEBlock(Decay(), T=2.0, rtol=1e-10, atol=1e-12)(y0), y0 * torch.exp(torch.tensor(-2.0)))
    with pytest.raises(ValueError, match="no time grid: pass `T=`"):
        ODEBlock(Decay())
    with pytest.raises(TypeError, match="plain module called as F\\(t, y\\); drop `u`"):
        ODEBlock(Decay(), T=1.0)(y0, u=y0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(method="rk4", rtol=1e-10), "`rtol`/`atol` control adaptive methods; the fixed-step 'rk4'"),
        (dict(gradient="sideways"), "`gradient` must be one of \\('adjoint', 'backprop'"),
        (dict(stop=Stop(eps=1e-3, max_depth=4)), "`stop.max_depth` applies to discrete mode"),
        (dict(stop=dict(eps=1e-3, depth=4)), "`stop` takes eps \\(required\\)"),
        (dict(method="dopri5", step_size=0.1), "`step_size` applies to fixed-step methods"),
    ],
)
def test_settings_a_method_would_ignore_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ODEBlock(Hamiltonian(4), **kwargs)
    with pytest.raises(ValueError, match="`jumps` tells adaptive solvers"):
        SolverOptions(method="euler", jumps=False)  # the block's rarely changed settings live there


def test_mixed_precision_is_named():
    with pytest.raises(TypeError, match="`y0` is torch.float64 but the field's parameters are torch.float32"):
        ODEBlock(Hamiltonian(4))(torch.zeros(2, 4, dtype=torch.float64))


def test_sde_block_input_per_call_and_solution():
    field = nais()
    block = SDEBlock(field, noise="additive", sigma=0.2, step_size=0.25, seed=1, gradient="adjoint")
    x0 = torch.zeros(3, 3, dtype=torch.float64)
    u = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    sol = block.solve(x0, u=u, t=[0.5, 1.0])
    assert sol.ys.shape == (2, 3, 3) and torch.equal(sol.ys[-1], sol.y)
    sol.y.sum().backward()
    assert u.grad is not None and float(u.grad.abs().sum()) > 0
    with pytest.raises(ValueError, match="not a point of the step grid"):
        block.solve(x0, u=u, t=[0.3, 1.0])
    with pytest.raises(ValueError, match="`rtol`/`atol` control adaptive stepping"):
        SDEBlock(field, rtol=1e-3)


def test_layer_states_are_separate_tensors_of_one_graph():
    """Depth profiles differentiate a loss on y_L with respect to every y_l: the stacked solve(t=...).ys cannot
    give that (the blog reproduction reported ‖∂L/∂x_0‖ / ‖∂L/∂x_L‖ = 0 through it)."""
    from cde_nets import discretize

    torch.manual_seed(0)
    net = discretize(Hamiltonian(4, layers=6).double(), "euler")
    y0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    states = net.layer_states(y0)
    assert torch.equal(torch.stack(states), net.solve(y0, t=net.times).ys)
    grads = torch.autograd.grad(states[-1].square().sum(), states)
    assert all(float(g.abs().sum()) > 0 for g in grads)


@pytest.mark.parametrize("scheme", ["symplectic_euler", "verlet", "yoshida4"])
def test_layer_states_of_split_schemes_are_on_the_graph(scheme):
    """A split scheme carries (p, q) and reads out their concatenation: the next layer must read that readout, or
    ∂ℒ/∂y_l is missing. ∂ℒ/∂y_0 equals ∂ℒ/∂(input) and ∂ℒ/∂y_L = 2 y_L for ℒ = Σ y_L² (float64, 1e-12)."""
    from cde_nets import discretize

    torch.manual_seed(0)
    net = discretize(Hamiltonian(4, layers=5, K="blockdiag").double(), scheme)
    y0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    states = net.layer_states(y0)
    loss = states[-1].square().sum()
    grads = torch.autograd.grad(loss, [y0, *states])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[-1], 2 * states[-1], rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.stack(states), net.solve(y0, t=net.times).ys, rtol=0, atol=1e-13)
