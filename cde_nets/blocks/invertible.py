r"""Memory-free backward for discrete nets whose layers can be undone exactly (``discretize(..., memory_free=True)``).

A reversible network need not store its activations: each layer's input is rebuilt from its output during the
backward pass (Gomez, Ren, Urtasun & Grosse 2017, "The Reversible Residual Network", §3). Every scheme with
:attr:`~solvers.schemes.Scheme.invertible` declares that inverse as :meth:`~solvers.schemes.Scheme.inverse`,
next to its ``step``:

- ``symplectic_euler`` / ``symplectic_euler_qp`` / ``verlet`` on a separable field (H2-DNN, Galimberti et al. 2023,
  eqs. 12-13; MS1, MS3): the explicit half steps run backwards in reverse order, ``q ← q − h F_q(p)``,
  ``p ← p − h F_p(q)`` — the additive coupling of Gomez et al.;
- ``momentum`` (Momentum ResNets, Sander et al. 2021): ``x_l = x_{l+1} − v_{l+1}``,
  ``v_l = (v_{l+1} − η_l h F_l(x_l)) / m_l``;
- ``lm2`` with ``k_l ≠ 0``: ``x_{l−1} = (x_{l+1} − (1 − k_l) x_l − h F_l(x_l)) / k_l``;
- ``alf`` (MALI, Zhuang et al. 2021, Alg. 2): ``y_½ = y_{l+1} − (h/2) v_{l+1}``, ``v_l = 2 F_l(y_½) − v_{l+1}``,
  ``y_l = y_½ − (h/2) v_l``.

The forward keeps only the last scheme state; backward walks the layers in reverse, rebuilds each input, recomputes
that one layer under autograd and takes its vector-Jacobian product. Memory saved for backward is one state,
whatever the depth; time is about two forward passes plus one backward. The gradient is that of the layers' map
up to the rounding of the reconstruction (:func:`reconstruction_error`): no amplification for the symplectic
shears and ALF with ``η = 1``; ``(1/m)^L`` for momentum, ``∏ 1/|k_l|`` for lm2.
"""

from __future__ import annotations

from typing import Any

import torch

from cde_nets.blocks.gathering import gathered
from cde_nets.fields.base import Field
from cde_nets.fields.pieces import piece_modules
from cde_nets.solvers.gradients.second_order import first_order, remember_inputs

__all__ = ["memory_free", "reconstruction_error"]

_SECOND_ORDER = (
    "discretize(..., memory_free=True) gives first derivatives only: its backward pass rebuilds each layer's input "
    "and takes that layer's vector-Jacobian product without a graph of its own, so differentiating the gradient it "
    "returned (create_graph=True then torch.autograd.grad or .backward() of it, torch.autograd.functional.hessian, "
    "a gradient penalty) would give a wrong second derivative. Use memory_free=False (autograd through the stored "
    "layers, to any order)."
)


def _memos(field: torch.nn.Module) -> list[dict]:
    return [m._memo for m in field.modules() if isinstance(m, Field) and m._memo is not None]


def _clear(memos: list[dict]) -> None:
    # a field's per-call memo keeps per-layer values (NAIS's B u + b): dropped after each layer, they do not
    # grow with depth
    for m in memos:
        m.clear()


class _MemoryFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, net: Any, f: Any, y0: torch.Tensor, u: torch.Tensor | None, *params: torch.Tensor):
        scheme, h = net.scheme, net.h
        with torch.no_grad():
            coef = net.coefficients(y0.dim())
            scheme.check_inverse(coef)
            memos = _memos(net.field)
            state = scheme.init(y0)
            for l in range(net.field.grid.L):
                state = scheme.step(f, l, state, h, coef, l * h)
                _clear(memos)
            y = scheme.readout(state)
        ctx.net, ctx.f, ctx.u, ctx.params = net, f, u, params
        remember_inputs(ctx, y0, u, *params)
        ctx.save_for_backward(*state)
        return y.clone() if any(y is s for s in state) else y

    @staticmethod
    @first_order("discretize(..., memory_free=True)", serve=lambda ctx, cotangents, grads: _SECOND_ORDER)
    def backward(ctx: Any, grad_y: torch.Tensor):
        net, params = ctx.net, ctx.params
        try:
            with torch.enable_grad(), gathered(net.field, stacked=False):
                g = _backward(net, ctx.f, ctx.u, params, tuple(ctx.saved_tensors), grad_y)
        finally:
            net.scheme.end_pass()
        return (None, None, *g)


