"""Backpropagation through the solver's operations: the discrete adjoint of the steps taken."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..options import REVERSIBLE_METHODS
from ..steppers.alf import integrate_alf
from ..steppers.rk_odeint import odeint_rk
from .base import GradientMethod, Run
from .step_sizes import check_steps

__all__ = ["Backprop"]


@dataclass(frozen=True, repr=False)
class Backprop(GradientMethod):
    """Differentiate through every operation of the forward solve (memory grows with the steps taken); exact for
    the solver's map. Serves every method, and the SDE block.

    ``steps`` (:mod:`~solvers.gradients.step_sizes`): an adaptive method's step sizes are functions of the state through
    its error estimate and controller, and differentiated as such (``"differentiated"``, the default: the
    derivative of what was computed); ``"fixed"`` holds them constant, ``"torchdiffeq"`` differentiates the first
    only, as torchdiffeq's backprop does (its gradients bit for bit on the shared step)."""

    steps: str = "differentiated"

    name = "backprop"
    sweep = "backprop"
    forward_graph = True
    counts_vjp = True
    sde = True

    def __post_init__(self) -> None:
        check_steps(self.steps)

    def describe(self) -> str:
        return self.name if self.steps == "differentiated" else f"{self.name} ({self.steps} steps)"

    def supports(self, method: str) -> bool:
        return True

    def solve(self, run: Run) -> torch.Tensor:
        s = run.solver
        if s.method in REVERSIBLE_METHODS:
            return integrate_alf(
                run.func,
                run.y0,
                run.t,
                solver=s,
                reversible=False,
                params=run.params,
                pieces=run.pieces,
                jump_t=run.jump_t,
                grid=run.grid,
            )
        opts = run.options
        return odeint_rk(
            run.func, run.y0, run.t, rtol=s.rtol, atol=s.atol, method=s.method, options=opts, steps=self.steps
        )
