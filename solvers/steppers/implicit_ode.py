r"""Continuous mode with the implicit Runge-Kutta methods of :mod:`solvers.steppers.implicit_tableaux` on a fixed grid.

Gradient methods (each exact for the integrator's map, the linear algebra of a step by the implicit function
theorem, :mod:`solvers.steppers.implicit`):

- ``"backprop"``: every step recorded, its stages' graph and converged stages kept; memory ``O(steps)``.
- ``"checkpoint"``: the forward keeps the state at every grid point (no graph); backward re-solves each step and
  takes its vector-Jacobian product. Memory: one state per step.
- ``"reversible"`` (the symmetric methods ``implicit_midpoint``, ``trapezoid``, ``gl4``, ``gl6``:
  ``Φ_{−h} = Φ_h^{−1}``, Hairer, Lubich & Wanner 2006, Thm. V.2.3): the forward keeps only the output states;
  backward rebuilds each step's start by the step with ``−h`` from its end and takes the step's vector-Jacobian
  product there. The rebuilt states are the forward's up to the Newton tolerance, so the gradient equals
  ``"checkpoint"``'s to rounding in memory constant in the number of steps.
- ``"adjoint"``: the same rebuild for every method, the backsolve adjoint of the steps (as the continuous adjoint
  rebuilds the state by a backward solve): memory flat, the gradient exact for the symmetric methods and within
  the local error per step for the others.
- ``"symplectic"``: the forward keeps the state at every grid point (no graph); backward re-solves each step's
  stages without a graph and integrates the adjoint system with the symplectic partner of the method (the method
  itself for ``implicit_midpoint``, ``gl4``, ``gl6``), one evaluation's graph at a time
  (:mod:`solvers.gradients.implicit_adjoint`). Exact for the integrator's map; memory one state per step.

Each step after the first starts its stage iteration from the previous step's collocation polynomial, corrected by
the last steps' prediction errors along equal steps on one parameter piece (:mod:`solvers.steppers.implicit_predictor`),
and under ``Newton("auto")`` a solve whose fixed point once failed to contract keeps simplified Newton for its
later steps, reusing its factored matrix while it contracts fast
(:class:`~solvers.steppers.implicit_linear.Carry`).

Stage times at a step's ends are moved one ulp inside the step (as torchdiffeq's ``perturb``), so a step that ends
on a parameter jump of a piecewise field never evaluates the next piece.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from ..gradients.implicit_adjoint import symplectic_adjoint_step
from ..gradients.second_order import IMPLICIT_FIX, first_order, remember_inputs
from .implicit import Newton, get_tableau, implicit_step, in_backward
from .implicit_predictor import StagePredictor
from .implicit_tableaux import IMPLICIT_TABLEAUX, ImplicitTableau

__all__ = [
    "IMPLICIT_METHODS",
    "IMPLICIT_GRADIENTS",
    "IMPLICIT_OPTIONS",
    "integrate_implicit",
    "newton_options",
    "sweep",
]

IMPLICIT_METHODS: dict[str, int] = {name: tab.order for name, tab in IMPLICIT_TABLEAUX.items()}
IMPLICIT_GRADIENTS = ("backprop", "checkpoint", "adjoint", "reversible", "symplectic")
IMPLICIT_OPTIONS = {"newton", "max_iters", "newton_tol"}


def newton_options(options: dict | None) -> Newton:
    """The :class:`~solvers.steppers.implicit.Newton` of an ``options`` dict (``newton``: ``"auto"``, ``"simplified"``,
    ``"full"`` or ``"fixed_point"``; ``max_iters``, ``newton_tol``)."""
    options = options or {}
    return Newton(
        kind=options.get("newton", "auto"),
        max_iters=options.get("max_iters", 50),
        tol=options.get("newton_tol"),
    )


def _stage_times(tab: ImplicitTableau, t0: float, t1: float) -> list[float]:
    h = t1 - t0
    out = []
    for c in tab.c:
        if c == 0.0:
            out.append(math.nextafter(t0, t1))
        elif c == 1.0:
            out.append(math.nextafter(t1, t0))
        else:
            out.append(t0 + c * h)
    return out


class _Counter:
    """The field as ``fun(t: float, y)``, counting evaluations into ``stats`` (forward or backward phase)."""

    def __init__(self, field: Any, stats: Any):
        self.field, self.stats, self.backward = field, stats, False

    def __call__(self, t: float, y: torch.Tensor) -> torch.Tensor:
        out = self.field(torch.tensor(t, dtype=y.dtype, device=y.device), y)
        self.count(1)
        return out

    def count(self, k: int) -> None:
        if self.stats is not None:
            if self.backward or in_backward():
                self.stats.nfe_backward += k
            else:
                self.stats.nfe_forward += k

    def piece(self, times: list[float]) -> int | None:
        """The parameter piece of a piecewise cde_nets field that the step's first stage time lies on (``None``
        for other fields)."""
        grid = getattr(getattr(self.field, "field", None), "grid", None)
        return None if grid is None else grid.index(min(times))

    def shares_time(self, times: list[float]) -> bool:
        """Whether the field is the same at all ``times`` (one step's stages) and takes no input: a cde_nets field
        (not a plain module, which may read the time) whose times all lie on one parameter piece."""
        bound = self.field
        inner = getattr(bound, "field", None)
        grid = getattr(inner, "grid", None)
        if getattr(bound, "stage_times", True) or getattr(bound, "u", None) is not None or grid is None:
            return False
        return grid.index(min(times)) == grid.index(max(times))


def _points(t: torch.Tensor, grid: torch.Tensor | None) -> tuple[list[float], list[int]]:
    """The step points (the grid cut to the span of ``t``, plus ``t``, in ``t``'s direction) and the index of each
    requested time among them."""
    tt = [float(v) for v in t.tolist()]
    lo, hi = min(tt[0], tt[-1]), max(tt[0], tt[-1])
    g = [] if grid is None else [float(v) for v in grid.tolist() if lo <= float(v) <= hi]
    pts = sorted(set(g) | set(tt), reverse=tt[0] > tt[-1])
    return pts, [pts.index(v) for v in tt]


class _ImplicitStepper:
    """Steps of an implicit tableau; the rebuild of a step's start is the step with ``−h`` from its end."""

    def __init__(self, fun: _Counter, tab: ImplicitTableau, newton: Newton, stats: Any):
        self.fun, self.tab, self.newton, self.stats = fun, tab, newton, stats
        self.predictor = StagePredictor()

    def step(self, t0: float, t1: float, y: torch.Tensor) -> torch.Tensor:
        times, h = _stage_times(self.tab, t0, t1), t1 - t0
        info: dict = {}
        guess = self.predictor.guess(self.tab, y, h, piece=self.fun.piece(times))
        batched = self.fun.shares_time(times)
        carry = self.predictor.carry(y)
        y1, _ = implicit_step(self.fun, t0, y, h, self.tab, self.newton, times, batched, info, guess, carry)
        self.predictor.record(y1, h, info["stages"], info["kind"])
        if info["kind"] == "simplified" and self.newton.kind == "auto":
            # the fixed point failed to contract: stiff here, so the later steps of this solve start with Newton
            self.newton = replace(self.newton, kind="simplified")
        if self.stats is not None and not self.fun.backward:
            self.stats.steps_forward += 1
        return y1

    def rebuild(self, t0: float, t1: float, y1: torch.Tensor) -> torch.Tensor:
        return self.step(t1, t0, y1)

    def step_back(
        self, t0: float, t1: float, y: torch.Tensor, lam: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The cotangent of the step's start and of ``params`` from ``lam``, that of its end, by the symplectic
        adjoint."""
        times = _stage_times(self.tab, t0, t1)
        batched = self.fun.shares_time(times)
        return symplectic_adjoint_step(self.fun, t0, times, y, t1 - t0, self.tab, self.newton, lam, params, batched)


def integrate_implicit(
    field: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str,
    gradient: str = "backprop",
    params: Sequence[torch.Tensor] | None = None,
    grid: torch.Tensor | None = None,
    options: dict | None = None,
    max_steps: int = 100_000,
    stats: Any = None,
) -> torch.Tensor:
    """Solve ``y' = field(t, y)`` with the implicit ``method`` stepping on ``grid`` (plus the times ``t``); the
    states at ``t``, ``(len(t), *y0.shape)``. ``params``: the tensors ``field`` closes over that get gradients
    with ``"checkpoint"``/``"reversible"``/``"symplectic"`` (``"backprop"`` reaches every tensor by autograd)."""
    if gradient not in IMPLICIT_GRADIENTS:
        raise ValueError(
            f"method={method!r} (implicit Runge-Kutta) takes gradient={IMPLICIT_GRADIENTS}; got {gradient!r}."
        )
    stepper = _ImplicitStepper(_Counter(field, stats), get_tableau(method), newton_options(options), stats)
    return sweep(stepper, y0, t, grid, gradient, params, max_steps)


def sweep(
    stepper: Any,
    y0: torch.Tensor,
    t: torch.Tensor,
    grid: torch.Tensor | None,
    gradient: str,
    params: Sequence[torch.Tensor] | None,
    max_steps: int,
) -> torch.Tensor:
    """Fixed steps of ``stepper`` (``step(t0, t1, y)``; ``rebuild(t0, t1, y1)``: the start from the end;
    ``step_back(t0, t1, y, λ, params)``: the symplectic adjoint of a step) over the grid and ``t``; ``gradient``:
    ``"backprop"``, ``"checkpoint"`` (states stored), ``"symplectic"`` (states stored, adjoint by
    ``step_back``) or ``"reversible"`` (states rebuilt backwards)."""
    pts, where = _points(t, grid)
    if len(pts) - 1 > max_steps:
        raise ValueError(f"{len(pts) - 1} steps exceed max_steps={max_steps}; raise `max_steps` or the step size.")
    if gradient == "backprop":
        y, ys = y0, [y0] if where[0] == 0 else []
        for k in range(len(pts) - 1):
            y = stepper.step(pts[k], pts[k + 1], y)
            if k + 1 in where:
                ys.extend([y] * where.count(k + 1))
        return torch.stack(ys)
    leaves = tuple(p for p in (params or ()) if isinstance(p, torch.Tensor) and p.requires_grad)
    return _Sweep.apply(stepper, pts, where, gradient, y0, *leaves)


def _sweep_fix(ctx: Any) -> str:
    if isinstance(ctx.stepper, _ImplicitStepper):
        return IMPLICIT_FIX
    return "Use gradient='backprop' (autograd differentiates the composition's steps, to any order)."


class _Sweep(torch.autograd.Function):
    """The whole fixed-step solve without a graph; backward walks the steps in reverse, re-running each from its
    stored (``checkpoint``) or rebuilt start and taking its vector-Jacobian product."""

    @staticmethod
    def forward(ctx, stepper, pts, where, gradient, y0, *params):
        remember_inputs(ctx, y0, *params)
        ctx.gradient = gradient
        rebuild = gradient in ("adjoint", "reversible")
        with torch.no_grad():
            y, states, ys = y0, [y0], [y0] if where[0] == 0 else []
            for k in range(len(pts) - 1):
                y = stepper.step(pts[k], pts[k + 1], y)
                if not rebuild:
                    states.append(y)
                if k + 1 in where:
                    ys.extend([y] * where.count(k + 1))
        ctx.stepper, ctx.pts, ctx.where, ctx.rebuild = stepper, pts, where, rebuild
        ctx.symplectic = gradient == "symplectic"
        ctx.states = [y] if rebuild else states
        ctx.params = params
        return torch.stack(ys)

    @staticmethod
    @first_order(lambda ctx: ctx.gradient, fix=_sweep_fix)
    def backward(ctx, g_ys):
        stepper, pts, where = ctx.stepper, ctx.pts, ctx.where
        phase = getattr(stepper, "fun", stepper)  # what counts evaluations: backward ones from here on
        phase.backward = True
        params = ctx.params
        g_params: list[torch.Tensor | None] = [None] * len(params)
        a = torch.zeros_like(g_ys[0])
        y = ctx.states[-1]
        for k in range(len(pts) - 1, 0, -1):
            for i, w in enumerate(where):
                if w == k:
                    a = a + g_ys[i]
            with torch.no_grad():
                y = stepper.rebuild(pts[k - 1], pts[k], y) if ctx.rebuild else ctx.states[k - 1]
            if ctx.symplectic:
                a, g_step = stepper.step_back(pts[k - 1], pts[k], y, a, params)
                grads = (a, *g_step)
            else:
                with torch.enable_grad():
                    x = y.detach().requires_grad_(True)
                    y1 = stepper.step(pts[k - 1], pts[k], x)
                    grads = torch.autograd.grad(y1, (x, *params), a, allow_unused=True)
            a = grads[0] if grads[0] is not None else torch.zeros_like(a)
            for i, gp in enumerate(grads[1:]):
                prev = g_params[i]
                if gp is not None:
                    g_params[i] = gp if prev is None else prev + gp
            if stepper.stats is not None:
                stepper.stats.steps_backward += 1
        for i, w in enumerate(where):
            if w == 0:
                a = a + g_ys[i]
        phase.backward = False
        return (None,) * 4 + (a, *g_params)
