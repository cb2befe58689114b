"""One solve: the field wrapped for counting (:mod:`solvers.counting`), the gradient method's own solve
(:mod:`solvers.gradients`), and torchdiffeq's bare assertions turned into errors that say what to try."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .counting import SolverStats, counted
from .engine import solve
from .errors import Reason, SolverError
from .gradients import GradientMethod
from .gradients.piecewise_adjoint import PiecewiseParam
from .grids import jump_options
from .options import ADAPTIVE_METHODS, REVERSIBLE_METHODS, SolverOptions
from .precision import autocast_field
from .run import Run

__all__ = ["integrate"]


def integrate(
    field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    solver: SolverOptions,
    gradient: GradientMethod,
    params: Sequence[torch.Tensor] | None = None,
    pieces: Sequence[PiecewiseParam] | None = None,
    jump_t: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    stats: SolverStats | None = None,
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``y' = field(t, y)`` at times ``t`` (float64, increasing) as ``solver`` says, with ``gradient``'s
    backward pass.

    ``params``: the tensors the backward pass differentiates (parameters, and any other tensor the field closes
    over, e.g. a block input ``u``); ``pieces``: those of them constant on pieces of time
    (:class:`~solvers.gradients.piecewise_adjoint.PiecewiseParam`). ``jump_t`` (adaptive methods) lists the times where
    the field jumps; ``grid`` (fixed-step methods) is the step grid, which should contain those times.

    Returns the solution at ``t``, ``(len(t), *y0.shape)``, and the call's :class:`SolverStats` (``stats`` if
    given: the backward pass adds its counts there later). ``norm`` (adaptive methods) replaces the RMS error norm
    of the forward solve. ``solver.autocast`` evaluates the field in low precision (:mod:`solvers.precision`).
    """
    stats = SolverStats() if stats is None else stats
    # alf counts its own steps through the adaptive callbacks, on a fixed grid too
    adaptive = solver.method in ADAPTIVE_METHODS or solver.method in REVERSIBLE_METHODS
    field = autocast_field(field, getattr(solver, "autocast", None))  # beneath the counting: every method sees it
    func = counted(field, stats, solver.max_steps, adaptive=adaptive, count_vjp=gradient.counts_vjp)
    options = {**solver.options, **jump_options(solver.method, jump_t, grid)}
    if norm is not None and adaptive:
        options["norm"] = norm
    if solver.stepper_controller is not None:
        options["controller"] = solver.stepper_controller
    run = Run(func, y0, t, solver, options, tuple(params or ()), tuple(pieces or ()), jump_t, grid)
    try:
        ys = solve(run, gradient)
    except AssertionError as exc:
        if exc is func.field_error:
            raise
        raise _solver_error(exc, stats) from None
    func.backward_phase = True
    return ys, stats


def _solver_error(exc: AssertionError, stats: SolverStats) -> SolverError:
    """torchdiffeq's bare assertion in the forward solve, as an error that names a fix."""
    nfe = stats.nfe_forward
    if "non-finite" in str(exc):  # torchdiffeq's own message: the only way to tell its assertions apart
        return SolverError(
            f"the state became non-finite (NaN/inf) in the forward solve after {nfe} field evaluations; "
            "lower the learning rate, tighten the tolerance, or check the inputs.",
            nfe=nfe,
            reason=Reason.NONFINITE,
        )
    return SolverError(
        f"torchdiffeq stopped after {nfe} field evaluations: {str(exc)[:200]}. "
        "Loosen `rtol`/`atol`, raise `max_steps`, or use float64.",
        nfe=nfe,
    )
