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

import torch
from torch.func import functional_call, grad, vmap

from cde_nets import ODEBlock
from cde_nets.fields.baselines import MS1
from cde_nets.fields.nais import NAIS

D = torch.float64
TOL = dict(rtol=1e-5, atol=1e-7)


def close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err, scale = float((a - b).detach().abs().max()), float(b.detach().abs().max())
    assert scale > 0 and err <= rel * scale, err / scale


def test_forward_sensitivities_of_a_pieces_field_are_the_jacobian_under_torch_func():
    torch.manual_seed(1)
    nais = NAIS(3, 2).double()
    x0, u, U = torch.randn(2, 3, dtype=D), torch.randn(2, 2, dtype=D), torch.randn(2, 2, 2, dtype=D)
    forward, backprop = (ODEBlock(nais, T=1.0, gradient=g, **TOL) for g in ("forward", "backprop"))
    params = dict(forward.named_parameters())
    got = grad(lambda P: functional_call(forward, P, (x0,), dict(u=u)).sum())(params)
    want = torch.autograd.grad(backprop(x0, u=u).sum(), tuple(params.values()))
    for name, w in zip(params, want):
        close(got[name], w, 1e-10)
    got_vmapped = torch.autograd.grad(vmap(lambda v: forward(x0, u=v))(U).sum(), tuple(params.values()))
    want_loop = torch.autograd.grad(sum(backprop(x0, u=v).sum() for v in U), tuple(params.values()))
    for g, w in zip(got_vmapped, want_loop):
        close(g, w, 1e-10)

    ms1 = MS1(2, layers=1).double()  # one piece: jump_t is not served under vmap
    forward, backprop = (ODEBlock(ms1, T=1.0, gradient=g, **TOL) for g in ("forward", "backprop"))
    Y3 = torch.randn(2, 1, 2, dtype=D)
    got_vmapped = torch.autograd.grad(vmap(forward)(Y3).sum(), tuple(ms1.parameters()))
    want_loop = torch.autograd.grad(sum(backprop(y).sum() for y in Y3), tuple(ms1.parameters()))
    for g, w in zip(got_vmapped, want_loop):
        close(g, w, 1e-10)
