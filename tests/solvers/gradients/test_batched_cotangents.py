"""Cotangents batched by ``torch.vmap`` over ``torch.autograd.grad`` (one vector-Jacobian product per row) through
every gradient method's own backward pass: the rows' products, the Jacobian of backprop's solve to each method's
accuracy. torch.autograd's own vectorisation (``jacobian``/``hessian`` with ``vectorize=True``,
``is_grads_batched=True``) batches with an older mechanism that cannot run a backward pass stepping on the host:
refused by name where it fails (forward sensitivities' ``Jᵀ g`` runs batched). Both were torch's internal errors."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.functional import jacobian

from cde_nets import ODEBlock, discretize, odeint
from cde_nets.fields import CubicFriction

F64 = torch.float64
Y0 = torch.tensor([0.3, -0.2], dtype=F64)
T = torch.tensor([0.0, 1.0], dtype=F64)
W = torch.tensor([[0.8, -0.6], [0.4, 0.5]], dtype=F64)
# the replays and forward sensitivities take backprop's steps; the adjoints solve backwards to their tolerance
METHODS = {"checkpoint": 1e-12, "symplectic": 1e-12, "forward": 1e-12, "adjoint": 1e-6, "interpolating": 1e-6}
METHODS["gauss"] = 1e-6


def end(y0: torch.Tensor, gradient: str) -> torch.Tensor:
    f = lambda t, y: torch.tanh(y @ W.T)  # noqa: E731
    return odeint(f, y0, T, gradient=gradient, adjoint_params=(), rtol=1e-9, atol=1e-11)[-1]


REF = jacobian(lambda y: end(y, "backprop"), Y0)


@pytest.mark.parametrize("gradient", list(METHODS))
def test_vmap_over_autograd_grad_gives_each_rows_product(gradient):
    y = Y0.clone().requires_grad_(True)
    out = end(y, gradient)
    rows = torch.vmap(lambda v: torch.autograd.grad(out, y, v, retain_graph=True)[0])(torch.eye(2, dtype=F64))
    assert float((rows - REF).abs().max()) <= METHODS[gradient] * float(REF.abs().max())


@pytest.mark.parametrize("gradient", ["adjoint", "checkpoint", "gauss"])
def test_torch_autograds_own_vectorisation_is_refused_by_name_where_it_cannot_run(gradient):
    with pytest.raises(ValueError, match=f"gradient='{gradient}' with batched cotangents.*vectorize=False"):
        jacobian(lambda y: end(y, gradient), Y0, vectorize=True)
    got = jacobian(lambda y: end(y, "forward"), Y0, vectorize=True)  # Jᵀ g: tensor operations only
    assert float((got - REF).abs().max()) <= 1e-12 * float(REF.abs().max())


def test_the_memory_free_discrete_backward_serves_vmap_and_refuses_vectorize(f64):
    field = CubicFriction(4, layers=4, zero_init=False, generator=torch.Generator().manual_seed(1))
    stored = discretize(field, "momentum", momentum=(0.8, 0.2))
    free = discretize(field, "momentum", momentum=(0.8, 0.2), memory_free=True)
    free.load_state_dict(stored.state_dict())
    x = torch.tensor([[0.3, -0.2, 0.1, 0.4]], requires_grad=True)
    out = free(x)
    rows = torch.vmap(lambda v: torch.autograd.grad(out, x, v, retain_graph=True)[0])(torch.eye(4).reshape(4, 1, 4))
    want = jacobian(lambda z: stored(z), x.detach()).reshape(4, 4)
    assert float((rows.reshape(4, 4) - want).abs().max()) <= 1e-12
    with pytest.raises(ValueError, match=r"memory_free=True\) with batched cotangents"):
        jacobian(lambda z: free(z), x.detach(), vectorize=True)


@pytest.mark.parametrize("gradient", ["checkpoint", "adjoint"])
def test_the_block_door_serves_and_refuses_alike(gradient):
    block = ODEBlock(_Tanh(), T=1.0, gradient=gradient, rtol=1e-9, atol=1e-11)
    y = Y0[None].clone().requires_grad_(True)
    out = block(y)
    rows = torch.vmap(lambda v: torch.autograd.grad(out, y, v, retain_graph=True)[0])(torch.eye(2, dtype=F64)[:, None])
    assert float((rows[:, 0] - REF).abs().max()) <= METHODS[gradient] * float(REF.abs().max())
    with pytest.raises(ValueError, match=f"gradient='{gradient}' with batched cotangents"):
        jacobian(lambda z: block(z), y.detach(), vectorize=True)


class _Tanh(torch.nn.Module):
    """The module form of :func:`end`'s field."""

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(y @ W.T)
