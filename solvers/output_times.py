r"""Gradients with respect to the times of an ODE solve, the same in every gradient mode.

For ``y' = F(t, y)`` solved from ``y(t_0) = y_0`` and read at ``t_0, t_1, ..., t_N``, the flow ``Φ`` gives
``y(t_i) = Φ(t_i; t_0, y_0)``, and

    ``∂y(t_i)/∂t_i = F(t_i, y(t_i))``,    ``∂y(t_i)/∂t_0 = −(∂y(t_i)/∂y_0) F(t_0, y_0)``

(Chen et al. 2018, "Neural ordinary differential equations", appendix B, eq. 52: the loss' gradient with
respect to the start time is ``−a(t_0)ᵀ F(t_0, y_0)``, ``a(t_0) = ∂ℒ/∂y_0``). Both terms ride two identity
functions around the solve, so they hold whatever differentiates the solve itself (backprop through the steps,
the adjoint, checkpointed replays):

- :func:`with_start_time` before the solve: ``y_0`` unchanged, and ``∂ℒ/∂t_0 −= ⟨∂ℒ/∂y_0, F(t_0, y_0)⟩`` once
  the solve's backward pass has delivered ``∂ℒ/∂y_0`` (moving the start later by ``δ`` is starting from
  ``y_0 − δ F(t_0, y_0)``);
- :func:`with_output_times` after it: ``ys`` unchanged, and ``∂ℒ/∂t_i += ⟨∂ℒ/∂y(t_i), F(t_i, y(t_i))⟩``.

For ``t_0`` the two cancel in ``y(t_0) = y_0``, as they must. The solve itself must see the times detached.
``F`` is evaluated in the backward pass without a graph (one evaluation per output time), so these gradients
cannot be differentiated again (double backward raises).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["with_output_times", "with_start_time"]

Field = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum()


class _TimeGradient(torch.autograd.Function):
    """Identity on ``ys`` ``(n, ...)``; backward gives time ``i`` the gradient ``sign · ⟨∂ℒ/∂y_i, F(t_i, y_i)⟩``
    (``+1``: an output time, ``−1``: the start time, whose state is the given ``y0``)."""

    @staticmethod
    def forward(ctx, field: Field, ys: torch.Tensor, t: torch.Tensor, sign: float) -> torch.Tensor:
        ctx.field, ctx.sign = field, sign
        ctx.save_for_backward(ys, t)
        return ys.view_as(ys)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        ys, t = ctx.saved_tensors
        with torch.no_grad():
            g_t = torch.stack([_dot(grad[i], ctx.field(t[i], ys[i])) for i in range(len(t))]).to(t.dtype)
        return None, grad, ctx.sign * g_t, None


def with_start_time(field: Field, y0: torch.Tensor, t0: torch.Tensor) -> torch.Tensor:
    """``y0`` itself, carrying ``∂ℒ/∂t_0 = −⟨∂ℒ/∂y_0, F(t_0, y_0)⟩`` (``t0``: a 0-d tensor that requires grad)."""
    return _TimeGradient.apply(field, y0.unsqueeze(0), t0.reshape(1), -1.0)[0]


def with_output_times(field: Field, ys: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``ys`` (``(len(t), *state)``) itself, carrying ``∂ℒ/∂t_i = ⟨∂ℒ/∂y(t_i), F(t_i, y(t_i))⟩``."""
    return _TimeGradient.apply(field, ys, t, 1.0)
