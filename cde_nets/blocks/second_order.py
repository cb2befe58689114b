r"""Continuous mode for second-order fields with the Runge-Kutta-Nyström methods: :func:`solve_second_order`.

``q'' = f(q, q')`` (the seeds' second-order field ``x' = v``, ``v' = −γ v + η f(x)``, blog §8; Hauser's C² net when
``γ = 0``) integrated directly by a Nyström method (:mod:`~cde_nets.solvers.steppers.nystrom_tableaux`) instead of its
first-order form: ``nystrom4`` (fixed steps, any ``f(q, q')``) or ``dprkn6`` (Dormand & Prince 1987; ``q'' = f(q)``,
adaptive with a sixth-order dense output, or fixed steps).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cde_nets.blocks.solution import Solution
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.counting import SolverStats
from cde_nets.solvers.errors import check_positive
from cde_nets.solvers.steppers.nystrom_ode import integrate_nystrom

__all__ = ["solve_second_order"]


def solve_second_order(
    field: torch.nn.Module,
    y0: torch.Tensor,
    t: Sequence[float] | torch.Tensor | None = None,
    *,
    method: str = "dprkn6",
    step_size: float | None = None,
    rtol: float = 1e-6,
    atol: float = 1e-8,
    first_step: float | None = None,
    max_steps: int = 100_000,
    dense: bool = False,
    u: torch.Tensor | None = None,
) -> Solution:
    """Solve the second-order ``field`` (``SecondOrder(dim, order=2)``) from ``y0 = (x_0, v_0)``, ``(batch,
    2 dim)``, over ``t`` (default ``[0, field.T]``). Returns the library's :class:`~cde_nets.Solution`: ``y`` the
    state at ``t[-1]``, ``ts``/``ys`` the states at ``t`` when ``t`` is given, ``stats`` (evaluations of ``f``,
    accepted and rejected steps) and, with ``dense=True`` (``dprkn6``), ``solution.evaluate(t)`` anywhere in the
    span. ``step_size`` gives fixed steps; without it ``dprkn6`` chooses its steps for ``rtol``/``atol``.
    Gradients flow through the steps (autograd; in adaptive mode with the step sizes held fixed)."""
    rtol = check_positive("rtol", rtol, "Typical values: 1e-3 (training) to 1e-10 (reference solutions).")
    atol = check_positive("atol", atol, "Typical values: 1e-4 (training) to 1e-12 (reference solutions).")
    bound = BoundField(field, u)
    ts = torch.tensor([0.0, float(getattr(field, "T", 1.0))], dtype=torch.float64) if t is None else t
    ts = torch.as_tensor(ts, dtype=torch.float64)
    stats = SolverStats()
    ys, interp = integrate_nystrom(
        bound,
        y0,
        ts,
        method=method,
        step_size=step_size,
        rtol=rtol,
        atol=atol,
        first_step=first_step,
        max_steps=max_steps,
        stats=stats,
        dense=dense,
    )
    return Solution(
        y=ys[-1],
        ts=None if t is None else ts,
        ys=None if t is None else ys,
        stats=stats,
        interpolant=interp if dense else None,
    )
