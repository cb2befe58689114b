r"""The Gauss adjoint under ``torch.vmap``: each vmapped instance's adjoint solved backwards on its own steps, its
parameter gradient accumulated by Gauss-Legendre quadrature on each of those steps.

For ``y' = F(t, y, θ)`` and a loss ``ℒ(y(t_0), …, y(t_N))`` the adjoint solves, backwards from
``a(t_N) = ∂ℒ/∂y(t_N)`` and jumping by ``∂ℒ/∂y(t_i)`` at each output time,

    ``a' = −aᵀ ∂F/∂y(t, y(t))``,   ``∂ℒ/∂y_0 = a(t_0)``,   ``∂ℒ/∂θ = ∫_{t_0}^{t_N} a(t)ᵀ ∂F/∂θ(t, y(t)) dt``

(Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5). As :mod:`solvers.gradients.quadrature`
does outside ``vmap`` (SciMLSensitivity's ``GaussAdjoint``; Kim et al. 2021, "Stiff neural ordinary differential
equations", §II; Serban & Hindmarsh 2005, "CVODES", §3), the backward solve carries ``a`` alone, ``y(t)`` is read off
the forward solve's dense output, and after each accepted backward step ``[t_lo, t_hi]``, ``h = t_hi − t_lo``
(clipped at the interval's end),

    ``∫_{t_lo}^{t_hi} a(t)ᵀ ∂F/∂θ dt ≈ h Σ_q w_q a(τ_q)ᵀ ∂F/∂θ(τ_q, y(τ_q))``,   ``τ_q = t_hi − x_q h``,

the ``m``-point Gauss-Legendre rule (order ``2m``; ``m = ⌈p/2⌉`` for a method of order ``p`` unless
``Gauss(nodes=m)``), ``a(τ_q)`` from the backward step's own dense output.

On the loop of tensor decisions (:mod:`solvers.steppers.vmappable`) the forward solve keeps every attempt's dense
output (:func:`solvers.gradients.vmap_interpolating.record_dense`), read per instance at its own steps; the
backward solve runs on the same loop in ``s = −t``, with the forward's method, the tolerances of
:class:`~solvers.gradients.Gauss` and the forward's error norm, so each instance's backward steps are those of its
single solve. The quadrature is taken on every backward attempt as the loop makes it and added where the attempt
is accepted (a ``torch.where``: the instances do not share their steps). It runs as an ``autograd.Function``
written the way ``torch.func`` takes one (``setup_context``, ``generate_vmap_rule``), tensors the field closes
over taken as its inputs (:func:`solvers.gradients.vmap_adjoint.field_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vjp

from ..norms import StateNorm
from ..steppers.tableaux import TABLEAUX
from ..steppers.vmappable import _Loop, odeint_vmappable
from ..transforms import tracked
from .vmap_adjoint import _Swapped, applied, field_inputs
from .vmap_interpolating import Attempts, Caught, DenseAttempts, DenseRecorded, horner

__all__ = ["gauss_vmapped"]


class _VmapGauss(DenseRecorded):
    @staticmethod
    def backward(ctx: Any, grad_ys: torch.Tensor, *_: Any) -> tuple:
        cfg, t, field, forward, tensors = DenseRecorded.saved(ctx)

        def reversed_time(s: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
            """``da/ds = aᵀ ∂F/∂y`` at ``t = −s``, ``y`` off the forward's dense output."""
            return vjp(lambda z: field(-s, z), forward(-s))[1](a)[0]

        g = [torch.zeros_like(p) for p in tensors]
        a = grad_ys[-1]
        for i in range(len(t) - 1, 0, -1):
            a = _interval(cfg, field, forward, reversed_time, a, t[i - 1], t[i], tensors, g)
            a = a + grad_ys[i - 1]
        return (a, None, None, *g)


def _interval(
    cfg: dict, field: _Swapped, forward: DenseAttempts, adjoint: Callable, a: torch.Tensor, lo, hi, tensors, g: list
) -> torch.Tensor:
    """``a`` carried from ``hi`` back to ``lo``; each accepted backward step's quadrature added to ``g``."""
    back = cfg["backward"]
    caught = Caught(adjoint)
    loop = _Loop(caught, a, TABLEAUX[back["method"]], back["rtol"], back["atol"], cfg["options"], 0, "fixed")
    xs, ws = cfg["rule"]

    def seen(s0: torch.Tensor, h: torch.Tensor, a0: torch.Tensor, coeffs: torch.Tensor, ok: torch.Tensor) -> None:
        if not tensors:
            return
        span = torch.minimum(h, -lo.to(torch.float64) - s0)
        use = ok & (span > 0)
        taus = [-(s0 + x * span) for x in xs]
        ys = [forward(tau) for tau in taus]
        dtype = a0.dtype
        cots = torch.stack([(w * span).to(dtype) * horner(coeffs, (x * span / h).to(dtype)) for x, w in zip(xs, ws)])

        def at_nodes(*p: torch.Tensor) -> torch.Tensor:
            f = field.with_tensors(p)
            return torch.stack([f(tau.to(y.dtype), y) for tau, y in zip(taus, ys)])

        for j, d in enumerate(vjp(at_nodes, *tensors)[1](cots)):
            g[j] = torch.where(use, g[j] + d, g[j])

    span_t = -torch.stack([hi, lo]).to(torch.float64)
    record = Attempts(caught, loop, seen)
    return odeint_vmappable(caught, a, span_t, options=cfg["options"], record=record, **back)[-1]


def gauss_vmapped(run: Any, gradient: Any, options: dict) -> torch.Tensor | None:
    """The engine's solve of ``run`` under ``torch.vmap`` with the Gauss adjoint (``gradient``, a
    :class:`~solvers.gradients.Gauss`): the states at ``run.t``, gradients with respect to ``run.y0``,
    ``run.params`` and every tracked tensor the field reaches by each instance's backward solve and quadrature;
    ``None`` where nothing the solve reads is differentiated (the plain loop serves)."""
    func, groups, tensors = field_inputs(run, "gauss")
    if not (tracked(run.y0) or any(tracked(p) for p in tensors)):
        return None
    s = run.solver
    norm = options.get("norm")
    cfg = dict(
        func=func,
        slots=groups,
        forward=dict(method=s.method, rtol=s.rtol, atol=s.atol, options=options, max_steps=s.max_steps),
        backward=dict(
            method=s.method,
            rtol=s.rtol if gradient.rtol is None else gradient.rtol,
            atol=s.atol if gradient.atol is None else gradient.atol,
            max_steps=s.max_steps,
        ),
        options={"norm": norm} if isinstance(norm, StateNorm) else {},
        rule=gradient.rule(s.method),
    )
    return applied(_VmapGauss, "gauss", run.y0, run.t, cfg, *tensors)[0]
