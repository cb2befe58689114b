r"""The symplectic adjoint of an implicit Runge-Kutta step (Matsubara, Miyatake & Yaguchi 2021, "Symplectic adjoint
method for exact gradient of neural ODE with minimal memory", NeurIPS, §4; Sanz-Serna 2016, "Symplectic Runge-Kutta
schemes for adjoint equations", SIAM Rev. 58).

A step ``y_{n+1} = y_n + h Σ_i b_i F(Y_i)``, ``Y_i = y_n + h Σ_j a_ij F(Y_j)`` of the tableau ``(A, b, c)`` is
paired with the step of the adjoint system ``λ' = −(∂F/∂y)ᵀ λ`` by the partner coefficients
``a*_ij = b_j − b_j a_ji / b_i``,

    ``λ_{n+1} = λ_n + h Σ_i b_i l_i``,   ``l_i = −J(Y_i)ᵀ Λ_i``,   ``Λ_i = λ_n + h Σ_j a*_ij l_j``,

which conserves ``λᵀ δy`` exactly, so ``λ_n`` is the exact gradient of the step map (defined whenever every
``b_i ≠ 0``). For a symplectic tableau (``b_i a_ij + b_j a_ji = b_i b_j``: implicit midpoint, Gauss-Legendre)
``a*_ij = a_ij``: the adjoint is integrated by the same method. Solved backwards for ``λ_n`` in stage form, with
``κ_i = h b_i Λ_i`` (the cotangent of the stage derivative ``F(Y_i)``):

    ``κ_j − h Σ_i a_ij J(Y_i)ᵀ κ_i = h b_j λ_{n+1}``,   ``λ_n = λ_{n+1} + Σ_i J(Y_i)ᵀ κ_i``,
    ``∂ℒ/∂θ += Σ_i (∂F(Y_i)/∂θ)ᵀ κ_i``:

one linear solve with the transposed stage Jacobian (:func:`~solvers.steppers.implicit.transposed_stage_solve`), then
one vector-Jacobian product per stage, each through the graph of a single evaluation. The stages ``Y_i`` are re-solved
from the step's stored start ``y_n`` without a graph, so the memory is one state per step plus one evaluation's
graph, whatever the number of steps or Newton iterations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..steppers.implicit import FlatField, Newton, solve_stages, transposed_stage_solve
from ..steppers.implicit_tableaux import ImplicitTableau

__all__ = ["pairs_with_partner", "symplectic_adjoint_step"]


def pairs_with_partner(tab: ImplicitTableau) -> bool:
    """Whether the symplectic adjoint is defined for ``tab``: every weight ``b_i ≠ 0`` (the partner coefficients
    divide by them)."""
    return all(bi != 0.0 for bi in tab.b)


def symplectic_adjoint_step(
    fun: Any,
    t0: float,
    times: list[float],
    y: torch.Tensor,
    h: float,
    tab: ImplicitTableau,
    newton: Newton,
    lam: torch.Tensor,
    params: Sequence[torch.Tensor],
    batched: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """``(λ_n, [∂ℒ/∂θ_k])`` of one step of ``tab`` from ``y`` ``(B, ...)`` at ``t0`` with step ``h`` and stage times
    ``times``, for the cotangent ``λ_{n+1}`` (``lam``, ``y``'s shape) of its output; ``params``: the tensors
    ``fun`` closes over (their entries are ``None`` where unused); ``batched``: as for
    :func:`~solvers.steppers.implicit.implicit_step`. See the module."""
    shape, B = y.shape, y.shape[0]
    flat = y.detach().reshape(B, -1)
    f = FlatField(fun, shape)
    with torch.no_grad():
        Z, _, kind = solve_stages(f, t0, times, flat, h, tab, newton, batched)
        Y = flat + Z
        A = torch.tensor(tab.a, dtype=y.dtype, device=y.device)
        b = torch.tensor(tab.b, dtype=y.dtype, device=y.device)
        lam_flat = lam.reshape(B, -1)
        g = (h * b).view(-1, 1, 1) * lam_flat
        kappa = transposed_stage_solve(f, times, Y, A, h, g, kind, batched, newton.max_iters, newton.tol)
    out = lam_flat.clone()
    grads: list[torch.Tensor | None] = [None] * len(params)
    for ti, Yi, ki in zip(times, Y, kappa):
        with torch.enable_grad():
            x = Yi.detach().requires_grad_(True)
            gs = torch.autograd.grad(f(ti, x), (x, *params), ki, allow_unused=True)
        if gs[0] is not None:
            out += gs[0]
        for k, gk in enumerate(gs[1:]):
            if gk is not None:
                prev = grads[k]
                grads[k] = gk if prev is None else prev + gk
    return out.reshape(shape), grads
