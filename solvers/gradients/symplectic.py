"""The symplectic adjoint (Matsubara, Miyatake & Yaguchi 2021, "Symplectic adjoint method for exact gradient of
neural ODE with minimal memory")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..replay import StepBack, symplectic_step
from .checkpoint import Checkpoint

__all__ = ["Symplectic"]


@dataclass(frozen=True, repr=False)
class Symplectic(Checkpoint):
    """Replay each accepted step's stages and integrate the adjoint with the partitioned Runge-Kutta method paired
    with the forward tableau, so ``λᵀ δy`` is conserved exactly: the gradient of the solver's map, with memory of
    one state per step and one stage at a time (:mod:`solvers.replay`)."""

    name = "symplectic"
    sweep = None  # the implicit and composition methods have no partner scheme here
    step_back: ClassVar[StepBack] = staticmethod(symplectic_step)
