"""Continuous mode: a field integrated over ``[0, T]`` by torchdiffeq (Chen et al. 2018, "Neural ordinary
differential equations")."""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn

from cde_nets.solvers.adapter import (
    FIXED_METHODS,
    PiecewiseParam,
    SolverStats,
    aligned_grid,
    check_gradient,
    check_method,
    check_options,
    integrate,
    is_adaptive,
    validate_tolerances,
)
from cde_nets.solvers.errors import SolverError, check_positive
from cde_nets.solvers.stopping import integrate_until_converged

from .block import Block
from .fields.bound import BoundField
from .nonfinite import Watch, check_result, nonfinite_parameter
from .pieces import gathered, piece_modules
from .solution import Solution
from .stop import Stop, as_stop

__all__ = ["ODEBlock"]

# Each stopping window is a solve of its own; far more windows than this cost minutes and gigabytes (a window
# of 1e-5 on [0, 1] took 114 s and 1.5 GB for a batch of 8) while checking convergence no more usefully.
_MAX_WINDOWS = 1000


def _piecewise(field: nn.Module) -> list[PiecewiseParam]:
    """The field's trainable pieces, for the adjoint to differentiate one piece at a time."""
    return [PiecewiseParam(p.data, p.grid.boundaries.tolist(), p.grid.index, partial(object.__setattr__, p, "_unbound"))
            for p in piece_modules(field)]


def _empty(bound: BoundField, y0: torch.Tensor, T: float, t, stats: SolverStats, stopping: bool) -> Solution:
    """The solution for a batch of no samples: ``y0`` itself, joined to the field's graph by one evaluation."""
    y = y0 + 0 * bound(torch.zeros((), dtype=torch.float64), y0)
    ts = None if t is None else Block.check_times(t, T, y0.device)
    ys = None if ts is None else y.unsqueeze(0).expand(len(ts), *y.shape)
    times = y0.new_full((0,), T, dtype=torch.float64) if stopping else None
    return Solution(y=y, ts=ts, ys=ys, stats=stats, stop_times=times)


