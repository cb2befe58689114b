r"""Continuous mode with the standard projection onto invariants after each step: :func:`solve_projected`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cde_nets.blocks.solution import Solution
from cde_nets.fields.bound import BoundField
from cde_nets.solvers.counting import SolverStats
from cde_nets.solvers.schemes import Scheme
from cde_nets.solvers.steppers.projection import Projection
from cde_nets.solvers.steppers.projection_ode import integrate_projected

__all__ = ["solve_projected"]


def solve_projected(
    field: torch.nn.Module,
    y0: torch.Tensor,
    t: Sequence[float] | torch.Tensor | None = None,
    *,
    method: str | Scheme,
    projection: Projection,
    step_size: float,
    gradient: str = "backprop",
    max_steps: int = 100_000,
    u: torch.Tensor | None = None,
) -> Solution:
    """Solve ``field`` from ``y0`` with the one-step ``method`` (a scheme name: ``rk4``, ``gl4``, ``verlet``,
    ``mcate5``, ``nystrom4``, …) in fixed steps of at most ``step_size`` over ``t`` (default ``[0, field.T]``), each
    step followed by ``projection`` (Hairer, Lubich & Wanner 2006, §IV.4): the invariants keep their initial values
    to rounding, the method keeps its order, a symplectic method loses its symplecticity. Returns the library's
    :class:`~cde_nets.Solution`; gradients are exact for the projected map: ``"backprop"`` reaches every tensor
    the field and the invariants read, ``"checkpoint"`` (one state per step stored, each step recomputed in
    backward) the field's parameters and ``y0``."""
    ts = torch.tensor([0.0, float(getattr(field, "T", 1.0))], dtype=torch.float64) if t is None else t
    ts = torch.as_tensor(ts, dtype=torch.float64)
    stats = SolverStats()
    ys = integrate_projected(
        BoundField(field, u),
        y0,
        ts,
        method=method,
        projection=projection,
        step_size=step_size,
        gradient=gradient,
        max_steps=max_steps,
        stats=stats,
    )
    return Solution(y=ys[-1], ts=None if t is None else ts, ys=None if t is None else ys, stats=stats)
