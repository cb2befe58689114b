"""Continuous mode: a field integrated over ``[0, T]`` by torchdiffeq (Chen et al. 2018, "Neural ordinary
differential equations"), with per-sample events, end times and stopping (:mod:`cde_nets.solvers.events`)."""

from __future__ import annotations

import math
from collections.abc import Callable
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
from cde_nets.solvers.events import HermiteDense, integrate_events

from .block import Block
from .fields.base import Field
from .fields.bound import BoundField
from .nonfinite import Watch, check_result, nonfinite_parameter
from .pieces import gathered, piece_modules
from .solution import Solution
from .stop import Stop, as_stop

__all__ = ["ODEBlock"]

# The event loop (solvers.events) solves segments of about this many solver steps, each asked for its state at
# _SUBPOINTS times: g's sign is checked about twice per step, and a finished sample waits at most one segment.
_SEGMENT_STEPS = 4
_SUBPOINTS = 8

EventFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _piecewise(field: nn.Module) -> list[PiecewiseParam]:
    """The field's trainable pieces, for the adjoint to differentiate one piece at a time."""
    return [
        PiecewiseParam(p.data, p.grid.boundaries.tolist(), p.grid.index, partial(object.__setattr__, p, "_unbound"))
        for p in piece_modules(field)
    ]


def _empty(bound: BoundField, y0: torch.Tensor, T: float, t, stats: SolverStats, stopping: bool) -> Solution:
    """The solution for a batch of no samples: ``y0`` itself, joined to the field's graph by one evaluation."""
    y = y0 + 0 * bound(torch.zeros((), dtype=torch.float64), y0)
    ts = None if t is None else _check_times(t, T, y0.device)
    ys = None if ts is None else y.unsqueeze(0).expand(len(ts), *y.shape)
    times = y0.new_full((0,), T, dtype=torch.float64) if stopping else None
    fired = y0.new_zeros((0,), dtype=torch.bool) if stopping else None
    return Solution(y=y, ts=ts, ys=ys, stats=stats, stop_times=times, fired=fired)


