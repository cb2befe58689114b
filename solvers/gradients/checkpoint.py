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
from .binomial import check_budget
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
    the next step size.

    ``budget``: keep at most ``k`` step-start states (``None``, the default: every step's). The forward solve
    decides online, without knowing how many steps it will take, which states to keep (Stumm & Walther 2010,
    "New algorithms for optimal online checkpointing", SIAM J. Sci. Comput. 32(2)); the backward pass rebuilds
    the others by advancing from a kept one, reusing the slots it frees along Griewank's binomial schedule
    (Griewank 1992; Griewank & Walther 2000, "Algorithm 799: revolve", ACM TOMS 26). For ``n`` steps the fewest
    recomputed steps are ``t(n + 1, k) − n``, ``t(l, s) = r l − β(s + 1, r − 1)``, ``β(s, r) = C(s + r, s)``,
    ``r`` the least with ``l ≤ β(s, r)``: ``n(n − 1)/2`` for ``k = 1``, ``O(n log n)`` for ``k ~ log n``, none
    for ``k ≥ n`` (:mod:`solvers.gradients.binomial`; the online placement reaches it for ``n ≤ β(k, 2)``). The
    gradient is the same, up to rounding of the recomputed states; the solve's ``stats`` report the most states
    kept at once (``stored_states``) and the steps recomputed (``recomputed_steps``). The fixed-step sweeps of
    the implicit and composition methods keep every step's state and refuse a budget."""

    steps: str = "differentiated"
    budget: int | None = None

    name = "checkpoint"
    sweep: ClassVar[str | None] = "checkpoint"
    step_back: ClassVar[StepBack] = staticmethod(checkpoint_step)

    def __post_init__(self) -> None:
        check_steps(self.steps)
        if self.budget is not None:
            check_budget(self.budget)

    def describe(self) -> str:
        name = self.name if self.steps == "differentiated" else f"{self.name} ({self.steps} steps)"
        return name if self.budget is None else f"{name}, budget {self.budget}"

    def supports(self, method: str) -> bool:
        if method in OWN_FIXED_METHODS:
            return self.budget is None and super().supports(method)
        return method in TABLEAUX and TABLEAUX[method].continuous

    def refusal(self, method: str) -> str:
        if self.budget is not None and method in OWN_FIXED_METHODS and super().supports(method):
            return (
                f"gradient={type(self).__name__}(budget={self.budget}) recomputes the steps of the explicit "
                f"Runge-Kutta methods; method={method!r} sweeps its fixed grid keeping every step's state. Use "
                f"budget=None with {method!r}, or an explicit method (e.g. 'dopri5', 'rk4') with the budget."
            )
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
            budget=self.budget,
        )


class _InReversedTime:
    """A recorder behind :class:`_Reversed`: the counter it listens to sees ``func(−s, y)``, the solve in ``s``
    uses its negation, and the recorded slopes (the stages a dense output or a carried first stage is built
    from) must be the solve's."""

    def __init__(self, rec: Any) -> None:
        object.__setattr__(self, "rec", rec)

    def evaluated(self, out: torch.Tensor | None = None) -> None:
        self.rec.evaluated(None if out is None else -out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.rec, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.rec, name, value)


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
        rec = self.inner.recorder
        return rec.rec if isinstance(rec, _InReversedTime) else rec

    @recorder.setter
    def recorder(self, rec: Any) -> None:
        self.inner.recorder = None if rec is None else _InReversedTime(rec)

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
