r"""The implicit Runge-Kutta methods (:mod:`solvers.steppers.implicit_tableaux`) with torchdiffeq's fixed-grid
semantics, for the torchdiffeq-compatible functions (:mod:`cde_nets.functional`).

torchdiffeq's fixed-step solvers step on a grid (``step_size``: ``t_0 + k h``, the last point moved onto ``t_N``;
or ``grid_constructor(func, y0, t)``; else the output times themselves) and read the outputs off each step by
linear interpolation (``interp="linear"``) or by the cubic Hermite interpolant through ``y_0, F(t_0, y_0), y_1,
F(t_1, y_1)`` (``"cubic"``); ``perturb=True`` moves every evaluation at a step's end one ulp inside the step (in
the state's dtype), so that a field with a jump at a grid point never sees the far side. This module keeps those
semantics and takes each step with :func:`solvers.steppers.implicit.implicit_step`: the stage equations solved by
Newton's method to rounding (``max_iters``, ``newton``, ``newton_tol``), and gradients by the implicit function theorem
(Hairer & Wanner 1996, "Solving Ordinary Differential Equations II", §IV.8). The state is one sample: the stage
Jacobian is that of the whole (flattened) state, as torchdiffeq's, which assumes no batch structure. Each step starts
its iteration from ``Z_i = h c_i F(t_0, y_0)``, so the field is evaluated at every grid point, as torchdiffeq's
steps do and its test suite checks (``perturb=False``); starting from the previous step's stages
(:mod:`solvers.steppers.implicit_predictor`, as the engine's implicit solves do) would save 10-15 % of the evaluations.

Gradients: ``backprop`` differentiates the steps; ``checkpoint`` keeps the grid states and re-runs each step
backwards for its vector-Jacobian product; ``reversible`` (the symmetric methods) keeps only the last state and
rebuilds each step's start by the step with ``−h`` from its end (exact to the Newton tolerance,
``Φ_{−h} = Φ_h^{−1}``, Hairer, Lubich & Wanner 2006, Thm. V.2.3), memory constant in the number of steps;
``adjoint`` (torchdiffeq's ``odeint_adjoint``) is that backsolve for every method, within the local error per step
for the non-symmetric ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import Reason, SolverError
from ..gradients.second_order import IMPLICIT_FIX, first_order, remember_inputs
from .implicit import Newton, implicit_step
from .implicit_tableaux import IMPLICIT_TABLEAUX

__all__ = ["IMPLICIT_GRID_GRADIENTS", "IMPLICIT_GRID_OPTIONS", "ImplicitGrid", "implicit_until_event"]

IMPLICIT_GRID_OPTIONS = frozenset({"step_size", "grid_constructor", "perturb", "interp", "max_iters", "newton"})
IMPLICIT_GRID_OPTIONS |= {"newton_tol", "max_num_steps"}
IMPLICIT_GRID_GRADIENTS = ("backprop", "checkpoint", "adjoint", "reversible")
_MAX_EVENT_STEPS = 1_000_000


class ImplicitGrid:
    """One implicit method, its options and the field ``func(t, y)`` (the drop-in's flat, forwards problem, which
    forwards torchdiffeq's ``callback_step``)."""

    def __init__(self, func: Any, method: str, options: dict):
        self.func, self.tab = func, IMPLICIT_TABLEAUX[method]
        self.perturb = bool(options.get("perturb", False))
        self.interp = options.get("interp", "linear")
        if self.interp not in ("linear", "cubic"):
            raise ValueError(f"`options['interp']` must be 'linear' or 'cubic', got {self.interp!r}.")
        try:
            kind, iters, tol = (
                options.get("newton", "auto"),
                options.get("max_iters", 50),
                options.get("newton_tol"),
            )
            self.newton = Newton(kind, iters, tol)
        except ValueError as exc:
            raise ValueError(f"options 'newton', 'max_iters', 'newton_tol' of {method!r}: {exc}") from None
        step, construct = options.get("step_size"), options.get("grid_constructor")
        if step is not None and construct is not None:
            raise ValueError("`step_size` and `grid_constructor` are exclusive options: pass one.")
        self.step_size, self.construct = step, construct

    def grid(self, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """torchdiffeq's grid over ``[t_0, t_N]``; it must start and end on the output times' ends."""
        if self.step_size is not None:
            n = int(math.ceil(float((t[-1] - t[0]) / self.step_size) + 1))
            grid = torch.arange(n, dtype=t.dtype, device=t.device) * self.step_size + t[0]
            grid[-1] = t[-1]
            return grid
        if self.construct is None:
            return t
        grid = torch.as_tensor(self.construct(self.func, y0, t)).to(t)
        if grid.dim() != 1 or bool(grid[0] != t[0]) or bool(grid[-1] != t[-1]):
            raise ValueError("`grid_constructor` must return a 1-D grid from t[0] to t[-1] (both included).")
        return grid

    def field(self, t: float, y: torch.Tensor) -> torch.Tensor:
        return self.func(torch.tensor(t, dtype=_real(y), device=y.device), y)

    def step(self, t0: float, t1: float, y: torch.Tensor) -> torch.Tensor:
        """The step from ``(t0, y)`` to ``t1`` (either direction), differentiable by the implicit function
        theorem. With ``perturb``, an evaluation at ``t0`` or ``t1`` happens one ulp inside the step."""
        shape = y.shape

        def fun(t: float, x: torch.Tensor) -> torch.Tensor:
            tt = torch.tensor(t, dtype=_real(x), device=x.device)
            if self.perturb and t in (t0, t1):
                tt = torch.nextafter(tt, torch.tensor(t1 if t == t0 else t0, dtype=tt.dtype, device=tt.device))
            return self.func(tt, x.reshape(shape)).reshape(1, -1)

        h = t1 - t0
        times = [t0 if c == 0.0 else t1 if c == 1.0 else t0 + c * h for c in self.tab.c]
        y1, _ = implicit_step(fun, t0, y.reshape(1, -1), h, self.tab, self.newton, times)
        return y1.reshape(shape)

    def start_slope(self, t0: float, t1: float, y: torch.Tensor) -> torch.Tensor | None:
        if self.interp != "cubic":
            return None
        tt = torch.tensor(t0, dtype=_real(y), device=y.device)
        if self.perturb:
            tt = torch.nextafter(tt, torch.tensor(t1, dtype=tt.dtype, device=tt.device))
        return self.func(tt, y)

    def read(self, t0: float, t1: float, y0, y1, f0, tj: float) -> torch.Tensor:
        """The output at ``tj`` in ``[t0, t1]``: torchdiffeq's linear or cubic Hermite interpolant."""
        if self.interp == "linear":
            if tj == t0:
                return y0
            if tj == t1:
                return y1
            return y0 + (tj - t0) / (t1 - t0) * (y1 - y0)
        f1 = self.field(t1, y1)
        s, dt = (tj - t0) / (t1 - t0), t1 - t0
        h00, h10 = (1 + 2 * s) * (1 - s) ** 2, s * (1 - s) ** 2
        h01, h11 = s * s * (3 - 2 * s), s * s * (s - 1)
        return h00 * y0 + h10 * dt * f0 + h01 * y1 + h11 * dt * f1

    def solve(self, y0: torch.Tensor, t: torch.Tensor, gradient: str, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The states at the increasing times ``t``, ``(len(t), *y0.shape)``."""
        if gradient not in IMPLICIT_GRID_GRADIENTS:
            raise ValueError(
                f"the implicit methods take gradient={IMPLICIT_GRID_GRADIENTS} (their steps differentiated by the "
                f"implicit function theorem); got {gradient!r}."
            )
        grid = [float(v) for v in self.grid(y0, t).tolist()]
        if gradient == "backprop":
            return torch.stack(self._forward(y0, grid, [float(v) for v in t.tolist()])[0])
        leaves = tuple(p for p in params if p.requires_grad)
        return _Sweep.apply(self, grid, [float(v) for v in t.tolist()], gradient, y0, *leaves)

    def _forward(self, y0: torch.Tensor, grid: list[float], t: list[float], keep: bool = False):
        """Step over the grid: the outputs, the step that read each, and every grid state (``keep``) or the last."""
        out, where, states, y, j = [y0], [-1], [y0], y0, 1
        for k in range(len(grid) - 1):
            t0, t1 = grid[k], grid[k + 1]
            _callback(self.func, "callback_step", t0, y, t1 - t0)
            y1 = self.step(t0, t1, y)
            f0 = self.start_slope(t0, t1, y) if j < len(t) and t1 >= t[j] else None
            while j < len(t) and t1 >= t[j]:
                out.append(self.read(t0, t1, y, y1, f0, t[j]))
                where.append(k)
                j += 1
            y = y1
            if keep:
                states.append(y)
        return out, where, states if keep else [y]


def _real(y: torch.Tensor) -> torch.dtype:
    return y.real.dtype if y.is_complex() else y.dtype


def _callback(func: Any, name: str, t0: float, y: torch.Tensor | tuple[torch.Tensor, ...], dt: float) -> None:
    cb = getattr(func, name, None)
    if cb is not None:
        ref = y if isinstance(y, torch.Tensor) else y[0]
        dtype, device = _real(ref), ref.device
        cb(torch.tensor(t0, dtype=dtype, device=device), y, torch.tensor(dt, dtype=dtype, device=device))


class _Sweep(torch.autograd.Function):
    """The grid solve without a graph; backward walks the steps in reverse, re-running each from its stored
    (checkpoint) or rebuilt (adjoint) start, with the outputs read in it, for their vector-Jacobian product."""

    @staticmethod
    def forward(ctx, grid_solver, grid, t, gradient, y0, *params):
        remember_inputs(ctx, y0, *params)
        ctx.gradient, rebuild = gradient, gradient in ("adjoint", "reversible")
        with torch.no_grad():
            out, where, states = grid_solver._forward(y0, grid, t, keep=not rebuild)
        ctx.solver, ctx.grid, ctx.t, ctx.where, ctx.rebuild, ctx.params = grid_solver, grid, t, where, rebuild, params
        ctx.states = states
        return torch.stack(out)

    @staticmethod
    @first_order(lambda ctx: ctx.gradient, fix=IMPLICIT_FIX)
    def backward(ctx, g_out):
        solver, grid, t, where, params = ctx.solver, ctx.grid, ctx.t, ctx.where, ctx.params
        g_params: list[torch.Tensor | None] = [None] * len(params)
        a = torch.zeros_like(g_out[0])
        y = ctx.states[-1]
        for k in range(len(grid) - 2, -1, -1):
            t0, t1 = grid[k], grid[k + 1]
            _callback(solver.func, "callback_step_adjoint", t1, (y, a), t0 - t1)
            with torch.no_grad():
                y = solver.step(t1, t0, y) if ctx.rebuild else ctx.states[k]
            js = [j for j, w in enumerate(where) if w == k]
            with torch.enable_grad():
                x = y.detach().requires_grad_(True)
                y1 = solver.step(t0, t1, x)
                f0 = solver.start_slope(t0, t1, x) if js else None
                outs = [y1, *(solver.read(t0, t1, x, y1, f0, t[j]) for j in js)]
                cots = [a, *(g_out[j] for j in js)]
                grads = torch.autograd.grad(outs, (x, *params), cots, allow_unused=True)
            a = grads[0] if grads[0] is not None else torch.zeros_like(a)
            for i, gp in enumerate(grads[1:]):
                prev = g_params[i]
                if gp is not None:
                    g_params[i] = gp if prev is None else prev + gp
        return (None, None, None, None, a + g_out[0], *g_params)


def implicit_until_event(
    grid_solver: ImplicitGrid, y0: torch.Tensor, t0: float, event_fn: Callable, atol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchdiffeq's fixed-step event search (no graph): steps of ``step_size`` from ``t0`` until ``event_fn``
    changes sign, then bisection of the step's interpolant down to ``atol`` in time. ``(event_t, [y0, y_event])``."""
    h = grid_solver.step_size
    if h is None:
        raise ValueError("an event with an implicit (fixed-step) method needs `options['step_size']`.")
    dtype = _real(y0)

    def g(t: float, y: torch.Tensor) -> torch.Tensor:
        return event_fn(torch.tensor(t, dtype=dtype, device=y0.device), y)

    with torch.no_grad():
        sign0, y = torch.sign(g(t0, y0)), y0
        for _ in range(_MAX_EVENT_STEPS):
            t1 = t0 + float(h)
            _callback(grid_solver.func, "callback_step", t0, y, t1 - t0)
            y1 = grid_solver.step(t0, t1, y)
            if bool(torch.sign(g(t1, y1)) != sign0):
                f0 = grid_solver.start_slope(t0, t1, y)
                lo, hi = t0, t1
                for _ in range(max(0, math.ceil(math.log2((t1 - t0) / atol)))):
                    mid = (lo + hi) / 2
                    same = bool(torch.sign(g(mid, grid_solver.read(t0, t1, y, y1, f0, mid))) == sign0)
                    lo, hi = (mid, hi) if same else (lo, mid)
                te = (lo + hi) / 2
                found = torch.stack([y0, grid_solver.read(t0, t1, y, y1, f0, te)])
                return torch.tensor(te, dtype=dtype, device=y0.device), found
            t0, y = t1, y1
    raise SolverError(
        f"no event in {_MAX_EVENT_STEPS} steps of {h}; check `event_fn` or the step size.", reason=Reason.MAX_STEPS
    )
