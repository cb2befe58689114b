"""Continuous mode: a field integrated over ``[0, T]`` by torchdiffeq (Chen et al. 2018, "Neural ordinary
differential equations"), with per-sample events, end times and stopping (:mod:`cde_nets.solvers.events`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from cde_nets.blocks.base import Block
from cde_nets.blocks.collected_terms import report
from cde_nets.blocks.compile_boundary import eager_under_compile
from cde_nets.blocks.gathering import gathered, suspended
from cde_nets.blocks.nonfinite import Found, Watch, check_result, nonfinite_parameter
from cde_nets.blocks.per_sample import solve_per_sample
from cde_nets.blocks.regularisers import AugmentedBound, Regularisation, TrajectoryRegularisers
from cde_nets.blocks.solution import Solution
from cde_nets.blocks.stop import Stop, as_stop
from cde_nets.fields.base import Field
from cde_nets.fields.bound import BoundField
from cde_nets.fields.pieces import piece_modules, set_views
from cde_nets.functional import odeint
from cde_nets.solvers.adapter import integrate
from cde_nets.solvers.controllers import Controller
from cde_nets.solvers.counting import SolverStats
from cde_nets.solvers.engine import check_cell, check_events
from cde_nets.solvers.errors import Reason, SolverError, check_positive
from cde_nets.solvers.events import HermiteDense, per_sample_events
from cde_nets.solvers.gradients import Adjoint, Backprop, GradientMethod, as_gradient, default_gradient
from cde_nets.solvers.gradients.piecewise_adjoint import PiecewiseParam
from cde_nets.solvers.grids import aligned_grid
from cde_nets.solvers.options import ADAPTIVE_METHODS, FIXED_METHODS, REVERSIBLE_METHODS, SolverOptions
from cde_nets.solvers.output_times import with_output_times, with_start_time
from cde_nets.solvers.precision import check_autocast, check_autocast_state
from cde_nets.solvers.steppers.fast_rk import fast_applies
from cde_nets.solvers.times import check_times
from cde_nets.solvers.transforms import (
    PER_SAMPLE_UNDER_VMAP,
    differentiated,
    host_all,
    host_any,
    under_transform,
    under_vmap,
)
from cde_nets.solvers.validation import check_half_precision, nonfinite_message

__all__ = ["ODEBlock"]

EventFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _piecewise(field: nn.Module) -> list[PiecewiseParam]:
    """The field's trainable pieces, for the adjoint to differentiate one piece at a time."""
    return [
        PiecewiseParam(p.data, p.grid.boundaries.tolist(), p.grid.index, partial(set_views, p))
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


class _Backwards(BoundField):
    """``−F(−s, y)``: the field of a solve backwards in time, run forwards in ``s = −t``."""

    def __call__(self, t: torch.Tensor | float, y: torch.Tensor) -> torch.Tensor:
        return -super().__call__(-t, y)


def _check_times(t, T: float, device: torch.device | None) -> torch.Tensor:
    """Output times: strictly increasing (``y0`` at 0) or strictly decreasing (``y0`` at ``T``) within [0, T]."""
    return check_times(t, T, device, backwards=True)


def _norm_event(field: Callable[..., torch.Tensor], eps: float) -> Callable[..., torch.Tensor]:
    """The stopping event ``g = ‖F(t, y)‖ − eps`` per row (:class:`~cde_nets.blocks.stop.Stop`)."""

    def event(t: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        f = field(t, y, idx)
        return torch.linalg.vector_norm(f.reshape(f.shape[0], -1), dim=1) - eps

    return event


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
            (asynchronous leapfrog, :mod:`~cde_nets.solvers.steppers.alf`: adaptive, or fixed with ``step_size``), or
            fixed-step implicit Runge-Kutta (``implicit_midpoint``, ``gl4``, ``gl6``: symplectic; ``trapezoid``,
            ``radauIIA3``, ``radauIIA5``, ``sdirk2``, ``trbdf2``, ``implicit_euler``: for stiff fields;
            :mod:`~cde_nets.solvers.steppers.implicit`, gradients ``backprop``/``checkpoint``/``adjoint``) or Yoshida's
            symplectic compositions and splitting methods for separable fields (``yoshida4``, ``yoshida6``,
            ``mcate5``, ``kahan_li8``, ``sofspa10``, ...: :data:`~cde_nets.solvers.steppers.split_ode.SPLIT_METHODS`);
            see ``docs/guides/symplectic.md``.
        rtol, atol: tolerances of adaptive methods (default 1e-6, 1e-8); refused for fixed-step methods.
        gradient: a gradient method (:mod:`~cde_nets.solvers.gradients`) or its short name:
            ``Adjoint()``/``"adjoint"`` (continuous adjoint, O(1) memory in the steps; its backward solve's own
            ``rtol``, ``atol``, ``method`` and ``seminorm`` are the object's: ``Adjoint(rtol=1e-8)``),
            ``Backprop()``/``"backprop"`` (differentiate through the solver's steps: the discrete adjoint of the
            solver), or the exact gradient of the solver's steps at low memory: ``"checkpoint"`` (replay each step
            from a stored state), ``"symplectic"`` (the symplectic adjoint over the replayed stages),
            ``"reversible"`` (``method="alf"``: states rebuilt by the integrator's inverse, constant memory). See
            the gradient methods guide. Default (``None``): chosen per call from the state's size
            (:meth:`gradient_for`, :func:`~cde_nets.solvers.gradients.default_gradient`): ``Backprop()`` for
            explicit Runge-Kutta methods while bytes of ``y0`` × stages × steps (100 assumed for adaptive
            methods) is at most 64 MiB, else ``Checkpoint()``; ``Checkpoint()`` for the implicit and composition
            methods, ``Reversible()`` for ``alf``, else ``Adjoint()``. ``block.gradient`` is then ``None``;
            :meth:`gradient_for` says what a call uses.
        step_size: fixed-step methods only; default one step per parameter piece (the discrete-mode grid). The
            grid always contains every piece boundary.
        options: further torchdiffeq options (unknown keys raise); ``{"max_num_steps": n}`` sets the steps allowed
            per solve before :class:`~cde_nets.solvers.errors.SolverError` (default 100 000, ``max_steps`` of
            :class:`~cde_nets.solvers.options.SolverOptions`).
        solver: instead of ``method`` … ``options``, one :class:`~cde_nets.solvers.options.SolverOptions`
            (shared between blocks and diagnostics); it also holds the rarely changed settings: ``jumps``
            (adaptive methods, default True: tell the solver where time-varying parameters jump, torchdiffeq's
            ``jump_t``), ``max_steps`` and ``autocast`` (the field evaluated in ``torch.bfloat16``/``float16``
            under ``torch.autocast``, the state and step control in the state's dtype).
        controller: ``"batch"`` (default, or the ``solver``'s: one step size for the batch), a
            :class:`~cde_nets.solvers.controllers.Controller` object (the shared step's rule), or ``"per_sample"``:
            every sample on its own steps (``dopri5``/``bosh3``/``tsit5``), with per-sample ``t`` (``(batch, n)``) and
            ``t_end``; the field then sees one time per running row (``docs/guides/per_sample.md``).
        stop: a :class:`~cde_nets.blocks.stop.Stop` (``Stop(eps)``): pattern-dependent stopping time — each sample
            stops at the first time ``‖F(t, y)‖ = eps`` (at 0 if it starts below), an event ``g = ‖F‖ − eps``
            located on the interpolant like any other (:meth:`solve`), its time differentiable; finished
            samples leave the batch. Calling the block still returns a tensor; :meth:`solve` also gives
            ``stop_times``.
        regularisation: a :class:`~cde_nets.blocks.regularisers.Regularisation`: integrated regularisers
            (``"kinetic"``, ``"jacobian"``, ``"taylor2"``: RNODE, Finlay et al. 2020, eqs. 4-5; TayNODE, Kelly et
            al. 2020, eq. 3), integrated with the state in the same solve (:mod:`~cde_nets.blocks.regularisers`),
            and STEER's random end time (Ghosh et al. 2020, §3). Each call's ``Solution.regularisation`` maps
            each integral to its batch mean, and every call reports its solution into the open
            :func:`~cde_nets.integrated_terms` collection, which the :class:`~cde_nets.train.trainer.Trainer`'s
            ``kinetic_energy(λ)``, ... terms read. The adaptive steps stay those of the unregularised block; in
            evaluation mode the end time is ``T``.

    Calling the block returns ``y(T)``; :meth:`solve` returns a :class:`~cde_nets.blocks.solution.Solution` (states at
    requested times, statistics, stopping times); its ``stats`` hold the call's counts: ``nfe_forward``,
    ``nfe_backward`` (filled in by ``backward()``), accepted (``steps_*``) and rejected (``rejected_*``) steps of
    the forward and backward solves. The block keeps nothing between calls.
    """

    def __init__(
        self,
        field: nn.Module,
        T: float | None = None,
        method: str = "dopri5",
        rtol: float | None = None,
        atol: float | None = None,
        gradient: str | GradientMethod | None = None,
        step_size: float | None = None,
        options: dict | None = None,
        stop: Stop | dict | None = None,
        *,
        solver: SolverOptions | None = None,
        controller: str | Controller | None = None,
        regularisation: Regularisation | None = None,
    ):
        super().__init__(field, T)
        if solver is None:
            solver = SolverOptions(
                method, rtol, atol, step_size, options=options or {}, controller=controller or "batch"
            )
        elif not isinstance(solver, SolverOptions):
            raise TypeError(f"`solver` must be a SolverOptions, got {type(solver).__name__}.")
        elif controller is not None and controller != solver.controller:
            raise ValueError(f"set `controller` in the SolverOptions: SolverOptions(..., controller={controller!r}).")
        self.solver = solver
        # None: chosen per call from the state's size (gradient_for) and handed down the call
        self.gradient: GradientMethod | None = None if gradient is None else as_gradient(gradient)
        check_cell(self.gradient or default_gradient(solver.method), solver.method, solver.controller)
        if (
            solver.compile
        ):  # the compiled step (solvers.steppers.compiled) serves backprop, without stop or regularisers
            from cde_nets.solvers.steppers.compiled import check_compiled

            check_compiled(solver.method, self.gradient, solver.controller)
            if stop is not None or regularisation is not None:
                raise ValueError(
                    "SolverOptions(compile=True) compiles plain solves; `stop` and `regularisation` run on the eager "
                    "stepper: drop them, or drop compile."
                )
        if solver.step_size is not None:
            n = solver.steps_over(self._pieces())
            if n > solver.max_steps:  # refuse before the grid is built: a tiny step would allocate gigabytes first
                raise ValueError(
                    f"`step_size`={solver.step_size:g} takes {n} steps over [0, {self.T:g}], more than "
                    f"max_steps={solver.max_steps}; use a larger `step_size` or raise `max_steps` "
                    "(options={'max_num_steps': n})."
                )
        self.stop = as_stop(stop, "continuous")
        if regularisation is None:
            regularisation = Regularisation()
        elif not isinstance(regularisation, Regularisation):
            raise TypeError(
                f"`regularisation` must be a Regularisation, e.g. Regularisation(('kinetic',)); "
                f"got {type(regularisation).__name__}."
            )
        self.regularisers = TrajectoryRegularisers(regularisation.regularisers, regularisation.noise)
        self.steer = self._check_steer(regularisation.steer)
        if self.regularisers and (self.stop is not None or solver.method not in {**ADAPTIVE_METHODS, **FIXED_METHODS}):
            raise ValueError(
                "`regularisers` are integrated with the state by torchdiffeq's explicit methods, over the whole "
                f"batch; use one of {sorted({**ADAPTIVE_METHODS, **FIXED_METHODS})} and no `stop` "
                f"(got method={solver.method!r}, stop={self.stop!r})."
            )
        if self.regularisers and solver.per_sample:
            raise ValueError(
                "`regularisers` are integrated over the whole batch's shared steps; controller='per_sample' gives "
                "every sample its own. Use controller='batch' with regularisers."
            )

    # the solver's settings, read through the block
    method = property(lambda self: self.solver.method)
    rtol = property(lambda self: self.solver.rtol)
    atol = property(lambda self: self.solver.atol)
    step_size = property(lambda self: self.solver.step_size)
    jumps = property(lambda self: self.solver.jumps)
    max_steps = property(lambda self: self.solver.max_steps)
    options = property(lambda self: self.solver.options)

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
        if not self.solver.adaptive:
            return None, aligned_grid(bounds, self.step_size)
        jump_t = grid.jumps if (grid is not None and self.jumps) else None
        return jump_t, None

    # torchdiffeq's and torchsde's step loops are data-dependent control flow with host synchronisation on every
    # step: under torch.compile the solve runs eagerly and everything around it is compiled (under inductor
    # the adaptive loop failed outright with a view+inplace error).
    @eager_under_compile
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
        event_mode: str = "per_sample",
    ) -> Solution:
        """Solve from ``y0`` (``(batch, *state_shape)``; ``u``: the block input of a field with ``needs_input``).

        ``t``: times at which to save the state; the result's ``ys`` is ``(len(t), *y0.shape)``. Increasing times
        (within ``[0, T]``) start from ``y0`` at time 0; *decreasing* times start from ``y0`` at time ``T`` and
        integrate backwards (``solve(y_T, t=[T, ..., 0]).y`` inverts the block). Fixed-step methods step
        *through* every requested time (each is added to the step grid, so the values are the scheme's own, not
        interpolated): times finer than ``step_size`` mean more, shorter steps. ``t`` may require grad, in every
        gradient mode: ``∂y(t_i)/∂t_i = F(t_i, y(t_i))``, and a first time at the origin is the start, whose
        gradient is minus the sensitivity through ``y0`` (:mod:`~cde_nets.solvers.output_times`).

        Per-sample events (every sample on its own clock; finished samples leave the batch):

        - ``event``: ``g(t, y) -> (batch,)`` (``t``: ``(n,)`` times, one per row, in ``y``'s dtype; ``y``: the
          ``n`` rows still running, in batch order). Each sample stops at its first sign change of ``g``, located
          on the solver's interpolant to ``event_tol`` in ``t``. ``solution.stop_times`` holds each sample's event
          time (``T`` where none), ``solution.y`` its state there, ``solution.fired`` which samples had one.
          Both are differentiable (implicit function theorem, :mod:`cde_nets.solvers.events`) in every gradient
          mode, also with respect to parameters ``g`` closes over — add those to your optimiser yourself.
        - ``event_mode="first"``: torchdiffeq's semantics instead: ``g(t, y)`` sees the whole batch ``y`` (one
          value, or several: the first of them to change sign) and the *whole* batch stops at the first event,
          searched without an end time (``T`` does not bound it) by bisection on the step's dense output. This is
          ``cde_nets.odeint_event(field, y0, 0, event_fn=g, ...)`` with the block's method, tolerances (or
          ``step_size``) and gradient, run by the same code: the same values and gradients. ``stop_times`` holds
          the event time for every sample; ``stats`` stay empty.
        - ``t_end``: ``(batch,)`` end times in ``[0, T]``: sample ``i`` stops exactly at ``t_end[i]`` (with
          ``event``, at whichever comes first). Differentiable too: ``dy/dt_end = F``.
        - ``dense=True``: keep the trajectory; ``solution.evaluate(t)`` gives states at any times in ``[0, T]``
          (cubic Hermite between the solver's states about one step apart).

        Events are per call, not settings of the block: they are questions asked of a trajectory, like ``t``,
        often with per-call data, and the block stays a pure function of ``(y0, u)``. The block's own ``stop``
        rule is the event ``‖F(t, y)‖ − eps``.
        """
        gradient = self.gradient_for(y0, t)  # the call's own: the block keeps no state between or during calls
        call = (y0, u, t, event, t_end, dense, event_tol, SolverStats(), gradient, event_mode)
        return report(self._solve_call(*call))

    def gradient_for(self, y0: torch.Tensor, t=None) -> GradientMethod:
        """The gradient method a call from ``y0`` (through the times ``t``) uses: the block's ``gradient``, or,
        for a block built without one, :func:`~cde_nets.solvers.gradients.default_gradient`'s choice from the
        bytes of ``y0`` and the steps (a fixed-step grid's count, with one more per output time; assumed for
        adaptive methods): backprop while its graph is small, checkpointed replay beyond, and the replay wherever
        backprop would leave the library's own stepper (decreasing times, a half-precision state); backprop under
        ``torch.func``'s transforms and with the compiled step, which differentiate the solve itself. It reads
        shapes and the order of ``t`` only, so every call of the same shapes and times makes the same choice."""
        if self.gradient is not None:
            return self.gradient
        if under_transform() or self.solver.compile:  # torch.func and the compiled step: backprop through them
            return Backprop()
        if not isinstance(y0, torch.Tensor):
            return default_gradient(self.method)
        steps = None
        if not self.solver.adaptive:
            try:
                outputs = 0 if t is None else len(t)
            except TypeError:  # a 0-d time: refused by the solve, with its own message
                outputs = 0
            steps = self.solver.steps_over(self._pieces()) + outputs
        chosen = default_gradient(self.method, y0.numel() * y0.element_size(), steps)
        if isinstance(chosen, Backprop) and not self.solver.per_sample and not self._own_stepper(y0, t):
            # torchdiffeq would run it, holding the step sizes fixed: the replay differentiates every step
            return default_gradient(self.method)
        return chosen

    def _own_stepper(self, y0: torch.Tensor, t) -> bool:
        """Whether backprop through a call from ``y0`` at the times ``t`` runs on the library's own stepper
        (:func:`~cde_nets.solvers.steppers.fast_rk.fast_applies`: increasing times, its options, a float32/float64
        state)."""
        try:
            times = (
                torch.tensor([0.0, self.T], dtype=torch.float64)
                if t is None
                else torch.as_tensor(t, dtype=torch.float64).detach()
            )
        except (TypeError, ValueError, RuntimeError):  # refused by the solve, with its own message
            return False
        return fast_applies(self.method, True, y0, times, None, self.solver.options)

    def _solve_call(
        self,
        y0,
        u,
        t,
        event,
        t_end,
        dense: bool,
        event_tol: float,
        stats: SolverStats,
        gradient: GradientMethod,
        event_mode: str = "per_sample",
    ) -> Solution:
        bound = self.bind(y0, u)
        self._check_resolution(y0, gradient)
        if self.solver.per_sample and under_vmap():
            raise ValueError(PER_SAMPLE_UNDER_VMAP)
        if self.regularisers and under_vmap():
            raise ValueError(
                "a block with `regularisation` under torch.vmap: its integrals differentiate the field inside the "
                "solve with torch.autograd, which torch.func refuses. Solve the instances as one batch with the "
                "block, or build the block for vmap without `regularisation`."
            )
        if self.solver.per_sample:
            return self._solve_per_sample(bound, y0, t, event, t_end, dense, stats, gradient, event_mode)
        per_sample = self.stop is not None or event is not None or t_end is not None
        self._check_events(event, t, t_end, dense)
        if self.solver.compile and (event is not None or t_end is not None or dense):
            raise ValueError(
                "SolverOptions(compile=True) compiles solves to the times `t`; `event`, `t_end` and `dense` run on "
                "the eager stepper: drop compile for these calls."
            )
        if event is not None or dense or self.stop is not None:
            check_events(self.method, event_mode if event is not None else "per_sample")
        first = event is not None and event_mode == "first"
        if first and t_end is not None:
            raise ValueError("`t_end` stops each sample at its own time: use it with event_mode='per_sample'.")
        if self.regularisers and (per_sample or dense or (isinstance(t, torch.Tensor) and t.requires_grad)):
            raise ValueError(
                "a block with `regularisers` integrates them over the whole batch's solve: drop `event`, "
                "`t_end` and `dense` (and detach `t`), or solve with a block built without regularisers."
            )
        if self.steer and self.training and (per_sample or dense or t is not None):
            raise ValueError(
                "`steer` draws this training call's end time; `t`, `event`, `t_end`, `stop` and `dense` ask for "
                "fixed times. Drop them, or call `block.eval()` (the end time is then T)."
            )
        tend = None if t_end is None else self._check_t_end(t_end, y0)
        check_positive("event_tol", event_tol, "It is the width in t to which event times are located.")
        if y0.shape[0] == 0:  # an empty shard (data-parallel): nothing to solve, but every parameter in the graph
            return _empty(bound, y0, self.T, t, stats, per_sample)
        if first:
            return self._first_event(bound, y0, event, stats, gradient)
        if per_sample or dense:
            g = None if event is None else (lambda s, y, idx: event(s, y))
            with self._gathered(gradient):
                res = self._solve_events(bound, y0, g, tend, dense, event_tol, stats, gradient)
            dense_out = None if res.knots is None else HermiteDense(*res.knots)
            return Solution(
                y=res.y,
                stats=stats,
                stop_times=None if dense else res.times,
                fired=None if dense else res.fired,
                interpolant=dense_out,
            )
        return self._solve_at(bound, y0, t, stats, gradient)

    def _solve_per_sample(
        self,
        bound: BoundField,
        y0: torch.Tensor,
        t,
        event,
        t_end,
        dense: bool,
        stats: SolverStats,
        gradient: GradientMethod,
        event_mode: str = "per_sample",
    ) -> Solution:
        """Every sample on its own steps (``controller="per_sample"``, :mod:`cde_nets.blocks.per_sample`)."""
        if event is not None or self.stop is not None or dense:
            check_events(self.method, event_mode, "per_sample")  # the one refusal, odeint's too
        if y0.shape[0] == 0:
            return _empty(bound, y0, self.T, t, stats, False)
        with self._gathered(gradient):
            return solve_per_sample(self, bound, y0, t, t_end, stats, gradient)

    def _check_steer(self, steer: float) -> float:
        if isinstance(steer, bool) or not isinstance(steer, (int, float)) or not 0 <= steer < self.T:
            raise ValueError(
                f"`steer` must be the half-width b of STEER's end time U(T−b, T+b), 0 <= b < T; got {steer!r}."
            )
        if steer and len(self._bounds()) > 2:
            raise ValueError(
                f"`steer` moves the end time T, but this field's parameters are laid out in {len(self._bounds()) - 1} "
                "pieces over [0, T]; use a field of one piece (or a plain module), or drop `steer`."
            )
        return float(steer)

    def _check_events(self, event, t, t_end, dense: bool) -> None:
        """Refuse per-call arguments that do not combine, naming which."""
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

    def _solve_at(
        self, bound: BoundField, y0: torch.Tensor, t, stats: SolverStats, gradient: GradientMethod
    ) -> Solution:
        """The whole batch to ``T`` (``t`` None), or through the requested times ``t``."""
        if t is None:
            end = self.T + (2 * float(torch.rand(())) - 1) * self.steer if self.steer and self.training else self.T
            times = torch.tensor([0.0, end], dtype=torch.float64, device=y0.device)
            ys, terms = self._solve(bound, y0, times, stats, gradient)
            return Solution(y=ys[-1], stats=stats, regularisation=terms)
        tt = _check_times(t, self.T, y0.device)
        # host reads beneath torch.vmap's wrappers: per-instance times share their direction (checked above)
        origin = 0.0 if host_all(tt[-1] >= tt[0]) else self.T
        at_origin = tt[0] == origin
        start = not host_all(at_origin)
        if start and host_any(at_origin):  # only per-instance times can disagree
            raise ValueError(
                f"per-instance `t` under torch.vmap: some instances' times start at {origin:g} (y0's time) and "
                f"some later; start every instance's `t` at {origin:g} (read the rest off `ys`), or none of them."
            )
        # the solve sees the times detached; their gradients ride around it (solvers.output_times), in every mode;
        # a vmap wrapper's requires_grad hides a grad level's, and a jvp level's tangent shows in no requires_grad
        tg = t.to(y0.device, torch.float64) if isinstance(t, torch.Tensor) and differentiated(t) else None
        if tg is not None and torch.is_grad_enabled() and not start:  # t[0] is then the start time
            y0 = with_start_time(bound, y0, tg[0])
        if start:  # integrate from the origin (0, or T backwards) to the first requested time as well
            tt = torch.cat([tt.new_full((1,), origin), tt])
        if origin != 0.0 and under_transform() and type(bound) is BoundField:
            # torch.func's loop of tensor decisions runs forwards: y' = F(t, y) backwards in t is
            # z' = −F(−s, z) forwards in s = −t
            ys, terms = self._solve(_Backwards(bound.field, bound.u, bound.ids), y0, -tt, stats, gradient)
        else:
            ys, terms = self._solve(bound, y0, tt, stats, gradient)
        if start:
            ys, tt = ys[1:], tt[1:]
        if tg is not None and torch.is_grad_enabled():
            ys = with_output_times(bound, ys, tg)
        return Solution(y=ys[-1], ts=tt, ys=ys, stats=stats, regularisation=terms)

    def _check_resolution(self, y0: torch.Tensor, gradient: GradientMethod) -> None:
        """Refuse half precision for adaptive methods, and a relative tolerance finer than the state's dtype
        resolves: no step is more accurate than a rounding of ``y``, so the controller would shrink the steps
        until they underflow (or overflow its norms), and the failure would surface far from its cause."""
        check_autocast_state(self.solver.autocast, y0, "SolverOptions(autocast=)")
        if not self.solver.adaptive or not y0.is_floating_point():
            return
        if isinstance(gradient, Adjoint) and gradient.rtol is not None:
            check_autocast(self.solver.autocast, gradient.rtol, rtol_name="Adjoint(rtol=)")
        check_half_precision(self.method, y0.dtype, "state", "`step_size`")
        # the unit roundoff: torchdiffeq's default rtol = 1e-7 on a float32 state (u = 6e-8) stays allowed
        eps = torch.finfo(y0.dtype).eps / 2
        adjoint_rtol = gradient.rtol if isinstance(gradient, Adjoint) else None
        for name, rtol in (("rtol", self.rtol), ("Adjoint(rtol=)", adjoint_rtol)):
            if rtol is not None and rtol < eps:
                wider = (
                    ""
                    if y0.dtype == torch.float64
                    else f", or a float64 state (unit roundoff {torch.finfo(torch.float64).eps / 2:.3g})"
                )
                raise ValueError(
                    f"`{name}`={rtol:g} is below the resolution of the {str(y0.dtype).removeprefix('torch.')} "
                    f"state (unit roundoff {eps:.3g}): no step is accurate to less than a rounding of y. Use "
                    f"{name} >= {eps:.3g}{wider}."
                )

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

    def _gathered(self, gradient: GradientMethod):
        """The forward solve sees the field's constants built once per call, as in discrete mode, whatever the
        gradient: the same forward values in every mode. Backward solves and replays run after the call returns
        and rebuild them piece by piece from the piece in force. Under ``torch.func`` a gradient method other than
        backprop swaps the parameters for its own inputs at every evaluation, which a cache built from the
        parameters would hide: there the field reads the parameters themselves."""
        if gradient.name != "backprop" and under_transform():
            return suspended(self.field)
        return gathered(self.field)

    def _params(self, bound: BoundField | AugmentedBound) -> list[torch.Tensor]:
        """What the adjoint differentiates: the field's trainable parameters and the call's input ``u``."""
        params: list[torch.Tensor] = [p for p in self.field.parameters() if p.requires_grad]
        if bound.u is not None and bound.u.requires_grad:
            params.append(bound.u)
        return params

    def _integrate(
        self,
        bound: BoundField | AugmentedBound,
        y0: torch.Tensor,
        t: torch.Tensor,
        jump_t,
        grid,
        stats: SolverStats,
        gradient: GradientMethod,
        solver: SolverOptions | None = None,
    ) -> torch.Tensor:
        try:
            ys, _ = integrate(
                bound,
                y0,
                t,
                solver=self.solver if solver is None else solver,
                gradient=gradient,
                params=self._params(bound),
                pieces=_piecewise(self.field),
                jump_t=jump_t,
                grid=grid,
                stats=stats,
                norm=bound.norm if isinstance(bound, AugmentedBound) else None,
            )
        except SolverError as exc:
            # NaN in a parameter or the field makes adaptive steps fail until they underflow: say what it was
            if nonfinite_parameter(self.field) is not None or exc.reason is Reason.UNDERFLOW:
                reason = self._nonfinite(bound, y0, t, jump_t, grid)
                if reason is not None:
                    raise SolverError(reason, nfe=exc.nfe, reason=Reason.NONFINITE) from exc
            raise
        check_result(ys[-1], lambda: self._nonfinite(bound, y0, t, jump_t, grid) or "the solve returned NaN/inf.")
        return ys

    def _nonfinite(
        self, bound: BoundField | AugmentedBound, y0: torch.Tensor, t: torch.Tensor, jump_t, grid
    ) -> str | None:
        """Why the solve from ``y0`` went non-finite, or ``None`` if the field stays finite along it."""
        name = nonfinite_parameter(self.field)
        if name is not None:
            return (
                f"parameter `{name}` holds NaN/inf, so the solve is non-finite; restore the last good checkpoint "
                "(a diverged optimiser step?) or re-initialise it."
            )
        watch = Watch(bound, stop=True)
        with torch.no_grad():
            try:
                integrate(watch, y0.detach(), t, solver=self.solver, gradient=Backprop(), jump_t=jump_t, grid=grid)
            except (SolverError, Found):
                pass
        if watch.t is None:
            return None
        grid_ = getattr(self.field, "grid", None)
        piece = f" (piece {grid_.index(watch.t)} of {grid_.L})" if grid_ is not None and grid_.L > 1 else ""
        fix = "use smaller steps (`step_size`, or an adaptive method), shrink the weights or inputs, or use float64."
        return nonfinite_message(watch.t, watch.first, piece, fix)

    def _solve_events(
        self,
        bound: BoundField,
        y0: torch.Tensor,
        event,
        t_end: torch.Tensor | None,
        dense: bool,
        tol: float,
        stats: SolverStats,
        gradient: GradientMethod,
    ):
        """The per-sample event loop (:func:`~cde_nets.solvers.events.per_sample_events`, the one both doors run)
        over ``[0, T]``: solves of a few steps on the rows still running (``u`` restricted to them)."""
        jump_t, grid = self._grids(self.field)
        rows: dict = {}

        def bound_rows(idx: torch.Tensor) -> BoundField:
            # the loop passes the same idx tensor until the batch shrinks: gather u once per compaction (with its
            # graph, though the first call may come from a no-grad event check)
            if rows.get("idx") is not idx:
                with torch.enable_grad():
                    rows.update(idx=idx, bound=bound.rows(idx))
            return rows["bound"]

        def solve(y: torch.Tensor, times: torch.Tensor, idx: torch.Tensor, g, first_step):
            solver = (
                None if first_step is None else self.solver.replace(options={**self.options, "first_step": first_step})
            )
            before = stats.steps_forward
            ys = self._integrate(bound_rows(idx), y, times, jump_t, g, stats, gradient, solver)
            return ys, stats.steps_forward - before

        def field(t: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
            return _field_at(bound_rows(idx), t, y)

        stop_below = self.stop is not None
        if self.stop is not None:
            event = _norm_event(field, self.stop.eps)
        return per_sample_events(
            solve,
            field,
            y0,
            t0=0.0,
            t1=self.T,
            grid=grid,
            steps_to_points=self.method in REVERSIBLE_METHODS,
            free_first_step="first_step" not in self.options,
            event=event,
            t_end=t_end,
            stop_below=stop_below,
            tol=tol,
            dense=dense,
        )

    def _first_event(
        self, bound: BoundField, y0: torch.Tensor, event, stats: SolverStats, gradient: GradientMethod
    ) -> Solution:
        """The whole batch until the first event: ``cde_nets.odeint``'s whole-state event search and its
        implicit-function-theorem gradients (one implementation), on the block's field and settings."""
        s = self.solver
        options: dict = {**s.options, "max_num_steps": s.max_steps}
        if s.autocast is not None:
            options["autocast"] = s.autocast
        kw: dict = dict(rtol=s.rtol, atol=s.atol) if s.adaptive else {}
        if s.adaptive:
            jump_t, _ = self._grids(self.field)
            if jump_t is not None:
                options["jump_t"] = jump_t
        else:  # the search steps from 0 by the block's largest step (its default: one step per piece)
            options["step_size"] = s.step_size or max(b - a for a, b in self._pieces())
        t = torch.tensor([0.0, self.T], dtype=torch.float64, device=y0.device)
        with self._gathered(gradient):
            t_star, sol = odeint(
                bound, y0, t, event_fn=event, method=s.method, options=options, gradient=gradient,
                adjoint_params=self._params(bound), **kw,
            )  # fmt: skip
        n = y0.shape[0]
        times = t_star.to(torch.float64).expand(n)
        fired = torch.ones(n, dtype=torch.bool, device=y0.device)
        return Solution(y=sol[-1], stats=stats, stop_times=times, fired=fired)

    def _solve(
        self, bound: BoundField, y0: torch.Tensor, t: torch.Tensor, stats: SolverStats, gradient: GradientMethod
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The states at ``t`` and the integrated regularisers' batch means (empty without regularisers)."""
        jump_t, grid = self._grids(self.field)
        with self._gathered(gradient):
            if not self.regularisers:
                return self._integrate(bound, y0, t, jump_t, grid, stats, gradient), {}
            augmented, Y0 = self.regularisers.augment(bound, y0)
            Ys = self._integrate(augmented, Y0, t, jump_t, grid, stats, gradient)
        return self.regularisers.split(Ys, y0.shape, 1.0 if float(t[-1]) > float(t[0]) else -1.0)

    def extra_repr(self) -> str:
        return f"T={self.T}, method={self.method!r}, rtol={self.rtol}, atol={self.atol}, gradient={self.gradient!r}"
