"""Memory-free backward for the momentum scheme by exact inversion of its update (as Momentum ResNets do).

Forward keeps only the last state ``(x_L, v_L)``. Backward walks the layers in reverse, rebuilding each earlier
state from the later one — ``x_l = x_{l+1} − v_{l+1}``, ``v_l = (v_{l+1} − η_l h F_l(x_l)) / m_l`` — and
recomputes that one layer under autograd for its vector-Jacobian product. Memory is O(1) in depth; time is about
two forward passes. The division by ``m_l`` amplifies rounding by ``1/m_l`` per layer, so use it with a
moderate momentum (e.g. ``momentum=(0.9, ...)``), not the ResNet start ``m ≈ 0``.
"""

from __future__ import annotations

import torch

__all__ = ["momentum_memory_free"]


class _MemoryFree(torch.autograd.Function):
    @staticmethod
    def forward(ctx, net, y0, *params):
        with torch.no_grad():
            coef = net.coefficients(y0.dim())
            state = net.scheme.init_state(y0)
            for l in range(net.field.grid.L):
                state = net.step(l, state, coef)
        ctx.net = net
        ctx.params = params
        ctx.save_for_backward(*state)
        return state[0].clone()

    @staticmethod
    def backward(ctx, grad_x):
        net, params = ctx.net, ctx.params
        x, v = ctx.saved_tensors
        gx, gv = grad_x, torch.zeros_like(grad_x)
        gparams = [torch.zeros_like(p) for p in params]
        with torch.enable_grad():  # once; every layer's VJP reaches a, b through this small graph
            coef = net.coefficients(x.dim())
        for l in reversed(range(net.field.grid.L)):
            with torch.no_grad():
                x_prev = x - v
                v_prev = (v - coef["eta_h"][l] * net.field.evaluate(l, x_prev)) / coef["m"][l]
            with torch.enable_grad():
                xi = x_prev.detach().requires_grad_(True)
                vi = v_prev.detach().requires_grad_(True)
                x1, v1 = net.step(l, (xi, vi), coef)
                grads = torch.autograd.grad((x1, v1), (xi, vi, *params), (gx, gv), allow_unused=True,
                                            retain_graph=True)
            gx, gv = grads[0], grads[1]
            for i, g in enumerate(grads[2:]):
                if g is not None:
                    gparams[i] += g
            x, v = x_prev, v_prev
        return (None, gx, *gparams)


def momentum_memory_free(net, y0: torch.Tensor) -> torch.Tensor:
    """``x_L`` of a momentum :class:`~cde_nets.discrete.DiscreteNet`, differentiable with O(1) memory."""
    params = tuple(p for p in net.parameters() if p.requires_grad)
    return _MemoryFree.apply(net, y0, *params)
