r"""The symplectic adjoint under ``torch.vmap``: each vmapped instance's attempts replayed one at a time, the
adjoint carried back through each attempt one stage's field evaluation at a time (Matsubara, Miyatake & Yaguchi
2021, "Symplectic adjoint method for exact gradient of neural ODE with minimal memory", NeurIPS).

For an explicit Runge-Kutta step ``k_i = F(t_0 + c_i h, Y_i)``, ``Y_i = y_0 + h Σ_{j<i} a_ij k_j``,
``y_1 = y_0 + h Σ_i b_i k_i``, the symplectic partner of the forward scheme carries the adjoint back as

    ``κ_i = h b_i λ_1 + h Σ_{j>i} a_ji μ_j``  (``i = s, …, 1``),   ``μ_i = (∂F/∂y(t_0 + c_i h, Y_i))ᵀ κ_i``,
    ``λ_0 = λ_1 + Σ_i μ_i``,   ``∂ℒ/∂θ += Σ_i (∂F/∂θ(t_0 + c_i h, Y_i))ᵀ κ_i``,

which conserves ``λᵀ δy`` exactly, so the gradient is the exact gradient of the solver's map (the stage form of
the paper's partitioned Runge-Kutta adjoint, which also covers ``b_i = 0``). Here, as outside ``vmap``
(:func:`solvers.gradients.replay_controlled.symplectic_attempt`), the attempt's stage-free arithmetic (the stage
inputs and times, the new state, the error ratio and the controller with ``steps="differentiated"``, the dense
output) is one small graph over the slopes ``k_i``, taken as leaves: ``κ_i = ∂ℒ/∂k_i`` is complete once the later
stages have passed theirs back, goes through one evaluation of the field, ``(μ_i, τ_i, ∂ℒ/∂θ) =
(∂F/∂(y, t, θ))ᵀ κ_i``, and ``(μ_i, τ_i)`` on through ``(Y_i, t_0 + c_i h)`` to the step's start and the slopes
before. The step sizes are differentiated as the checkpoint's (``Symplectic(steps=...)``), so the gradient equals
``backprop``'s through the same loop to rounding, with one field evaluation's graph at a time.

It is the vmapped checkpoint's replay (:mod:`solvers.gradients.vmap_checkpoint`, an ``autograd.Function`` that
``torch.func`` runs under ``vmap``) with this pullback in place of the product through the recomputed attempt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vjp

from .vmap_checkpoint import checkpoint_vmapped

__all__ = ["stagewise", "symplectic_vmapped"]


def stagewise(field_with: Callable, make: Callable, fn: Callable, primals: tuple, tensors: tuple, cots: Any):
    """The cotangents of ``primals`` and of the field's ``tensors`` from those of ``fn(loop, *primals)``'s
    outputs, one field evaluation at a time (the module's scheme): the slopes are recomputed without a graph, the
    arithmetic around them differentiated with the slopes as leaves, and each slope's cotangent taken through its
    own evaluation of the field, from the last stage to the first."""
    field = field_with(tensors)
    slopes: list[torch.Tensor] = []

    def evaluated(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        k = field(t, y)
        slopes.append(k)
        return k

    fn(make(evaluated), *primals)  # the slopes, in the order fn asks for them
    n, s = len(primals), len(slopes)

    def arithmetic(*a: torch.Tensor) -> tuple[Any, tuple[torch.Tensor, ...]]:
        points: list[torch.Tensor] = []

        def given(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            points.extend((t, y))
            return a[n + len(points) // 2 - 1]

        return fn(make(given), *a[:n]), tuple(points)

    traced = vjp(arithmetic, *primals, *slopes)
    (outs, points), pull = traced[0], traced[1]
    zero_outs = tuple(map(torch.zeros_like, outs)) if isinstance(outs, tuple) else torch.zeros_like(outs)
    zero_points = [torch.zeros_like(p) for p in points]
    total = list(pull((cots, tuple(zero_points))))
    grads = [torch.zeros_like(p) for p in tensors]

    def through_field(t: torch.Tensor, y: torch.Tensor, *p: torch.Tensor) -> torch.Tensor:
        return field_with(p)(t, y)

    for i in range(s - 1, -1, -1):
        t_i, y_i = points[2 * i], points[2 * i + 1]
        tau, mu, *got = vjp(through_field, t_i, y_i, *tensors)[1](total[n + i])
        grads = [g + d for g, d in zip(grads, got)]
        back = list(zero_points)
        back[2 * i], back[2 * i + 1] = tau, mu
        total = [x + d for x, d in zip(total, pull((zero_outs, tuple(back))))]
    return total[:n], grads


def symplectic_vmapped(run: Any, gradient: Any, options: dict) -> torch.Tensor | None:
    """The engine's solve of ``run`` under ``torch.vmap`` with ``gradient="symplectic"`` (a
    :class:`~solvers.gradients.Symplectic` without a budget): the states at ``run.t``, gradients by the
    symplectic adjoint over each instance's replayed attempts; ``None`` where nothing is differentiated."""
    return checkpoint_vmapped(run, gradient, options, pull=stagewise)
