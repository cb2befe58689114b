"""Memory-free backward for the momentum scheme by exact inversion of its update (as Momentum ResNets do).

Forward keeps only the last state ``(x_L, v_L)``. Backward walks the layers in reverse, rebuilding each earlier
state from the later one — ``x_l = x_{l+1} − v_{l+1}``, ``v_l = (v_{l+1} − η_l h F_l(x_l)) / m_l`` — and
recomputes that one layer under autograd for its vector-Jacobian product. Memory is O(1) in depth; time is about
two forward passes. The division by ``m_l`` amplifies rounding by ``1/m_l`` per layer, so use it with a
moderate momentum (e.g. ``momentum=(0.9, ...)``), not the ResNet start ``m ≈ 0``.
"""

from __future__ import annotations

import torch

from .pieces import gathered, piece_modules

__all__ = ["momentum_memory_free"]


class _MemoryFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, net, f, y0, u, *params):
        h = net.h
        with torch.no_grad():
            coef = net.coefficients(y0.dim())
            state = net.scheme.init(y0)
            for l in range(net.field.grid.L):
                state = net.scheme.step(f, l, state, h, coef, l * h)
        ctx.net, ctx.f, ctx.u = net, f, u
        ctx.params = params
        ctx.save_for_backward(*state)
        return state[0].clone()

    @staticmethod
    def backward(ctx, grad_x):
        net, params = ctx.net, ctx.params
        x, v = ctx.saved_tensors
        with torch.enable_grad(), gathered(net.field):
            g = _backward(net, ctx.f, ctx.u, params, x, v, grad_x)
        return (None, None, *g)


def _backward(net, f, u, params, x, v, gx):
    """Reverse sweep. Each layer's VJP is taken w.r.t. that layer's own views (pieces from one ``unbind``, ``m_l``,
    ``η_l h``); one final backward through the unbinds and the coefficient maps reaches the parameters, so the
    sweep costs O(L |θ_l|), not O(L² |θ_l|) as VJPs w.r.t. the full ``(L, …)`` tensors would. Returns the gradients
    of ``(y0, u, *params)``; a block input ``u`` that needs one is swept like a parameter shared by all layers."""
    L, h = net.field.grid.L, net.h
    pieces = [p for p in piece_modules(net.field)]
    # the per-layer coefficient views; every layer's VJP reaches a, b through this small graph
    coef = {k: c.unbind(0) for k, c in net.coefficients(x.dim()).items()}
    by_layer = [t for t in [p._unbound for p in pieces] + list(coef.values()) if t[0].requires_grad]
    routed = {id(p.data) for p in pieces} | {id(getattr(net, n)) for n in ("a", "b") if hasattr(net, n)}
    direct = [p for p in params if id(p) not in routed]  # e.g. a learned friction γ, shared by all layers
    with_u = u is not None and u.requires_grad
    if with_u:
        direct.append(u)
    g_views = [[None] * L for _ in by_layer]
    g_direct = [torch.zeros_like(p) for p in direct]
    gv = torch.zeros_like(gx)
    for l in reversed(range(L)):
        with torch.no_grad():
            x_prev = x - v
            v_prev = (v - coef["eta_h"][l] * f.evaluate(l, x_prev, t=l * h)) / coef["m"][l]
        xi = x_prev.detach().requires_grad_(True)
        vi = v_prev.detach().requires_grad_(True)
        x1, v1 = net.scheme.step(f, l, (xi, vi), h, coef, l * h)
        views = [t[l] for t in by_layer]
        grads = torch.autograd.grad((x1, v1), (xi, vi, *views, *direct), (gx, gv), allow_unused=True, retain_graph=True)
        gx, gv = grads[0], grads[1]
        for i, g in enumerate(grads[2 : 2 + len(views)]):
            g_views[i][l] = g
        for acc, g in zip(g_direct, grads[2 + len(views) :]):
            if g is not None:
                acc += g
        x, v = x_prev, v_prev
    outs, gouts = [], []
    for t, gs in zip(by_layer, g_views):
        for view, g in zip(t, gs):
            if g is not None:
                outs.append(view)
                gouts.append(g)
    sweep = dict(zip(map(id, direct), g_direct))
    routed_params = [p for p in params if id(p) in routed]
    through = torch.autograd.grad(outs, routed_params, gouts, allow_unused=True) if outs else ()
    sweep.update(zip(map(id, routed_params), through))
    return (gx, sweep.get(id(u)) if with_u else None, *(sweep.get(id(p)) for p in params))


def momentum_memory_free(net, f, y0: torch.Tensor) -> torch.Tensor:
    """``x_L`` of a momentum :class:`~cde_nets.discrete.DiscreteNet` run on ``f`` (the field bound to this call's
    input), differentiable with O(1) memory."""
    params = tuple(p for p in net.parameters() if p.requires_grad)
    return _MemoryFree.apply(net, f, y0, f.u, *params)
