"""The reversible gradient of the asynchronous leapfrog integrator (MALI, Zhuang et al. 2021)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..alf import integrate_alf
from ..options import REVERSIBLE_METHODS, SPLIT_METHODS
from .base import GradientMethod, Run

__all__ = ["Reversible"]


@dataclass(frozen=True, repr=False)
class Reversible(GradientMethod):
    """States rebuilt backwards by the integrator's exact inverse (:mod:`solvers.alf`): the gradient of the
    integrator's map in memory constant in the number of steps. Needs an invertible method (``alf``)."""

    name = "reversible"
    sweep = "reversible"  # the symplectic compositions are exactly invertible too

    def supports(self, method: str) -> bool:
        return method in REVERSIBLE_METHODS or method in SPLIT_METHODS

    def refusal(self, method: str) -> str:
        return (
            f"gradient='reversible' reconstructs states with an invertible integrator: use "
            f"method='alf' (not {method!r}), or gradient='checkpoint' for an exact gradient of "
            f"{method!r}."
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
