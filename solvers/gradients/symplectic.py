"""The symplectic adjoint (Matsubara, Miyatake & Yaguchi 2021, "Symplectic adjoint method for exact gradient of
neural ODE with minimal memory")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..options import IMPLICIT_METHODS, SPLIT_METHODS
from ..steppers.implicit import get_tableau
from .checkpoint import Checkpoint
from .implicit_adjoint import pairs_with_partner
from .replay import StepBack, symplectic_step

__all__ = ["Symplectic"]


@dataclass(frozen=True, repr=False)
class Symplectic(Checkpoint):
    """Replay each accepted step's stages and integrate the adjoint with the partitioned Runge-Kutta method paired
    with the forward tableau, so ``λᵀ δy`` is conserved exactly: the gradient of the solver's map, with memory of
    one state per step and one stage at a time (:mod:`solvers.gradients.replay`; for the implicit methods, whose stages
    are re-solved without a graph, :mod:`solvers.gradients.implicit_adjoint`)."""

    name = "symplectic"
    sweep = "symplectic"  # the implicit Runge-Kutta methods; the compositions have no partner scheme here
    step_back: ClassVar[StepBack] = staticmethod(symplectic_step)

    def supports(self, method: str) -> bool:
        if method in SPLIT_METHODS:
            return False
        if method in IMPLICIT_METHODS:
            return self.budget is None and pairs_with_partner(get_tableau(method))
        return super().supports(method)

    def refusal(self, method: str) -> str:
        if method in SPLIT_METHODS:
            return (
                f"gradient='symplectic' pairs a Runge-Kutta tableau with its symplectic partner; method={method!r} "
                "is a symplectic composition of Störmer-Verlet steps, which has none here. Use "
                "gradient='reversible' or 'adjoint' (states rebuilt by its exact inverse, constant memory), or "
                "'checkpoint'."
            )
        return super().refusal(method)
