"""The gradient methods' own backward passes under ``torch.func`` (solvers.gradients.vmap_*), where they used to
give wrong numbers or torch's internal errors:

- forward sensitivities of a block whose field is built on :class:`~cde_nets.fields.pieces.Pieces` (NAIS's
  ``A = −RᵀR − εI``, MS1's pieces): the Jacobian in the parameters equals backprop's (it was zero when the
  block's per-call caches held constants built before the tangents were swapped in);
- a tensor ``torch.func`` differentiates, held where no gradient method can swap it for an input of its own (a
  tuple, a module-level dict): refused by name by every method, with or without ``vmap`` (it got a zero gradient,
  or backprop's under ``vmap``, whatever ``gradient`` said);
- ``vmap(vjp(...))`` with a cotangent shared by the instances: every method's gradient equals backprop's (the
  replays hit torch's internal assert, as did the adjoints with a batched parameter).

Float64, with tolerances loose enough to keep the file under a second or two; the continuous adjoints agree with
backprop to their own tolerance, the replays and forward mode to rounding."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, vjp, vmap

from cde_nets import ODEBlock, odeint
from cde_nets.fields.baselines import MS1
from cde_nets.fields.nais import NAIS

D = torch.float64
TOL = dict(rtol=1e-4, atol=1e-6)
T = torch.tensor([0.0, 0.5, 1.0], dtype=D)
A = torch.tensor([[0.0, 1.0], [-1.0, -0.1]], dtype=D)
Y = torch.tensor([[1.0, 0.5], [0.2, -0.3]], dtype=D)
W = torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=D)
OWN = ["adjoint", "checkpoint", "symplectic", "forward", "interpolating", "gauss"]
#: the module-level dict a field reads: a global, which no gradient method can swap
GLOBAL: dict[str, torch.Tensor] = {}


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err, scale = float((a - b).detach().abs().max()), float(b.detach().abs().max())
    assert scale > 0 and err <= rel * scale, err / scale


def test_forward_sensitivities_of_a_pieces_field_are_the_jacobian_under_torch_func():
    """NAIS (per-call constants) under torch.func.grad, MS1 (the pieces' views alone) under vmap and autograd."""
    torch.manual_seed(1)
    nais = NAIS(3, 2).double()
    x0, u = torch.randn(2, 3, dtype=D), torch.randn(2, 2, dtype=D)
    forward, backprop = (ODEBlock(nais, T=1.0, gradient=g, **TOL) for g in ("forward", "backprop"))
    params = dict(forward.named_parameters())
    got = grad(lambda P: functional_call(forward, P, (x0,), dict(u=u)).sum())(params)
    want = torch.autograd.grad(backprop(x0, u=u).sum(), tuple(params.values()))
    for name, w in zip(params, want):
        close(got[name], w, 1e-10)

    ms1 = MS1(2, layers=1).double()  # one piece: jump_t is not served under vmap
    forward, backprop = (ODEBlock(ms1, T=1.0, gradient=g, **TOL) for g in ("forward", "backprop"))
    Y3 = torch.randn(2, 1, 2, dtype=D)
    got_vmapped = torch.autograd.grad(vmap(forward)(Y3).sum(), tuple(ms1.parameters()))
    want_loop = torch.autograd.grad(sum(backprop(y).sum() for y in Y3), tuple(ms1.parameters()))
    for g, w in zip(got_vmapped, want_loop):
        close(g, w, 1e-10)


def _tuple_held(w: torch.Tensor, y: torch.Tensor, gradient: str, method: str = "dopri5") -> torch.Tensor:
    box = (w,)
    out = odeint(
        lambda t, x: torch.tanh(x @ A.T) + box[0], y, T, gradient=gradient, method=method, adjoint_params=(), **TOL
    )
    return out[-1].sum()


def _global_held(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ A.T) + GLOBAL["w"]


def _through_global(w: torch.Tensor, gradient: str) -> torch.Tensor:
    GLOBAL["w"] = w
    try:
        return odeint(_global_held, Y[0], T, gradient=gradient, adjoint_params=(), **TOL)[-1].sum()
    finally:
        GLOBAL.clear()


@pytest.mark.parametrize("gradient", OWN)
def test_a_differentiated_tensor_no_method_can_swap_is_refused_by_name_with_and_without_vmap(gradient):
    refusal = f"gradient='{gradient}' under torch.func: the field reaches a tensor .* cannot swap"
    with pytest.raises(ValueError, match=refusal):
        grad(_tuple_held)(W[0], Y[0], gradient)
    with pytest.raises(ValueError, match=refusal):  # with y0 differentiated too: w's gradient was zero
        grad(_tuple_held, argnums=(0, 1))(W[0], Y[0], gradient)
    with pytest.raises(ValueError, match=refusal):  # vmap used to switch silently to backprop
        vmap(grad(_tuple_held), in_dims=(0, None, None))(W, Y[0], gradient)
    with pytest.raises(ValueError, match=refusal):
        grad(_through_global)(W[0], gradient)
    assert torch._C._functorch.peek_interpreter_stack() is None


def test_a_held_tensor_is_refused_on_fixed_steps_and_served_where_the_method_can_swap_it():
    with pytest.raises(ValueError, match="gradient='adjoint' with method='rk4' under a torch.func transform"):
        grad(_tuple_held)(W[0], Y[0], "adjoint", "rk4")
    want = grad(_tuple_held)(W[0], Y[0], "backprop")

    def dict_held(w: torch.Tensor) -> torch.Tensor:  # a dict the field reaches: swapped, so served
        box = {"w": w}
        out = odeint(
            lambda t, x: torch.tanh(x @ A.T) + box["w"], Y[0], T, gradient="checkpoint", adjoint_params=(), **TOL
        )
        return out[-1].sum()

    close(grad(dict_held)(W[0]), want, 1e-10)


def _pulled(y: torch.Tensor, w: torch.Tensor, gradient: str) -> tuple[torch.Tensor, ...]:
    """The pullback of the solve in ``(y0, w)`` applied to a cotangent of ones, made inside the caller's vmap."""

    def solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        box = {"w": b}
        field = lambda t, x: torch.tanh(x @ A.T) + box["w"] * x  # noqa: E731
        return odeint(field, a, T, gradient=gradient, adjoint_params=(b,), **TOL)

    return vjp(solve, y, w)[1](torch.ones(len(T), 2, dtype=D))


# the replays failed with y0 batched, the continuous adjoints with the parameter batched (their saved inputs)
@pytest.mark.parametrize(
    ("gradient", "in_dims", "rel"),
    [("checkpoint", (0, None), 1e-12), ("symplectic", (0, None), 1e-12), ("adjoint", (None, 0), 2e-3),
     ("interpolating", (None, 0), 2e-3)],
)  # fmt: skip
def test_vmap_over_vjp_with_a_shared_cotangent_is_backprops_gradient(gradient, in_dims, rel):
    y, w = (Y if in_dims[0] == 0 else Y[0]), (W if in_dims[1] == 0 else W[0])
    got = vmap(_pulled, in_dims=(*in_dims, None))(y, w, gradient)
    want = vmap(_pulled, in_dims=(*in_dims, None))(y, w, "backprop")
    for a, b in zip(got, want):
        close(a, b, rel)  # the continuous adjoints to their backward solve's tolerance, the replays to rounding