def _check_times(t, T: float, device: torch.device | None) -> torch.Tensor:
    """Output times: strictly increasing (``y0`` at 0) or strictly decreasing (``y0`` at ``T``) within [0, T]."""
    try:
        tt = t.detach().double() if isinstance(t, torch.Tensor) else torch.as_tensor(t, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise TypeError(f"`t` must be a 1-D sequence of times, got {type(t).__name__}.") from exc
    if tt.dim() != 1 or len(tt) < 2 or not (bool((tt[1:] > tt[:-1]).all()) or bool((tt[1:] < tt[:-1]).all())):
        raise ValueError(
            "`t` must be a 1-D strictly monotone sequence of at least two times: increasing (from "
            "y0 at time 0) or decreasing (from y0 at time T, backwards)."
        )
    if bool((tt[1:] < tt[:-1]).all()):
        return Block.check_times(tt.flip(0), T, device).flip(0)
    return Block.check_times(tt, T, device)


def _field_at(bound: BoundField, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``F(t_i, y_i)`` at per-row times ``t`` ``(n,)`` (fields take one time per call). A :class:`Field` with the
    inherited ``forward`` depends on time only through its piece, so rows are grouped by piece; any other module
    is called once per distinct time. A 0-d ``t``, or one time for all rows, is a single call."""
    if t.dim() == 0 or t.numel() == 0 or bool((t == t[0]).all()):
        return bound(t if t.dim() == 0 else t[0], y)
    field = bound.field
    if isinstance(field, Field) and type(field).forward is Field.forward:
        keys = torch.tensor([field.grid.index(float(v)) for v in t.tolist()], device=t.device)
    else:
        keys = torch.unique(t, return_inverse=True)[1]
    out: torch.Tensor | None = None
    for k in torch.unique(keys).tolist():
        sel = (keys == k).nonzero().squeeze(1)
        part = bound.rows(sel)(t[sel[0]], y[sel])
        out = part.new_zeros((t.shape[0], *part.shape[1:])) if out is None else out
        out = out.index_put((sel,), part)
    assert out is not None
    return out


class ODEBlock(Block):
    r"""``y(T) = y(0) + ∫_0^T F(t, y) dt`` for a field ``F``: a :class:`~cde_nets.fields.base.Field` or any
    ``nn.Module`` with ``forward(t, y)``.

    Args:
        field: the vector field (its parameters are the block's parameters).
        T: end time; defaults to ``field.T`` (must equal it when the field is time-varying; required for a
            plain module).
        method: a torchdiffeq method — adaptive (``dopri5``, ``dopri8``, ``bosh3``, ``fehlberg2``,
            ``adaptive_heun``) or fixed-step (``euler``, ``midpoint``, ``heun2``, ``heun3``, ``rk4``), or ``alf``
            (asynchronous leapfrog, :mod:`~cde_nets.solvers.alf`: adaptive, or fixed with ``step_size``), or
            fixed-step implicit Runge-Kutta (``implicit_midpoint``, ``gl4``, ``gl6``: symplectic; ``trapezoid``,
            ``radauIIA3``, ``radauIIA5``, ``sdirk2``, ``trbdf2``, ``implicit_euler``: for stiff fields;
            :mod:`~cde_nets.solvers.implicit`, gradients ``backprop``/``checkpoint``/``adjoint``) or Yoshida's
            symplectic compositions for separable fields (``yoshida4``, ``yoshida6``); see
            ``docs/guides/symplectic.md``.
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
        stop: a :class:`~cde_nets.stop.Stop` (``Stop(eps)``): pattern-dependent stopping time — each sample
            stops at the first time ``‖F(t, y)‖ = eps`` (at 0 if it starts below), an event ``g = ‖F‖ − eps``
            located on the interpolant like any other (:meth:`solve`), its time differentiable; finished
            samples leave the batch. Calling the block still returns a tensor; :meth:`solve` also gives
            ``stop_times``.

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
            raise ValueError(
                f"`rtol`/`atol` control adaptive methods; the fixed-step {method!r} would ignore them. "
                "Drop them (set the step with `step_size`), or use an adaptive method such as 'dopri5'."
            )
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
            raise ValueError(
                f"`jumps` tells adaptive solvers where the parameters jump; the fixed-step {method!r} "
                "always steps on every piece boundary. Drop `jumps`."
            )
        self.jumps = True if jumps is None else bool(jumps)
        if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
            raise ValueError(f"`max_steps` must be a positive integer, got {max_steps!r}.")
        self.max_steps = max_steps
        if step_size is not None:
            n = sum(max(1, math.ceil((b - a) / step_size - 1e-9)) for a, b in self._pieces())
            if n > max_steps:  # refuse before the grid is built: a tiny step would allocate gigabytes first
                raise ValueError(
                    f"`step_size`={step_size:g} takes {n} steps over [0, {self.T:g}], more than "
                    f"max_steps={max_steps}; use a larger `step_size` or raise `max_steps`."
                )
        adjoint_set = [
            n
            for n, v in (
                ("adjoint_method", adjoint_method),
                ("adjoint_rtol", adjoint_rtol),
                ("adjoint_atol", adjoint_atol),
                ("seminorm", seminorm),
            )
            if v is not None
        ]
        if adjoint_set and gradient != "adjoint":
            raise ValueError(
                f"{', '.join(f'`{n}`' for n in adjoint_set)} set(s) the adjoint's backward solve; "
                f"gradient={gradient!r} has none. Drop them, or use gradient='adjoint'."
            )
        if adjoint_method is not None:
            check_method(adjoint_method, "adjoint_method")
        self.adjoint_method = adjoint_method
        self.adjoint_rtol = None if adjoint_rtol is None else check_positive("adjoint_rtol", adjoint_rtol)
        self.adjoint_atol = None if adjoint_atol is None else check_positive("adjoint_atol", adjoint_atol)
        self.seminorm = True if seminorm is None else bool(seminorm)
        self.stop = as_stop(stop, "continuous")
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
    # torchdiffeq's and torchsde's step loops are data-dependent control flow with host synchronisation on every
    # step: under torch.compile the solve runs eagerly and everything around it is compiled (under inductor
    # the adaptive loop failed outright with a view+inplace error).
    @torch.compiler.disable
    def solve(
        self,
        y0: torch.Tensor,
        u: torch.Tensor | None = None,
        t=None,
        *,
        event: EventFn | None = None,
        t_end: torch.Tensor | None = None,
        dense: bool = False,
        event_tol: float = 1e-10,
    ) -> Solution:
        """Solve from ``y0`` (``(batch, *state_shape)``; ``u``: the block input of a field with ``needs_input``).

        ``t``: times at which to save the state; the result's ``ys`` is ``(len(t), *y0.shape)``. Increasing times
        (within ``[0, T]``) start from ``y0`` at time 0; *decreasing* times start from ``y0`` at time ``T`` and
        integrate backwards (``solve(y_T, t=[T, ..., 0]).y`` inverts the block). Fixed-step methods step
        *through* every requested time (each is added to the step grid, so the values are the scheme's own, not
        interpolated): times finer than ``step_size`` mean more, shorter steps.

        Per-sample events (every sample on its own clock; finished samples leave the batch):

        - ``event``: ``g(t, y) -> (batch,)`` (``t``: ``(n,)`` times, one per row, in ``y``'s dtype; ``y``: the
          ``n`` rows still running, in batch order). Each sample stops at its first sign change of ``g``, located
          on the solver's interpolant to ``event_tol`` in ``t``. ``solution.stop_times`` holds each sample's event
          time (``T`` where none), ``solution.y`` its state there, ``solution.fired`` which samples had one.
          Both are differentiable (implicit function theorem, :mod:`cde_nets.solvers.events`) in every gradient
          mode, also with respect to parameters ``g`` closes over — add those to your optimiser yourself.
        - ``t_end``: ``(batch,)`` end times in ``[0, T]``: sample ``i`` stops exactly at ``t_end[i]`` (with
          ``event``, at whichever comes first). Differentiable too: ``dy/dt_end = F``.
        - ``dense=True``: keep the trajectory; ``solution.evaluate(t)`` gives states at any times in ``[0, T]``
          (cubic Hermite between the solver's states about one step apart).

        Events are per call, not settings of the block: they are questions asked of a trajectory, like ``t``,
        often with per-call data, and the block stays a pure function of ``(y0, u)``. The block's own ``stop``
        rule is the event ``‖F(t, y)‖ − eps``.
        """
        bound = self.bind(y0, u)
        self._stats = SolverStats()
        per_sample = self.stop is not None or event is not None or t_end is not None
        if event is not None and not callable(event):
            raise TypeError(f"`event` must be a callable g(t, y) -> (batch,), got {type(event).__name__}.")
        if per_sample and t is not None:
            name = "stop" if self.stop is not None else ("event" if event is not None else "t_end")
            raise ValueError(
                f"`t` and `{name}` do not combine: each sample stops at its own time. Drop `t` (or "
                "solve with `dense=True` and no events to read states at any time)."
            )
        if dense and per_sample:
            raise ValueError(
                "`dense=True` keeps the whole batch's trajectory; `stop`, `event` and `t_end` remove "
                "samples from the batch as they finish. Drop one of them."
            )
        if event is not None and self.stop is not None:
            raise ValueError(
                "`event` and the block's `stop` rule are both stopping events; pass one of them "
                "(build the block without `stop`, or fold ‖F‖ − eps into your `event`)."
            )
        tend = None if t_end is None else self._check_t_end(t_end, y0)
        check_positive("event_tol", event_tol, "It is the width in t to which event times are located.")
        if y0.shape[0] == 0:  # an empty shard (data-parallel): nothing to solve, but every parameter in the graph
            return _empty(bound, y0, self.T, t, self._stats, per_sample)
        if per_sample or dense:
            g = None if event is None else (lambda s, y, idx: event(s, y))
            with self._gathered():
                res = self._solve_events(bound, y0, g, tend, dense, event_tol)
            dense_out = None if res.knots is None else HermiteDense(*res.knots)
            return Solution(
                y=res.y,
                stats=self._stats,
                stop_times=None if dense else res.times,
                fired=None if dense else res.fired,
                interpolant=dense_out,
            )
        if t is None:
            times = torch.tensor([0.0, self.T], dtype=torch.float64, device=y0.device)
            return Solution(y=self._solve(bound, y0, times)[-1], stats=self._stats)
        tt = _check_times(t, self.T, y0.device)
        origin = 0.0 if float(tt[-1]) >= float(tt[0]) else self.T
        start = float(tt[0]) != origin
        if start:  # integrate from the origin (0, or T backwards) to the first requested time as well
            tt = torch.cat([tt.new_full((1,), origin), tt])
        ys = self._solve(bound, y0, tt)
        if start:
            ys, tt = ys[1:], tt[1:]
        return Solution(y=ys[-1], ts=tt, ys=ys, stats=self._stats)

    def _check_t_end(self, t_end, y0: torch.Tensor) -> torch.Tensor:
        te = t_end if isinstance(t_end, torch.Tensor) else torch.as_tensor(t_end, dtype=torch.float64)
        if te.shape != (y0.shape[0],) or not te.is_floating_point():
            raise ValueError(
                f"`t_end` must be a float tensor of shape (batch,) = ({y0.shape[0]},), one end time per "
                f"sample; got {te.dtype} of shape {tuple(te.shape)}."
            )
        bad = ~torch.isfinite(te.detach()) | (te.detach() < 0) | (te.detach() > self.T * (1 + 1e-12))
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"`t_end[{i}]`={float(te[i]):g} lies outside [0, T] = [0, {self.T:g}]; every end time "
                "must lie within the block's span (raise the block's T for later ones)."
            )
        return te.to(y0.device)

    def _gathered(self):
        """The forward solve sees the field's constants built once per call, as in discrete mode, whatever the
        gradient: the same forward values in every mode. Backward solves and replays run after the call returns
        and rebuild them piece by piece from the piece in force."""
        return gathered(self.field)

    def _params(self, bound: BoundField) -> list[torch.Tensor]:
        """What the adjoint differentiates: the field's trainable parameters and the call's input ``u``."""
        params: list[torch.Tensor] = [p for p in self.field.parameters() if p.requires_grad]
        if bound.u is not None and bound.u.requires_grad:
            params.append(bound.u)
        return params

    def _integrate(
        self, bound: BoundField, y0: torch.Tensor, t: torch.Tensor, jump_t, grid, options: dict | None = None
    ) -> torch.Tensor:
        try:
            ys, _ = integrate(
                bound,
                y0,
                t,
                method=self.method,
                rtol=self.rtol,
                atol=self.atol,
                gradient=self.gradient,
                params=self._params(bound),
                jump_t=jump_t,
                grid=grid,
                options=self.options if options is None else options,
                max_steps=self.max_steps,
                seminorm=self.seminorm,
                adjoint_method=self.adjoint_method,
                adjoint_rtol=self.adjoint_rtol,
                adjoint_atol=self.adjoint_atol,
                stats=self._stats,
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
            return (
                f"parameter `{name}` holds NaN/inf, so the solve is non-finite; restore the last good checkpoint "
                "(a diverged optimiser step?) or re-initialise it."
            )
        watch = Watch(bound)
        with torch.no_grad():
            try:
                integrate(
                    watch,
                    y0.detach(),
                    t,
                    method=self.method,
                    rtol=self.rtol,
                    atol=self.atol,
                    gradient="backprop",
                    jump_t=jump_t,
                    grid=grid,
                    options=self.options,
                    max_steps=self.max_steps,
                )
            except SolverError:
                pass
        if watch.t is None:
            return None
        grid_ = getattr(self.field, "grid", None)
        piece = f" (piece {grid_.index(watch.t)} of {grid_.L})" if grid_ is not None and grid_.L > 1 else ""
        return (
            f"the state became non-finite (NaN/inf) in the forward solve: the field first returned a "
            f"non-finite value at t={watch.t:.6g}{piece}, evaluation {watch.evaluations}. The solution blows "
            "up there: use smaller steps (`step_size`, or an adaptive method), shrink the weights or inputs, "
            "or use float64."
        )

    def _solve_events(
        self, bound: BoundField, y0: torch.Tensor, event, t_end: torch.Tensor | None, dense: bool, tol: float
    ):
        """The per-sample event loop of :func:`~cde_nets.solvers.events.integrate_events` over ``[0, T]``: solves
        of a few steps on the rows still running (``u`` restricted to them), the state asked at sub-points."""
        jump_t, grid = self._grids(self.field)
        rows: dict = {}
        T = self.T
        est: dict = {}

        def bound_rows(idx: torch.Tensor) -> BoundField:
            # the loop passes the same idx tensor until the batch shrinks: gather u once per compaction (with its
            # graph, though the first call may come from a no-grad event check)
            if rows.get("idx") is not idx:
                with torch.enable_grad():
                    rows.update(idx=idx, bound=bound.rows(idx))
            return rows["bound"]

        if grid is not None:  # fixed steps: segments of grid points, the sign checked at every step
            pts = grid.tolist()

            def plan(t: float) -> list[float]:
                nxt = [p for p in pts if p > t]
                return nxt[:_SEGMENT_STEPS] or [T]
        else:  # adaptive: segments of about _SEGMENT_STEPS of the last segment's mean step

            def plan(t: float) -> list[float]:
                seg = min(_SEGMENT_STEPS * est["dt"], T - t) if "dt" in est else T / 16
                return [t + seg * k / _SUBPOINTS for k in range(1, _SUBPOINTS)] + [min(t + seg, T)]

        def solve(y: torch.Tensor, times: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            g = None if grid is None else grid[(grid >= times[0]) & (grid <= times[-1])]
            options = None
            if grid is None and "dt" in est and "first_step" not in self.options:
                options = {**self.options, "first_step": est["dt"]}  # no fresh initial-step search per segment
            before = self._stats.steps_forward
            ys = self._integrate(bound_rows(idx), y, times, jump_t, g, options)
            est["dt"] = float(times[-1] - times[0]) / max(1, self._stats.steps_forward - before)
            return ys

        def field(t: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return _field_at(bound_rows(idx), t, y)

        stop_below = False
        if self.stop is not None:
            eps = self.stop.eps

            def event(t: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
                f = field(t, y, idx)
                return torch.linalg.vector_norm(f.reshape(f.shape[0], -1), dim=1) - eps

            stop_below = True
        return integrate_events(
            solve,
            field,
            y0,
            t0=0.0,
            t1=T,
            plan=plan,
            event=event,
            t_end=t_end,
            stop_below=stop_below,
            tol=tol,
            dense=dense,
        )

    def _solve(self, bound: BoundField, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        jump_t, grid = self._grids(self.field)
        with self._gathered():
            return self._integrate(bound, y0, t, jump_t, grid)

    def extra_repr(self) -> str:
        return f"T={self.T}, method={self.method!r}, rtol={self.rtol}, atol={self.atol}, gradient={self.gradient!r}"
