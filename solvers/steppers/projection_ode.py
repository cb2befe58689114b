r"""Continuous mode with a projection onto invariants after each step: any one-step scheme (``rk4``, ``gl4``,
``verlet``, the splitting methods, ``nystrom4``, …) on a fixed grid, each step followed by the standard projection
of :mod:`solvers.steppers.projection` (Hairer, Lubich & Wanner 2006, §IV.4).

A step ``[t_0, t_1]`` inside piece ``l`` of a piecewise field is one layer of the projected scheme
(:class:`~solvers.schemes.projected.Projected`) with ``h = t_1 − t_0``, so continuous and discrete mode share one
formula. Gradients: ``"backprop"`` (every step recorded) or ``"checkpoint"`` (states stored, each step recomputed in
backward); both exact for the projected map (the projection's own derivative by the implicit function theorem).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..schemes.base import Scheme
from ..schemes.projected import Projected
from .implicit_ode import sweep
from .projection import Projection

__all__ = ["PROJECTION_GRADIENTS", "integrate_projected"]

PROJECTION_GRADIENTS = ("backprop", "checkpoint")


class _ProjectedStepper:
    def __init__(self, field: Any, scheme: Projected, stats: Any):
        self.field, self.scheme, self.stats = field, scheme.for_field(field), stats
        self.grid = getattr(field, "grid", None)

    def step(self, t0: float, t1: float, y: torch.Tensor) -> torch.Tensor:
        l = 0 if self.grid is None else self.grid.index(0.5 * (t0 + t1))
        sch = self.scheme
        out = sch.readout(sch.step(self.field, l, sch.init(y), t1 - t0, None, t0))
        sch.end_pass()
        if self.stats is not None:
            self.stats.nfe_forward += sch.evaluations(l)
            self.stats.steps_forward += 1
        return out


def integrate_projected(
    field: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str | Scheme,
    projection: Projection,
    step_size: float,
    gradient: str = "backprop",
    max_steps: int = 100_000,
    stats: Any = None,
) -> torch.Tensor:
    """Solve ``field`` from ``y0`` with ``method`` in steps of at most ``step_size`` (each parameter piece and each
    interval between the times ``t`` in equal steps), projecting after every step: the states at ``t``."""
    if gradient not in PROJECTION_GRADIENTS:
        raise ValueError(f"a projected solve takes gradient={PROJECTION_GRADIENTS}; got {gradient!r}.")
    if not (isinstance(step_size, (int, float)) and math.isfinite(step_size) and step_size > 0):
        raise ValueError(
            f"`step_size` must be a finite number > 0 (a projected solve takes fixed steps); got {step_size!r}."
        )
    stepper = _ProjectedStepper(field, Projected(method, projection), stats)
    tt = [float(x) for x in t.tolist()]
    grid = stepper.grid
    marks = sorted(set(tt) | set(() if grid is None else (float(x) for x in grid.jumps.tolist() if tt[0] < x < tt[-1])))
    pts = [marks[0]]
    for a, b in zip(marks, marks[1:]):
        m = max(1, math.ceil((b - a) / step_size - 1e-9))
        pts += [a + (b - a) * k / m for k in range(1, m)] + [b]
    params = [p for p in getattr(getattr(field, "field", field), "parameters", lambda: [])() if p.requires_grad]
    return sweep(stepper, y0, t, torch.tensor(pts, dtype=torch.float64), gradient, params, max_steps)
