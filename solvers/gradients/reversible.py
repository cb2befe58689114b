"""The reversible gradient of the asynchronous leapfrog integrator (MALI, Zhuang et al. 2021)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import IMPLICIT_METHODS, REVERSIBLE_METHODS, REVERSIBLE_RK_METHODS, SPLIT_METHODS
from ..steppers.alf import integrate_alf
from ..steppers.implicit import get_tableau
from .base import GradientMethod, Run

__all__ = ["Reversible"]


@dataclass(frozen=True, repr=False)
class Reversible(GradientMethod):
    """States rebuilt backwards by the integrator's exact inverse: the gradient of the integrator's map in memory
    constant in the number of steps. Needs a method whose step is exactly invertible: ``alf`` (MALI, Zhuang et al.
    2021; :mod:`solvers.steppers.alf`), the reversible Runge-Kutta methods ``reversible_<base>`` (McCallum & Foster
    2024; :mod:`solvers.steppers.reversible_rk`, stepped by the engine), the symplectic compositions (each substep a
    shear, undone by its negative), and
    the symmetric implicit Runge-Kutta methods (``Φ_{−h} = Φ_h^{−1}``, Hairer, Lubich & Wanner 2006, Thm. V.2.3: the
    step with ``−h`` from a step's end rebuilds its start to the Newton tolerance)."""

    name = "reversible"
    sweep = "reversible"

    def supports(self, method: str) -> bool:
        if method in IMPLICIT_METHODS:
            return get_tableau(method).symmetric
        return method in REVERSIBLE_METHODS or method in SPLIT_METHODS

    def refusal(self, method: str) -> str:
        symmetric = sorted(m for m in IMPLICIT_METHODS if get_tableau(m).symmetric)
        return (
            f"gradient='reversible' rebuilds states with an exactly invertible step: method='alf', a reversible "
            f"Runge-Kutta method {sorted(REVERSIBLE_RK_METHODS)}, a symplectic "
            f"composition, or a symmetric implicit method {symmetric} (not {method!r}); use gradient='checkpoint' "
            f"for an exact gradient of {method!r}."
        )

    def solve(self, run: Run) -> torch.Tensor:
        return integrate_alf(
            run.func,
            run.y0,
            run.t,
            solver=run.solver,
            reversible=True,
            params=run.params,
            pieces=run.pieces,
            jump_t=run.jump_t,
            grid=run.grid,
        )