def _backward(net: Any, f: Any, u: torch.Tensor | None, params: tuple, state: tuple, grad_y: torch.Tensor) -> tuple:
    """Reverse sweep. Each layer's VJP is taken w.r.t. that layer's own views (pieces from one ``unbind``, the
    scheme's per-layer coefficients); one final backward through the unbinds and the coefficient maps reaches the
    parameters, so the sweep costs O(L |θ_l|), not O(L² |θ_l|) as VJPs w.r.t. the full ``(L, …)`` tensors would.
    Returns the gradients of ``(y0, u, *params)``; a block input ``u`` that needs one is swept like a parameter
    shared by all layers."""
    scheme, L, h = net.scheme, net.field.grid.L, net.h
    pieces = list(piece_modules(net.field))
    full = net.coefficients(state[0].dim())
    coef = {k: c.unbind(0) for k, c in full.items()}
    # (the (L, ...) tensor, its per-layer views) for the pieces and the scheme's coefficients
    by_layer = [(p.data, p.views()) for p in pieces] + [(full[k], coef[k]) for k in full]
    by_layer = [(whole, views) for whole, views in by_layer if views[0].requires_grad]
    routed = {id(p.data) for p in pieces} | {id(getattr(net, n)) for n in scheme.coefficients}
    direct = [p for p in params if id(p) not in routed]  # shared by all layers, e.g. a friction γ, J's X
    with_u = u is not None and u.requires_grad
    if with_u:
        direct.append(u)
    memos = _memos(net.field)
    # the readout's VJP gives the gradient of the last state, whatever the scheme's state
    leaves = tuple(s.detach().requires_grad_(True) for s in state)
    g_state = _zeros(torch.autograd.grad(scheme.readout(leaves), leaves, grad_y, allow_unused=True), leaves)
    g_views: list[list[torch.Tensor | None]] = [[None] * L for _ in by_layer]
    g_direct = [torch.zeros_like(p) for p in direct]
    for l in reversed(range(L)):
        views = [v[l] for _, v in by_layer]
        state, g_state, grads = scheme.inverse_vjp(f, l, state, g_state, (*views, *direct), h, coef, l * h)
        _clear(memos)
        for i, g in enumerate(grads[: len(views)]):
            g_views[i][l] = g
        for acc, g in zip(g_direct, grads[len(views) :]):
            if g is not None:
                acc += g
    sweep = dict(zip(map(id, direct), g_direct))
    outs, gouts = [], []
    for (whole, views), gs in zip(by_layer, g_views):
        g = torch.stack([torch.zeros_like(v) if g is None else g for v, g in zip(views, gs)])
        if whole.is_leaf:  # a piece's data: the stacked layer gradients are its gradient
            sweep[id(whole)] = g
        else:
            outs.append(whole)
            gouts.append(g)
    routed_params = [p for p in params if id(p) in routed and id(p) not in sweep]
    if outs and routed_params:  # the coefficient maps (m = sigmoid(a), ...), one backward for all layers
        sweep.update(zip(map(id, routed_params), torch.autograd.grad(outs, routed_params, gouts, allow_unused=True)))
    # y0 reaches the first state through init (e.g. the (p, q) slices of a split scheme)
    y0 = scheme.readout(state).detach().requires_grad_(True)
    pairs = [(s, g) for s, g in zip(scheme.init(y0), g_state) if s.requires_grad]  # v_0 = 0 needs none
    gy0 = torch.autograd.grad([s for s, _ in pairs], y0, [g for _, g in pairs])[0]
    return (gy0, sweep.get(id(u)) if with_u else None, *(sweep.get(id(p)) for p in params))


def _zeros(grads: tuple, like: tuple) -> tuple:
    return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, like))


def memory_free(net: Any, f: Any, y0: torch.Tensor) -> torch.Tensor:
    """The output of a :class:`~cde_nets.blocks.discrete.DiscreteNet` with an invertible scheme run on ``f`` (the field
    bound to this call's input), differentiable with memory constant in depth."""
    params = tuple(p for p in net.parameters() if p.requires_grad)
    return _MemoryFree.apply(net, f, y0, f.u, *params)


def reconstruction_error(net: Any, y0: torch.Tensor, u: torch.Tensor | None = None) -> float:
    """``max |ŷ_0 − y_0| / max |y_0|`` for ``ŷ_0`` rebuilt by the scheme's inverse from the net's last state (no
    gradients): the rounding the memory-free backward carries into its gradient."""
    scheme, h, L = net.scheme, net.h, net.field.grid.L
    f = net.bind(y0, u)
    with torch.no_grad():
        coef = net.coefficients(y0.dim())
        scheme.check_inverse(coef)
        state = scheme.init(y0)
        with gathered(net.field):  # as the forward
            for l in range(L):
                state = scheme.step(f, l, state, h, coef, l * h)
        with gathered(net.field, stacked=False):  # as the backward
            for l in reversed(range(L)):
                state = scheme.inverse(f, l, state, h, coef, l * h)
        back = scheme.readout(state)
        scheme.end_pass()
    return float((back - y0).abs().max() / y0.abs().max())
