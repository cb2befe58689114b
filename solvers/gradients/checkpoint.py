"""Checkpointed replay of the accepted steps (Zhuang et al. 2020, "Adaptive checkpoint adjoint method")."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import torch
from torch import nn

from ..counting import Counted
from ..grids import negated_time_options
from ..options import OWN_FIXED_METHODS, REVERSIBLE_METHODS
from ..steppers.tableaux import TABLEAUX
from .base import GradientMethod, Run
from .replay import StepBack, checkpoint_step, replay_gradient
from .step_sizes import check_steps

__all__ = ["Checkpoint"]


@dataclass(frozen=True, repr=False)
class Checkpoint(GradientMethod):
    """Keep the state at the start of every accepted step; the backward pass recomputes each step from it and
    backpropagates through that step alone (:mod:`solvers.gradients.replay`). Exact for the solver's map, memory of one
    state per step plus one step's stages. Needs the method's tableau (:data:`~solvers.steppers.tableaux.TABLEAUX`).

    ``steps`` (:mod:`~solvers.gradients.step_sizes`): as :class:`~solvers.gradients.Backprop`'s; with
    ``"differentiated"`` (the default) the rejected attempts are kept too (their sizes, no states), since each shapes
    the next step size."""

    steps: str = "differentiated"

    name = "checkpoint"
    sweep: ClassVar[str | None] = "checkpoint"
    step_back: ClassVar[StepBack] = staticmethod(checkpoint_step)

    def __post_init__(self) -> None:
        check_steps(self.steps)

    def describe(self) -> str:
        return self.name if self.steps == "differentiated" else f"{self.name} ({self.steps} steps)"

    def supports(self, method: str) -> bool:
        if method in OWN_FIXED_METHODS:
            return super().supports(method)
        return method in TABLEAUX and TABLEAUX[method].continuous

    def refusal(self, method: str) -> str:
        if method in REVERSIBLE_METHODS or method in OWN_FIXED_METHODS:
            return super().refusal(method)
        replayable = sorted(m for m, tab in TABLEAUX.items() if tab.continuous)
        what = "a multistep method" if method.endswith("adams") else "not a Runge-Kutta method of this library's"
        return (
            f"gradient={self.name!r} replays the solver's steps with its Runge-Kutta tableau; method={method!r} "
            f"has none ({what}). Use one of {replayable}, or gradient='backprop'/'adjoint' with {method!r}."
        )

    def solve(self, run: Run) -> torch.Tensor:
        if len(run.t) > 1 and float(run.t[0]) > float(run.t[-1]):
            run = backwards_in_time(run)
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
            steps=self.steps,
        )


class _Reversed(nn.Module):
    """``func`` in the time ``s = −t``: ``dy/ds = −func(−s, y)``. The recorder, the statistics and the step
    callbacks are the wrapped counter's (they see ``s``, in which the replay then runs forwards)."""

    def __init__(self, inner: Counted):
        super().__init__()
        self.inner = inner

    def __call__(self, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -self.inner(-s, y)

    @property
    def recorder(self) -> Any:
        return self.inner.recorder

    @recorder.setter
    def recorder(self, rec: Any) -> None:
        self.inner.recorder = rec

    @property
    def stats(self) -> Any:
        return self.inner.stats

    def callback_step(self, s0, y0, ds) -> None:
        self.inner.callback_step(s0, y0, ds)

    def callback_accept_step(self, s0, y0, ds) -> None:
        getattr(self.inner, "callback_accept_step", lambda *a: None)(s0, y0, ds)

    def callback_reject_step(self, s0, y0, ds) -> None:
        getattr(self.inner, "callback_reject_step", lambda *a: None)(s0, y0, ds)


def backwards_in_time(run: Run) -> Run:
    """A solve over decreasing times as the forwards solve in ``s = −t`` (as torchdiffeq runs it): the field,
    the times and the options that hold times (``jump_t``, ``step_t``, the grid) negated. The replay's steps are
    then read forwards, ``s_0 + c_i h``; the field still sees the true times."""
    options = negated_time_options(run.options)
    jump_t = None if run.jump_t is None else -run.jump_t
    grid_t = None if run.grid is None else -run.grid.flip(0)
    func = cast(Counted, _Reversed(run.func))
    return replace(run, func=func, t=-run.t, options=options, jump_t=jump_t, grid=grid_t)
