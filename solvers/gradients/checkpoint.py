"""Checkpointed replay of the accepted steps (Zhuang et al. 2020, "Adaptive checkpoint adjoint method")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..options import OWN_FIXED_METHODS, REVERSIBLE_METHODS
from ..replay import StepBack, checkpoint_step, replay_gradient
from ..tableaux import TABLEAUX
from .base import GradientMethod, Run

__all__ = ["Checkpoint"]


@dataclass(frozen=True, repr=False)
class Checkpoint(GradientMethod):
    """Keep the state at the start of every accepted step; the backward pass recomputes each step from it and
    backpropagates through that step alone (:mod:`solvers.replay`). Exact for the solver's map, memory of one
    state per step plus one step's stages. Needs the method's tableau (:data:`~solvers.tableaux.TABLEAUX`)."""

    name = "checkpoint"
    sweep: ClassVar[str | None] = "checkpoint"
    step_back: ClassVar[StepBack] = staticmethod(checkpoint_step)

    def supports(self, method: str) -> bool:
        if method in OWN_FIXED_METHODS:
            return super().supports(method)
        return method in TABLEAUX and TABLEAUX[method].continuous

    def refusal(self, method: str) -> str:
        if method in REVERSIBLE_METHODS or method in OWN_FIXED_METHODS:
            return super().refusal(method)
        replayable = sorted(m for m, tab in TABLEAUX.items() if tab.continuous)
        return (
            f"gradient={self.name!r} replays the solver's steps with its tableau; method={method!r} has none here "
            f"(it reuses a stage that is not at the step's end, or is not transcribed). Use one of "
            f"{replayable}, or gradient='backprop'/'adjoint' with {method!r}."
        )

    def solve(self, run: Run) -> torch.Tensor:
        s = run.solver
        return replay_gradient(
            run.func,
            run.y0,
            run.t,
            run.params,
            run.pieces,
            gradient=self.name,
            step_back=self.step_back,
            tableau=TABLEAUX[s.method],
            method=s.method,
            rtol=s.rtol,
            atol=s.atol,
            options=run.options,
            stats=run.stats,
        )
