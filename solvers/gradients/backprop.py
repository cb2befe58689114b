"""Backpropagation through the solver's operations: the discrete adjoint of the steps taken."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..alf import integrate_alf
from ..options import REVERSIBLE_METHODS
from ..torchdiffeq_methods import torchdiffeq_method
from .base import GradientMethod, Run

__all__ = ["Backprop"]


@dataclass(frozen=True, repr=False)
class Backprop(GradientMethod):
    """Differentiate through every operation of the forward solve (memory grows with the steps taken); exact for
    the solver's map. Serves every method, and the SDE block."""

    name = "backprop"
    sweep = "backprop"
    forward_graph = True
    counts_vjp = True
    sde = True

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
        from torchdiffeq import odeint  # here, not at import: torchdiffeq loads scipy

        method = torchdiffeq_method(s.method)
        return odeint(run.func, run.y0, run.t, rtol=s.rtol, atol=s.atol, method=method, options=run.options)
