"""The adapter to torchdiffeq: validated options, solver statistics, and errors that say what to try.

torchdiffeq reports no evaluation counts and signals step-size underflow or too many steps with bare
``assert``s. Here the field is wrapped in a counting module whose torchdiffeq callbacks (``callback_step`` and
friends, forward and adjoint) count accepted/rejected steps and raise :class:`SolverError` with the NFE so far
before torchdiffeq's own assertion would fire — in the forward solve and in the adjoint's backward solve alike.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torchdiffeq import odeint, odeint_adjoint

from .errors import SolverError, check_positive
from .fast_rk import fast_applies, odeint_fast
from .implicit_ode import IMPLICIT_GRADIENTS, IMPLICIT_METHODS, IMPLICIT_OPTIONS, integrate_implicit
from .piecewise_adjoint import PiecewiseParam, lands_on_boundaries, piecewise_adjoint
from .replay import replay_gradient
from .split_ode import SPLIT_GRADIENTS, SPLIT_METHODS, integrate_split
from .tableaux import method_tableau

__all__ = [
    "ADAPTIVE_METHODS",
    "FIXED_METHODS",
    "IMPLICIT_METHODS",
    "GRADIENTS",
    "ODE_GRADIENTS",
    "REVERSIBLE_METHODS",
    "check_gradient",
    "is_adaptive",
    "SolverStats",
    "integrate",
    "check_method",
    "check_options",
    "aligned_grid",
    "PiecewiseParam",
]

# False routes every adjoint through torchdiffeq's ``odeint_adjoint`` (the reference the tests compare with).
_PIECEWISE_ADJOINT = True

ADAPTIVE_METHODS: dict[str, int] = {"dopri8": 8, "dopri5": 5, "bosh3": 3, "fehlberg2": 2, "adaptive_heun": 2}
FIXED_METHODS: dict[str, int] = {"euler": 1, "midpoint": 2, "heun2": 2, "heun3": 3, "rk4": 4}
# the alf integrator is cde_nets' own (solvers.alf), adaptive or on a fixed grid
REVERSIBLE_METHODS: dict[str, int] = {"alf": 2}
GRADIENTS = ("adjoint", "backprop")  # every block kind (the SDE block too)
ODE_GRADIENTS = (*GRADIENTS, "checkpoint", "symplectic", "reversible")
_ALF_OPTIONS = {"eta", "first_step", "max_step", "safety", "ifactor", "dfactor"}
_ADAPTIVE_OPTIONS = {"first_step", "max_step", "min_step", "safety", "ifactor", "dfactor", "step_t"}
_FIXED_OPTIONS: set[str] = set()


@dataclass
class SolverStats:
    """Counts of one call. ``nfe_backward`` counts field evaluations of the adjoint solve (``adjoint``) or the
    vector-Jacobian products through recorded evaluations (``backprop``)."""

    nfe_forward: int = 0
    nfe_backward: int = 0
    steps_forward: int = 0
    rejected_forward: int = 0
    steps_backward: int = 0
    rejected_backward: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    # read like a dict (``stats["nfe_forward"]``): a Solution's stats stay live, so backward counts appear later
    def __getitem__(self, key: str) -> int:
        if key not in self.__dataclass_fields__:
            raise KeyError(f"{key!r}; the counts are {sorted(self.__dataclass_fields__)}")
        return getattr(self, key)

    def keys(self):
        return self.as_dict().keys()

    def items(self):
        return self.as_dict().items()


def check_method(method: str, name: str = "method") -> str:
    own = (*REVERSIBLE_METHODS, *IMPLICIT_METHODS, *SPLIT_METHODS) if name == "method" else ()
    known = (*ADAPTIVE_METHODS, *FIXED_METHODS, *own)
    if not isinstance(method, str) or method not in known:
        alf = (
            f", reversible (adaptive, or fixed with `step_size`): {sorted(REVERSIBLE_METHODS)}"
            if name == "method"
            else ""
        )
        raise ValueError(
            f"`{name}` {method!r} is unknown; adaptive: {sorted(ADAPTIVE_METHODS)}, "
            f"fixed-step: {sorted(FIXED_METHODS)}{alf}"
            + (
                f", implicit (fixed-step): {sorted(IMPLICIT_METHODS)}, symplectic compositions (fixed-step, "
                f"separable fields): {sorted(SPLIT_METHODS)}."
                if name == "method"
                else "."
            )
        )
    return method


def is_adaptive(method: str, step_size: float | None = None) -> bool:
    """Whether ``method`` chooses its own steps (``alf`` does unless given a ``step_size``)."""
    return method in ADAPTIVE_METHODS or (method in REVERSIBLE_METHODS and step_size is None)


def check_gradient(method: str, gradient: str) -> str:
    """Refuse a gradient mode ``method`` cannot give, naming what can."""
    if gradient not in ODE_GRADIENTS:
        raise ValueError(f"`gradient` must be one of {ODE_GRADIENTS}, got {gradient!r}.")
    if method in IMPLICIT_METHODS:
        if gradient not in IMPLICIT_GRADIENTS:
            raise ValueError(
                f"method={method!r} (implicit Runge-Kutta) takes gradient='backprop', 'checkpoint' or 'adjoint' "
                f"(each step's gradient by the implicit function theorem); got {gradient!r}."
            )
    elif method in SPLIT_METHODS:
        if gradient not in SPLIT_GRADIENTS:
            raise ValueError(
                f"method={method!r} (a symplectic composition) takes gradient='backprop', 'checkpoint', or "
                f"'adjoint'/'reversible' (states rebuilt by its exact inverse, constant memory); got {gradient!r}."
            )
    elif method in REVERSIBLE_METHODS:
        if gradient not in ("reversible", "backprop"):
            raise ValueError(
                f"method={method!r} (asynchronous leapfrog) takes gradient='reversible' (its exact "
                f"inverse, constant memory) or 'backprop'; got {gradient!r}."
            )
    elif gradient == "reversible":
        raise ValueError(
            f"gradient='reversible' reconstructs states with an invertible integrator: use "
            f"method='alf' (not {method!r}), or gradient='checkpoint' for an exact gradient of "
            f"{method!r}."
        )
    elif gradient in ("checkpoint", "symplectic"):
        method_tableau(method, gradient)
    return gradient


def check_options(method: str, options: dict | None) -> dict:
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"`options` must be a dict of torchdiffeq options, got {type(options).__name__}.")
    options = dict(options or {})
    if method in REVERSIBLE_METHODS:
        valid = _ALF_OPTIONS
    elif method in IMPLICIT_METHODS:
        valid = IMPLICIT_OPTIONS
    elif method in SPLIT_METHODS:
        valid = set()
    else:
        valid = _ADAPTIVE_OPTIONS if method in ADAPTIVE_METHODS else _FIXED_OPTIONS
    unknown = set(options) - valid
    if unknown:
        hint = "use `step_size=` of the block for fixed-step methods; " if method in FIXED_METHODS else ""
        raise ValueError(
            f"unknown option(s) {sorted(unknown)} for method {method!r}; {hint}valid: {sorted(valid) or 'none'}."
        )
    return options


def aligned_grid(boundaries: Sequence[float], step_size: float | None) -> torch.Tensor:
    """A fixed-step grid that contains every piece boundary, with steps of at most ``step_size`` (float64).

    Without ``step_size`` it is the boundaries themselves: one step per piece, the discrete-mode grid.
    """
    pts = [float(boundaries[0])]
    for a, b in zip(boundaries[:-1], boundaries[1:]):
        n = 1 if step_size is None else max(1, math.ceil((b - a) / step_size - 1e-9))
        pts.extend(a + (b - a) * (i / n) for i in range(1, n))
        pts.append(float(b))
    return torch.tensor(pts, dtype=torch.float64)


def _float(x: float | torch.Tensor) -> float:
    """A time or step size as a Python float (the fast path passes floats; torchdiffeq passes 0-d tensors)."""
    return x if isinstance(x, float) else float(torch.as_tensor(x).detach())


class _Counted(nn.Module):
    """Wraps a field: counts evaluations and steps, enforces ``max_steps``, turns failures into SolverError."""

    field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def __init__(
        self,
        field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        stats: SolverStats,
        max_steps: int,
        count_vjp: bool,
    ):
        super().__init__()
        self.field = field
        self.stats = stats
        self.max_steps = max_steps
        self.count_vjp = count_vjp
        self.backward_phase = False
        self.scan_backward = True  # the piecewise adjoint checks its state once per interval instead
        self.backward_jumps: list[float] = []  # jump_t of an adaptive backward solve, increasing
        self.field_error: BaseException | None = None
        self.recorder = None  # a solvers.replay.Recorder while a replayed forward solve runs

    def __call__(self, t, y):
        # a private wrapper nobody hooks: straight to forward (nn.Module's hook dispatch costs ~1 µs an evaluation)
        return self.forward(t, y)

    def forward(self, t, y):
        try:
            out = self.field(t, y)
        except BaseException as exc:
            self.field_error = exc  # the field's own exception passes through unchanged
            raise
        if self.backward_phase:
            self.stats.nfe_backward += 1
        else:
            self.stats.nfe_forward += 1
            if self.recorder is not None:
                self.recorder.evaluated()
            if self.count_vjp and out.requires_grad:
                out.register_hook(self._count_vjp)
        return out

    def _count_vjp(self, grad):
        self.stats.nfe_backward += 1

    # torchdiffeq calls these at the start of every step (before its own assertions) and on accept/reject.
    def _check_step(self, t0, y0, dt, backward: bool):
        nfe = self.stats.nfe_backward if backward else self.stats.nfe_forward
        steps = (
            (self.stats.steps_backward + self.stats.rejected_backward)
            if backward
            else (self.stats.steps_forward + self.stats.rejected_forward)
        )
        where = "adjoint (backward) solve" if backward else "forward solve"
        if steps >= self.max_steps:
            t0f = _float(t0)
            raise SolverError(
                f"max_steps={self.max_steps} reached in the {where} at t={t0f:.6g} after {nfe} field "
                "evaluations; raise `max_steps`, loosen `rtol`/`atol`, or regularise the field (it may be stiff).",
                nfe=nfe,
            )
        t0f, dtf = _float(t0), _float(dt)
        if backward and self.backward_jumps:
            self._clip_on_jump(t0f, dtf, dt)
        moved = (t0f - dtf != t0f) if backward else (t0f + dtf != t0f)
        if not moved or dtf <= 0:
            raise SolverError(
                f"step size underflow (dt={dtf:.3g}) in the {where} at t={t0f:.6g} after {nfe} field evaluations; "
                "the solution is blowing up or the field is stiff: loosen `rtol`/`atol`, use float64, "
                "shrink the weights, or try a fixed-step method.",
                nfe=nfe,
            )
        # torchdiffeq asserts finiteness itself in the forward solve (caught in `integrate`); the adjoint solve's
        # state is a tuple whose failure would surface as a bare AssertionError from `backward()`, so check here.
        if backward and self.scan_backward and not all(bool(torch.isfinite(v).all()) for v in y0):
            raise SolverError(
                f"the state became non-finite (NaN/inf) in the {where} at t={t0f:.6g} after {nfe} field "
                "evaluations; lower the learning rate, tighten the tolerance, or check the inputs.",
                nfe=nfe,
            )

    def _clip_on_jump(self, t0: float, dt: float, dt_tensor: torch.Tensor) -> None:
        """torchdiffeq clips a step at a jump only when the jump lies strictly inside it; a step that ends exactly
        on one (common with equal pieces: after a clipped step of one piece the next proposal is often the same
        size) neither re-evaluates the field on the jump's far side nor moves on to the next jump, so every
        later step of the solve crosses jumps. Widening ``dt`` by a few ulps makes the solver clip it there.
        The backward solve runs in negated time ``s = −t``: the step ends at ``s = −t0 + dt``."""
        end = -t0 + dt
        k = bisect.bisect_left(self.backward_jumps, -end)
        if k == len(self.backward_jumps) or self.backward_jumps[k] != -end:
            return
        wider = dt
        while -t0 + wider <= end:
            wider = math.nextafter(wider, math.inf)
        dt_tensor.fill_(wider)

    def callback_step(self, t0, y0, dt):
        self._check_step(t0, y0, dt, backward=False)
        if self.recorder is not None:
            self.recorder.step()

    def callback_step_adjoint(self, t0, y0, dt):
        self._check_step(t0, y0, dt, backward=True)


class _CountedAdaptive(_Counted):
    def callback_accept_step(self, t0, y0, dt):
        self.stats.steps_forward += 1
        if self.recorder is not None:
            self.recorder.accept(t0, y0, dt)

    def callback_reject_step(self, t0, y0, dt):
        self.stats.rejected_forward += 1

    def callback_accept_step_adjoint(self, t0, y0, dt):
        self.stats.steps_backward += 1

    def callback_reject_step_adjoint(self, t0, y0, dt):
        self.stats.rejected_backward += 1


class _CountedFixed(_Counted):
    def callback_step(self, t0, y0, dt):
        super().callback_step(t0, y0, dt)
        self.stats.steps_forward += 1
        if self.recorder is not None:
            self.recorder.accept(t0, y0, dt)

    def callback_step_adjoint(self, t0, y0, dt):
        super().callback_step_adjoint(t0, y0, dt)
        self.stats.steps_backward += 1


def integrate(
    field: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    *,
    method: str = "dopri5",
    rtol: float = 1e-6,
    atol: float = 1e-8,
    gradient: str = "adjoint",
    params: Sequence[torch.Tensor] | None = None,
    jump_t: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    options: dict | None = None,
    max_steps: int = 100_000,
    seminorm: bool = True,
    adjoint_method: str | None = None,
    adjoint_rtol: float | None = None,
    adjoint_atol: float | None = None,
    stats: SolverStats | None = None,
    pieces: Sequence[PiecewiseParam] | None = None,
) -> tuple[torch.Tensor, SolverStats]:
    """Solve ``y' = field(t, y)`` at times ``t`` (float64, increasing) with torchdiffeq.

    ``jump_t`` (adaptive methods) lists the times where the field jumps; ``grid`` (fixed-step methods) is the
    step grid, which should contain those times. ``"backprop"`` differentiates through the solver's operations.

    ``gradient="adjoint"`` solves the adjoint ODE backwards (Chen et al. 2018) and returns gradients for every
    tensor of ``params`` that requires grad: parameters, and any other tensor the field closes over (e.g. a
    block input ``u``). ``pieces`` lists the parameters that are constant on pieces of time
    (:class:`~solvers.piecewise_adjoint.PiecewiseParam`: ``(data, boundaries, piece_at, set_views)``); with the
    seminorm (default) the backward solve then carries one piece-shaped gradient state per such tensor and
    differentiates only the piece in force, so its cost is linear in the number of pieces
    (:mod:`solvers.piecewise_adjoint`); its steps, and so its gradients up to rounding, are those of
    torchdiffeq's ``odeint_adjoint`` with ``norm="seminorm"``, except where that one evaluates a piece that is
    not in force (see the module). Without the seminorm, when ``t`` requires grad,
    or when the backward solver would not step on every piece boundary (an adaptive backward method without
    them in ``jump_t``, a fixed-step one whose ``grid`` lacks them), it falls back to ``odeint_adjoint`` with
    ``params`` as ``adjoint_params``, whose cost grows with the square of the number of pieces.

    Returns the solution at ``t``, ``(len(t), *y0.shape)``, and the call's :class:`SolverStats`.
    """
    check_method(method)
    options = check_options(method, options)
    check_gradient(method, gradient)
    stats = SolverStats() if stats is None else stats
    if method in REVERSIBLE_METHODS:
        from .alf import integrate_alf

        ys = integrate_alf(
            field,
            y0,
            t,
            rtol=rtol,
            atol=atol,
            gradient=gradient,
            params=params,
            pieces=pieces,
            jump_t=jump_t,
            grid=grid,
            options=options,
            max_steps=max_steps,
            stats=stats,
        )
        return ys, stats
    if method in SPLIT_METHODS:
        ys = integrate_split(
            field, y0, t, method=method, gradient=gradient, params=params, grid=grid, max_steps=max_steps, stats=stats
        )
        return ys, stats
    if method in IMPLICIT_METHODS:
        ys = integrate_implicit(
            field,
            y0,
            t,
            method=method,
            gradient=gradient,
            params=params,
            grid=grid,
            options=options,
            max_steps=max_steps,
            stats=stats,
        )
        return ys, stats
    adaptive = method in ADAPTIVE_METHODS
    wrapper_cls = _CountedAdaptive if adaptive else _CountedFixed
    func = wrapper_cls(field, stats, max_steps, count_vjp=gradient == "backprop")

    options.update(_jump_options(method, jump_t, grid))

    kwargs = dict(rtol=rtol, atol=atol, method=method, options=options)
    try:
        if fast_applies(method, gradient, y0, t, params, options):
            ys = odeint_fast(func, y0, t, method=method, rtol=rtol, atol=atol, options=options, gradient=gradient)
        elif gradient == "adjoint":
            adj_method = method if adjoint_method is None else check_method(adjoint_method)
            adj_options = _adjoint_options(adj_method, jump_t, grid, seminorm)
            adj_rtol = rtol if adjoint_rtol is None else adjoint_rtol
            adj_atol = atol if adjoint_atol is None else adjoint_atol
            if adj_method in ADAPTIVE_METHODS and jump_t is not None:
                func.backward_jumps = sorted(float(j) for j in jump_t.tolist())
            if _piecewise_applies(seminorm, y0, t, pieces, adj_method, jump_t, grid):
                func.scan_backward = False
                ys = piecewise_adjoint(
                    func,
                    y0,
                    t,
                    tuple(params or ()),
                    tuple(pieces or ()),
                    rtol=rtol,
                    atol=atol,
                    method=method,
                    options=options,
                    adjoint_rtol=adj_rtol,
                    adjoint_atol=adj_atol,
                    adjoint_method=adj_method,
                    adjoint_options=adj_options,
                    stats=stats,
                    adjoint_adaptive=adj_method in ADAPTIVE_METHODS,
                )
            else:
                ys = odeint_adjoint(
                    func,
                    y0,
                    t,
                    adjoint_params=tuple(params or ()),
                    adjoint_method=adj_method,
                    adjoint_rtol=adj_rtol,
                    adjoint_atol=adj_atol,
                    adjoint_options=adj_options,
                    **kwargs,
                )
        elif gradient in ("checkpoint", "symplectic"):
            ys = replay_gradient(
                func,
                y0,
                t,
                tuple(params or ()),
                tuple(pieces or ()),
                gradient=gradient,
                tableau=method_tableau(method, gradient),
                method=method,
                rtol=rtol,
                atol=atol,
                options=options,
                stats=stats,
            )
        else:
            ys = odeint(func, y0, t, **kwargs)
    except AssertionError as exc:
        if exc is func.field_error:
            raise
        nfe = stats.nfe_forward
        if "non-finite" in str(exc):
            msg = (
                f"the state became non-finite (NaN/inf) in the forward solve after {nfe} field evaluations; "
                "lower the learning rate, tighten the tolerance, or check the inputs."
            )
        else:
            msg = (
                f"torchdiffeq stopped after {nfe} field evaluations: {str(exc)[:200]}. "
                "Loosen `rtol`/`atol`, raise `max_steps`, or use float64."
            )
        raise SolverError(msg, nfe=nfe) from None
    func.backward_phase = True
    return ys, stats


def _piecewise_applies(seminorm, y0, t, pieces, adj_method, jump_t, grid) -> bool:
    if not (_PIECEWISE_ADJOINT and seminorm and isinstance(y0, torch.Tensor)) or t.requires_grad:
        return False
    if not pieces:
        return True
    stops = jump_t if adj_method in ADAPTIVE_METHODS else grid
    return lands_on_boundaries(pieces, t, None if stops is None else stops.tolist())


def _grid_constructor(grid: torch.Tensor):
    """torchdiffeq ``grid_constructor``: ``grid`` cut to the span of the requested times, plus those times.

    torchdiffeq calls it with the times as given (decreasing for the adjoint's backward solve, which it then
    negates), so the grid is returned in the same direction.
    """

    def construct(func, y0, t):
        lo, hi = (t[0], t[-1]) if t[0] <= t[-1] else (t[-1], t[0])
        g = grid.to(t.dtype)
        pts = torch.unique(torch.cat([g[(g >= lo) & (g <= hi)], t]))
        return pts if t[0] <= t[-1] else pts.flip(0)

    return construct


def _jump_options(method: str, jump_t: torch.Tensor | None, grid: torch.Tensor | None) -> dict:
    if method in ADAPTIVE_METHODS:
        return {"jump_t": jump_t} if jump_t is not None and len(jump_t) else {}
    # Evaluate just after a grid point at a step's start and just before it at its end, so a step inside
    # piece l never sees piece l +- 1 through rounding of t.
    opts: dict = {"perturb": True}
    if grid is not None:
        opts["grid_constructor"] = _grid_constructor(grid)
    return opts


def _adjoint_options(method: str, jump_t, grid, seminorm: bool) -> dict:
    opts = _jump_options(method, jump_t, grid)
    if seminorm and method in ADAPTIVE_METHODS:
        opts["norm"] = "seminorm"
    return opts


def validate_tolerances(rtol: float, atol: float) -> tuple[float, float]:
    rtol = check_positive("rtol", rtol, "Typical values: 1e-3 (training) to 1e-10 (reference solutions).")
    atol = check_positive("atol", atol, "Typical values: 1e-4 (training) to 1e-12 (reference solutions).")
    return rtol, atol