class ODEBlock(Block):
    r"""``y(T) = y(0) + ∫_0^T F(t, y) dt`` for a field ``F``: a :class:`~cde_nets.fields.base.Field` or any
    ``nn.Module`` with ``forward(t, y)``.

    Args:
        field: the vector field (its parameters are the block's parameters).
        T: end time; defaults to ``field.T`` (must equal it when the field is time-varying; required for a
            plain module).
        method: a torchdiffeq method — adaptive (``dopri5``, ``dopri8``, ``bosh3``, ``fehlberg2``,
            ``adaptive_heun``) or fixed-step (``euler``, ``midpoint``, ``heun2``, ``heun3``, ``rk4``), or ``alf``
            (asynchronous leapfrog, :mod:`~cde_nets.solvers.alf`: adaptive, or fixed with ``step_size``).
        rtol, atol: tolerances of adaptive methods (default 1e-6, 1e-8); refused for fixed-step methods.
        gradient: ``"adjoint"`` (continuous adjoint, O(1) memory in the steps; seminorm by default),
            ``"backprop"`` (differentiate through the solver's steps: the discrete adjoint of the solver), or the
            exact gradient of the solver's steps at low memory: ``"checkpoint"`` (replay each step from a stored
            state), ``"symplectic"`` (the symplectic adjoint over the replayed stages), ``"reversible"``
            (``method="alf"``: states rebuilt by the integrator's inverse, constant memory). See
            ``docs/guides/gradients.md``.
        step_size: fixed-step methods only; default one step per parameter piece (the discrete-mode grid). The
            grid always contains every piece boundary.
        jumps: adaptive methods only (default True): tell the solver where time-varying parameters jump
            (torchdiffeq's ``jump_t``).
        max_steps: steps allowed per solve before :class:`~cde_nets.solvers.errors.SolverError`.
        options: further torchdiffeq options (unknown keys raise).
        adjoint_method, adjoint_rtol, adjoint_atol, seminorm: settings of the adjoint's backward solve
            (``gradient="adjoint"`` only).
        stop: a :class:`~cde_nets.stop.Stop` (``Stop(eps, window=T/20)``): pattern-dependent stopping time —
            each sample stops once ``‖F(t, y)‖ < eps`` (checked every ``window``); finished samples leave the
            batch. Calling the block still returns a tensor; :meth:`solve` also gives ``stop_times``.

    Calling the block returns ``y(T)``; :meth:`solve` returns a :class:`~cde_nets.solution.Solution` (states at
    requested times, statistics, stopping times). :attr:`stats` holds the counts of the last call:
    ``nfe_forward``, ``nfe_backward`` (filled in by ``backward()``), accepted (``steps_*``) and rejected
    (``rejected_*``) steps of the forward and backward solves.
    """

    def __init__(
        self,
        field: nn.Module,
        T: float | None = None,
        method: str = "dopri5",
        rtol: float | None = None,
        atol: float | None = None,
        gradient: str = "adjoint",
        step_size: float | None = None,
        jumps: bool | None = None,
        max_steps: int = 100_000,
        options: dict | None = None,
        adjoint_method: str | None = None,
        adjoint_rtol: float | None = None,
        adjoint_atol: float | None = None,
        seminorm: bool | None = None,
        stop: Stop | dict | None = None,
    ):
        super().__init__(field, T)
        self.method = check_method(method)
        adaptive = is_adaptive(method, step_size)
        self.options = check_options(method, options)
        if not adaptive and (rtol is not None or atol is not None):
            raise ValueError(f"`rtol`/`atol` control adaptive methods; the fixed-step {method!r} would ignore them. "
                             "Drop them (set the step with `step_size`), or use an adaptive method such as 'dopri5'.")
        self.rtol, self.atol = validate_tolerances(1e-6 if rtol is None else rtol, 1e-8 if atol is None else atol)
        self.gradient = check_gradient(method, gradient)
        if step_size is not None:
            if adaptive:
                raise ValueError(
                    f"`step_size` applies to fixed-step methods {sorted(FIXED_METHODS)}, not {method!r}; "
                    "use `rtol`/`atol` (or options={'first_step': ...}) for adaptive methods."
                )
            check_positive("step_size", step_size, "It is the largest fixed step; it must be > 0.")
        self.step_size = step_size
        if jumps is not None and not adaptive:
            raise ValueError(f"`jumps` tells adaptive solvers where the parameters jump; the fixed-step {method!r} "
                             "always steps on every piece boundary. Drop `jumps`.")
        self.jumps = True if jumps is None else bool(jumps)
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f"`max_steps` must be a positive integer, got {max_steps!r}.")
        self.max_steps = max_steps
        if step_size is not None:
            n = sum(max(1, math.ceil((b - a) / step_size - 1e-9)) for a, b in self._pieces())
            if n > max_steps:  # refuse before the grid is built: a tiny step would allocate gigabytes first
                raise ValueError(f"`step_size`={step_size:g} takes {n} steps over [0, {self.T:g}], more than "
                                 f"max_steps={max_steps}; use a larger `step_size` or raise `max_steps`.")
        adjoint_set = [n for n, v in (("adjoint_method", adjoint_method), ("adjoint_rtol", adjoint_rtol),
                                      ("adjoint_atol", adjoint_atol), ("seminorm", seminorm)) if v is not None]
        if adjoint_set and gradient != "adjoint":
            raise ValueError(f"{', '.join(f'`{n}`' for n in adjoint_set)} set(s) the adjoint's backward solve; "
                             f"gradient={gradient!r} has none. Drop them, or use gradient='adjoint'.")
        if adjoint_method is not None:
            check_method(adjoint_method, "adjoint_method")
        self.adjoint_method = adjoint_method
        self.adjoint_rtol = None if adjoint_rtol is None else check_positive("adjoint_rtol", adjoint_rtol)
        self.adjoint_atol = None if adjoint_atol is None else check_positive("adjoint_atol", adjoint_atol)
        self.seminorm = True if seminorm is None else bool(seminorm)
        self.stop = as_stop(stop, "continuous")
        if self.stop is not None and self.stop.window is not None and self.T / self.stop.window > _MAX_WINDOWS:
            raise ValueError(
                f"`stop.window`={self.stop.window:g} makes {math.ceil(self.T / self.stop.window)} windows over "
                f"[0, {self.T:g}], each a solve of its own (with the adjoint, each keeps its own backward graph); "
                f"use window >= T/{_MAX_WINDOWS} = {self.T / _MAX_WINDOWS:g}."
            )
        self._stats = SolverStats()

    @property
    def stats(self) -> dict[str, int]:
        """Counts of the last call (``nfe_backward`` is filled in when its backward pass runs)."""
        return self._stats.as_dict()

    def _bounds(self) -> list[float]:
        """Piece boundaries over [0, T]; a field of one piece (or none) spans the block's own T, which may differ
        from the field's."""
        grid = getattr(self.field, "grid", None)
        return grid.boundaries.tolist() if grid is not None and grid.L > 1 else [0.0, self.T]

    def _pieces(self) -> list[tuple[float, float]]:
        bounds = self._bounds()
        return list(zip(bounds[:-1], bounds[1:]))

    def _grids(self, field: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        grid = getattr(field, "grid", None)
        bounds = self._bounds()
        if not is_adaptive(self.method, self.step_size):
            return None, aligned_grid(bounds, self.step_size)
        jump_t = grid.jumps if (grid is not None and self.jumps) else None
        return jump_t, None

    # torchdiffeq's and torchsde's step loops are data-dependent control flow with host synchronisation on every
    # step: under torch.compile the solve runs eagerly and everything around it is compiled (under inductor
    # the adaptive loop failed outright with a view+inplace error).
    @torch.compiler.disable
    def solve(self, y0: torch.Tensor, u: torch.Tensor | None = None, t=None) -> Solution:
        """Solve from ``y0`` (``(batch, *state_shape)``; ``u``: the block input of a field with ``needs_input``).

        ``t``: times at which to save the state (increasing, within ``[0, T]``); the result's ``ys`` is
        ``(len(t), *y0.shape)``. Fixed-step methods step *through* every requested time (each is added to the
        step grid, so the values are the scheme's own, not interpolated): times finer than ``step_size`` mean
        more, shorter steps. To see the ``n``-step solution, ask for times on its grid.
        """
        bound = self.bind(y0, u)
        self._stats = SolverStats()
        if y0.shape[0] == 0:  # an empty shard (data-parallel): nothing to solve, but every parameter in the graph
            return _empty(bound, y0, self.T, t, self._stats, self.stop is not None)
        if self.stop is not None:
            if t is not None:
                raise ValueError("`t` and `stop` do not combine: each sample stops at its own time. Drop `t`, "
                                 "or build the block without `stop` to save a trajectory.")
            with self._gathered():
                y, times = self._solve_stopping(bound, y0)
            return Solution(y=y, stats=self._stats, stop_times=times)
        if t is None:
            times = torch.tensor([0.0, self.T], dtype=torch.float64, device=y0.device)
            return Solution(y=self._solve(bound, y0, times)[-1], stats=self._stats)
        tt = self.check_times(t, self.T, y0.device)
        start = float(tt[0]) > 0.0
        if start:  # integrate from 0 to the first requested time as well
            tt = torch.cat([tt.new_zeros(1), tt])
        ys = self._solve(bound, y0, tt)
        if start:
            ys, tt = ys[1:], tt[1:]
        return Solution(y=ys[-1], ts=tt, ys=ys, stats=self._stats)

    def _gathered(self):
        """Backprop differentiates through every field call: pieces gathered once per call, as in discrete mode.
        The adjoint's backward solve runs after the call returns, so it must not see the call's views."""
        return gathered(self.field) if self.gradient == "backprop" else nullcontext()

    def _params(self, bound: BoundField) -> list[torch.Tensor]:
        """What the adjoint differentiates: the field's trainable parameters and the call's input ``u``."""
        params = [p for p in self.field.parameters() if p.requires_grad]
        if bound.u is not None and bound.u.requires_grad:
            params.append(bound.u)
        return params

    def _integrate(self, bound: BoundField, y0: torch.Tensor, t: torch.Tensor, jump_t, grid) -> torch.Tensor:
        try:
            ys, _ = integrate(
                bound, y0, t, method=self.method, rtol=self.rtol, atol=self.atol, gradient=self.gradient,
                params=self._params(bound), jump_t=jump_t, grid=grid, options=self.options,
                max_steps=self.max_steps, seminorm=self.seminorm, adjoint_method=self.adjoint_method,
                adjoint_rtol=self.adjoint_rtol, adjoint_atol=self.adjoint_atol, stats=self._stats,
                pieces=_piecewise(self.field),
            )
        except SolverError as exc:
            # NaN in a parameter or the field makes adaptive steps fail until they underflow: say what it was
            if nonfinite_parameter(self.field) is not None or "underflow" in str(exc):
                reason = self._nonfinite(bound, y0, t, jump_t, grid)
                if reason is not None:
                    raise SolverError(reason, nfe=exc.nfe) from exc
            raise
        check_result(ys[-1], lambda: self._nonfinite(bound, y0, t, jump_t, grid) or "the solve returned NaN/inf.")
        return ys

    def _nonfinite(self, bound: BoundField, y0: torch.Tensor, t: torch.Tensor, jump_t, grid) -> str | None:
        """Why the solve from ``y0`` went non-finite, or ``None`` if the field stays finite along it."""
        name = nonfinite_parameter(self.field)
        if name is not None:
            return (f"parameter `{name}` holds NaN/inf, so the solve is non-finite; restore the last good checkpoint "
                    "(a diverged optimiser step?) or re-initialise it.")
        watch = Watch(bound)
        with torch.no_grad():
            try:
                integrate(watch, y0.detach(), t, method=self.method, rtol=self.rtol, atol=self.atol,
                          gradient="backprop", jump_t=jump_t, grid=grid, options=self.options,
                          max_steps=self.max_steps)
            except SolverError:
                pass
        if watch.t is None:
            return None
        grid_ = getattr(self.field, "grid", None)
        piece = f" (piece {grid_.index(watch.t)} of {grid_.L})" if grid_ is not None and grid_.L > 1 else ""
        return (f"the state became non-finite (NaN/inf) in the forward solve: the field first returned a "
                f"non-finite value at t={watch.t:.6g}{piece}, evaluation {watch.evaluations}. The solution blows "
                "up there: use smaller steps (`step_size`, or an adaptive method), shrink the weights or inputs, "
                "or use float64.")

    def _solve_stopping(self, bound: BoundField, y0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        jump_t, grid = self._grids(self.field)
        rows: dict = {}

        def bound_rows(idx: torch.Tensor) -> BoundField:
            # the stopping loop passes the same idx tensor until the batch shrinks: gather u once per compaction
            if rows.get("idx") is not idx:
                rows.update(idx=idx, bound=bound.rows(idx))
            return rows["bound"]

        def solve(y, t0, t1, idx):
            t = torch.tensor([t0, t1], dtype=torch.float64, device=y.device)
            g = None if grid is None else grid[(grid >= t0) & (grid <= t1)]
            return self._integrate(bound_rows(idx), y, t, jump_t, g)[-1]

        def field(t, y, idx):
            return bound_rows(idx)(t, y)

        return integrate_until_converged(solve, field, y0, t_max=self.T, window=self.stop.window or self.T / 20,
                                         eps=self.stop.eps)

    def _solve(self, bound: BoundField, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        jump_t, grid = self._grids(self.field)
        with self._gathered():
            return self._integrate(bound, y0, t, jump_t, grid)

    def extra_repr(self) -> str:
        return f"T={self.T}, method={self.method!r}, rtol={self.rtol}, atol={self.atol}, gradient={self.gradient!r}"
