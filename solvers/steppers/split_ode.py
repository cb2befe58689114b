r"""Continuous mode with the symplectic compositions of :mod:`solvers.schemes.composition` (Yoshida's triple jumps of
Störmer-Verlet) and the splitting methods of :mod:`solvers.steppers.splitting_tableaux` on a fixed grid, for separable
fields (``p'`` from ``q`` alone, ``q'`` from ``p`` alone).

A step ``[t_0, t_1]`` inside piece ``l`` of a piecewise field is one layer of the discrete scheme with
``h = t_1 − t_0`` (:meth:`~solvers.schemes.Scheme.step`), so continuous and discrete mode share one formula. Gradient
methods: ``"backprop"``; ``"checkpoint"`` (states stored, each step recomputed in backward); ``"reversible"``
or ``"adjoint"`` (the same here: states rebuilt backwards by the composition's exact inverse, memory constant in
the number of steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..schemes import get_scheme
from .implicit_ode import sweep
from .splitting_tableaux import SPLITTING_ORDERS

__all__ = ["SPLIT_METHODS", "SPLIT_GRADIENTS", "integrate_split"]

SPLIT_METHODS: dict[str, int] = {"yoshida4": 4, "yoshida6": 6, **SPLITTING_ORDERS}
SPLIT_GRADIENTS = ("backprop", "checkpoint", "adjoint", "reversible")


class _SchemeStepper:
    def __init__(self, field: Any, method: str, stats: Any):
        grid = getattr(field, "grid", None)
        if grid is None or not getattr(field, "separable", False):
            name = type(getattr(field, "field", field)).__name__
            raise ValueError(
                f"method={method!r} composes explicit half steps p ← p + h F_p(q), q ← q + h F_q(p), which is "
                f"symplectic and of order {SPLIT_METHODS[method]} only on a separable field; {name} is not one. "
                "Use Hamiltonian(K='blockdiag'), MS1 or MS3, or an implicit method (method='gl4') for any field."
            )
        scheme = get_scheme(method).for_field(field)
        self.grid: Any = grid
        self.field, self.scheme, self.stats, self.backward = field, scheme, stats, False

    def _piece(self, t0: float, t1: float) -> int:
        return self.grid.index(0.5 * (t0 + t1))

    def step(self, t0: float, t1: float, y: torch.Tensor) -> torch.Tensor:
        l, sch = self._piece(t0, t1), self.scheme
        out = sch.readout(sch.step(self.field, l, sch.init(y), t1 - t0, None, t0))
        if self.stats is not None:
            if self.backward:
                self.stats.nfe_backward += sch.evaluations(l)
            else:
                self.stats.nfe_forward += sch.evaluations(l)
                self.stats.steps_forward += 1
        return out

    def rebuild(self, t0: float, t1: float, y1: torch.Tensor) -> torch.Tensor:
        l, sch = self._piece(t0, t1), self.scheme
        if self.stats is not None:
            self.stats.nfe_backward += sch.evaluations(l)
        return sch.readout(sch.inverse(self.field, l, sch.init(y1), t1 - t0, None, t0))


def integrate_split(
    field: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    gradient: str = "backprop",
    params: Sequence[torch.Tensor] | None = None,
    grid: torch.Tensor | None = None,
    max_steps: int = 100_000,
    stats: Any = None,
) -> torch.Tensor:
    """Solve the separable ``field`` with the composition ``method`` on ``grid`` (plus ``t``): states at ``t``."""
    if gradient not in SPLIT_GRADIENTS:
        raise ValueError(f"method={method!r} takes gradient={SPLIT_GRADIENTS}; got {gradient!r}.")
    return sweep(_SchemeStepper(field, method, stats), y0, t, grid, gradient, params, max_steps)
