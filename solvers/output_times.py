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
Under torch.autograd ``F`` is evaluated in the backward pass without a graph (one evaluation per output time), so
these gradients cannot be differentiated again (double backward raises).

Under a ``torch.func`` transform (``grad``, ``jacrev``, ``vjp``, ``vmap``, ``jvp``) the times ride the solution as
one explicit midpoint step of length ``δ = t − stop_gradient(t)`` (zero in value, one in derivative), taken
forwards from each output state and backwards onto the start state (Hairer, Nørsett & Wanner, "Solving Ordinary
Differential Equations I", §II.1: the midpoint rule is of order 2):

    ``y(t_i) ≈ y_i + δ_i F(t̄_i + δ_i/2, y_i + (δ_i/2) F(t̄_i, y_i))``,
    ``y_0 ≈ y_0 − δ_0 F(t_0 − δ_0/2, y_0 − (δ_0/2) F(t_0, y_0))``.

Their values are ``y_i`` and ``y_0`` exactly; their first derivatives in ``δ`` are ``±F`` as above, and, the rule
being of order 2, their second derivatives are the flow's (``∂²y/∂t_i² = ∂F/∂t + ∂F/∂y F``), so torch.func's
transforms (``vmap`` batching every instance's own times included) differentiate them as any other operation,
twice over. Two field evaluations per time, in the forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .gradients.second_order import refused
from .transforms import under_transform

__all__ = ["with_output_times", "with_start_time"]

Field = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum()


#: a second derivative through the times' gradient (the states' moving with them is not on the graph it is taken on)
TIMES_REFUSAL = (
    "a second derivative with respect to the output times `t` is not served under torch.autograd: their gradient "
    "<dL/dy(t_i), F(t_i, y(t_i))> is computed without a graph of its own. Pass a `t` that does not require grad "
    "for second derivatives in y0 and the parameters, or differentiate the times by finite differences."
)


class _TimeGradient(torch.autograd.Function):
    """Identity on ``ys`` ``(n, ...)``; backward gives time ``i`` the gradient ``sign · ⟨∂ℒ/∂y_i, F(t_i, y_i)⟩``
    (``+1``: an output time, ``−1``: the start time, whose state is the given ``y0``)."""

    @staticmethod
    def forward(ctx, field: Field, ys: torch.Tensor, t: torch.Tensor, sign: float) -> torch.Tensor:
        ctx.field, ctx.sign = field, sign
        ctx.save_for_backward(ys, t)
        return ys.view_as(ys)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ys, t = ctx.saved_tensors
        with torch.no_grad():
            g_t = ctx.sign * torch.stack([_dot(grad[i], ctx.field(t[i], ys[i])) for i in range(len(t))]).to(t.dtype)
        if torch.is_grad_enabled():  # create_graph: the states' gradient passes on with its graph, the times' cannot
            anchors = [x for x in (grad, ys, t) if x.requires_grad]
            (g_t,) = refused(TIMES_REFUSAL, (g_t,), anchors)
        return None, grad, g_t, None


def _midpoint(field: Field, y: torch.Tensor, t: torch.Tensor, sign: float) -> torch.Tensor:
    """``y`` itself in value, carried to the time ``t`` (``sign=+1``: forwards from ``stop_gradient(t)``; ``−1``:
    backwards from ``t`` onto ``stop_gradient(t)``) by one midpoint step of length ``δ = t − stop_gradient(t)``."""
    bar = t.detach()
    delta = t - bar
    h = (sign * delta).to(y.dtype)
    start = bar if sign > 0 else t  # the step starts at the known time: forwards from t̄, backwards from t
    inner = y + (h / 2) * field(start, y)
    return y + h * field(start + sign * delta / 2, inner)


def with_start_time(field: Field, y0: torch.Tensor, t0: torch.Tensor) -> torch.Tensor:
    """``y0`` itself, carrying ``∂ℒ/∂t_0 = −⟨∂ℒ/∂y_0, F(t_0, y_0)⟩`` (``t0``: a 0-d tensor that requires grad)."""
    if under_transform():
        return _midpoint(field, y0, t0, -1.0)
    return _TimeGradient.apply(field, y0.unsqueeze(0), t0.reshape(1), -1.0)[0]


def with_output_times(field: Field, ys: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``ys`` (``(len(t), *state)``) itself, carrying ``∂ℒ/∂t_i = ⟨∂ℒ/∂y(t_i), F(t_i, y(t_i))⟩``."""
    if under_transform():
        return torch.stack([_midpoint(field, ys[i], t[i], 1.0) for i in range(len(t))])
    return _TimeGradient.apply(field, ys, t, 1.0)
