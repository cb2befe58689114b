r"""The adjoint method for fields whose parameters are constant pieces over time, in time linear in the pieces.

Pontryagin's adjoint (Chen et al. 2018, "Neural ordinary differential equations", eqs. 4-5): for
``y' = F(t, y, θ)`` on ``[t_0, t_N]`` and a loss ``ℒ(y(t_1), ..., y(t_N))``, the adjoint ``a = ∂ℒ/∂y`` and the
parameter gradient ``g`` obey, backwards in time,

    ``a' = −aᵀ ∂F/∂y``,    ``g' = −aᵀ ∂F/∂θ``,    ``a(t_N) = ∂ℒ/∂y(t_N)``,  ``g(t_N) = 0``,

with ``a`` jumping by ``∂ℒ/∂y(t_i)`` at every output time, and ``y`` recomputed backwards alongside. Then
``∂ℒ/∂y(t_0) = a(t_0)`` and ``∂ℒ/∂θ = g(t_0)``.

When ``θ = (θ_0, ..., θ_{L−1})`` holds piece ``θ_l`` on ``[τ_l, τ_{l+1})``, only one piece is in force at any
``t``: ``∂F/∂θ_k = 0`` for ``k ≠ l(t)``. torchdiffeq's generic adjoint nevertheless takes every backward
vector-Jacobian product with respect to the whole ``(L, ...)`` tensor and carries ``(L, ...)``-sized gradient
states through every Runge-Kutta stage: ``O(L)`` work per step, ``O(L²)`` per solve. Here the backward state is

    ``(y, a, G_1, ..., G_P, g_1, ..., g_Q)``

with one *piece-shaped* accumulator ``G_j`` per piecewise tensor, ``G_j' = −aᵀ ∂F/∂θ_{j, l(t)}``, and full
accumulators ``g_k`` for the other tensors (time-invariant parameters, or inputs such as NAIS's ``u``). Each
backward evaluation differentiates only with respect to the piece in force (looked up from ``t`` with the field's
own rule) and those other tensors, so a solve costs ``O(L)``. The solver stops on every piece boundary (they are
``jump_t`` of adaptive methods and points of a fixed-step grid), where the callback at the start of the next
step reads ``G_j`` exactly; piece ``l``'s gradient is the difference of two readings,

    ``∂ℒ/∂θ_{j,l} = G_j(τ_l) − G_j(τ_{l+1})``.

Cancellation: the difference of two readings of the running total carries a rounding error of a few units of
``ε |G_j|`` (``ε`` the machine epsilon) per step, against the integration error of the piece's own gradient,
of order ``tol · |∂ℒ/∂θ_{j,l}|`` (the adjoint ``a`` it integrates is only held to the tolerance ``tol``, or to
``O(h^p)`` for a fixed step ``h``). The rounding matters only for pieces whose gradient is below ``ε / tol``
(``1e-10`` in float64 at ``tol = 1e-6``) of the running total — a size that is integration noise at that
tolerance anyway. ``G_j`` restarts from zero on every output interval.

The error norm of adaptive steps is the seminorm ``max(‖y‖_rms, ‖a‖_rms)`` (Kidger et al. 2021, "Hey, that's
not an ODE: faster ODE adjoints via seminorms"): the accumulators do not steer the step size, so the accepted and
rejected steps are those of torchdiffeq's ``odeint_adjoint`` with ``norm="seminorm"``, and the gradients agree
with it to rounding — with two exceptions, where torchdiffeq's own adjoint is wrong by more than the tolerance:

- a backward solve that starts on a piece boundary (an output time or a stopping window there) evaluates its
  first stage at the boundary itself, i.e. with the piece above, which is not in force on the interval; here it
  is evaluated just below, as torchdiffeq does after every jump;
- a step that ends exactly on a jump (not clipped to it) leaves torchdiffeq crossing every later jump of the
  solve; here the stepper treats it as clipped there (``land_on_jumps`` of :func:`solvers.steppers.fast_rk.odeint_fast`,
  asked for by the adapter's ``backward_jumps``).

Both solves run on the library's stepper (:func:`solvers.steppers.rk_odeint.odeint_rk` reduces the tuple state and the
decreasing times as torchdiffeq does), so the steps are torchdiffeq's and, for ``dopri5``, the gradients its bits;
``dopri8`` reads the adjoint at each output time off its seventh-order extension, not torchdiffeq's quartic.

Should an accepted step still cross a boundary, the interval is solved again with full ``(L, ...)`` accumulators
(torchdiffeq's scheme, exact but quadratic). Memory: the backward state is ``2|y| + Σ_j |θ_{j,l}| + Σ_k |g_k|``,
independent of ``L``.

Contract with the caller (:class:`PiecewiseParam`): the field reads piece ``l`` of each piecewise tensor only
through the views it is handed (``set_views``), and only the piece ``piece_at(t)`` at time ``t``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import BACKWARD_UNSTABLE, Reason, SolverError
from ..norms import StateNorm
from ..steppers.fast_rk import fast_applies, odeint_fast
from ..steppers.rk_odeint import odeint_rk
from .piece_grads import PiecewiseParam, piece_slots
from .rk_adjoint import NOT_SERVED, adjoint_with_graph, param_swap
from .second_order import first_order, remember_inputs, served

__all__ = ["PiecewiseParam", "piecewise_adjoint", "lands_on_boundaries"]


def lands_on_boundaries(pieces: Sequence[PiecewiseParam], t: torch.Tensor, stops: Sequence[float] | None) -> bool:
    """True when every piece boundary strictly inside ``[t[0], t[-1]]`` is an output time or one of ``stops``
    (adaptive: ``jump_t``; fixed-step: the grid): the solver then starts a step on each of them."""
    lo, hi = sorted((float(t[0]), float(t[-1])))
    inside = {float(b) for p in pieces for b in p.boundaries if lo < float(b) < hi}
    if not inside:
        return True
    return inside <= {float(s) for s in t.tolist()} | {float(s) for s in (stops or ())}


class _PieceViews(Sequence):
    """What a piecewise tensor hands the field during the backward solve: a fresh leaf for the piece in force,
    so the vector-Jacobian product is taken with respect to that piece only."""

    def __init__(self, p: PiecewiseParam):
        self.p = p
        self.detached = p.data.detach()
        self.l = -1
        self.leaf: torch.Tensor | None = None

    def select(self, t: torch.Tensor) -> torch.Tensor:
        self.l = self.p.piece_at(t)
        self.leaf = self.detached[self.l].requires_grad_()
        return self.leaf

    def __len__(self) -> int:
        return self.detached.shape[0]

    def __getitem__(self, l):
        if l != self.l:
            raise RuntimeError(
                f"the field read piece {l} of a piecewise parameter of shape {tuple(self.detached.shape)} while "
                f"piece {self.l} is in force; the piecewise adjoint differentiates the piece in force only. Read "
                "the piece in force at t, or pass `seminorm=False` (torchdiffeq's adjoint over all pieces)."
            )
        return self.leaf


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.abs().pow(2).mean().sqrt()


def _seminorm(state: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The backward error norm over ``(y, a)`` only."""
    return torch.maximum(_rms(state[0]), _rms(state[1]))


def _seminorm_of(norm: StateNorm) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    """The seminorm with the forward solve's norm of ``y`` and ``a`` (a tuple state's: its parts' largest RMS, as
    torchdiffeq's ``adjoint_options={"norm": "seminorm"}`` measures them)."""
    return lambda state: torch.maximum(norm(state[0]), norm(state[1]))


class _Straddled(Exception):
    """An accepted backward step crossed a piece boundary instead of stopping on it."""


class _Backward:
    """The augmented dynamics ``(y, a, G, g)' = (F, −aᵀ∂F/∂y, −aᵀ∂F/∂θ_l(t), −aᵀ∂F/∂φ)`` of the backward solves,
    plus the readings of ``G`` where a step starts on a piece boundary.

    ``full=True`` differentiates the whole ``(L, ...)`` tensors instead (``G`` then holds every piece): the
    fallback for an interval where the adaptive solver crossed a boundary within a step.
    """

    def __init__(self, func, views: list[_PieceViews], others: tuple[torch.Tensor, ...], adaptive: bool):
        self.func, self.views, self.others = func, views, others
        self.marks = [sorted({float(b) for b in v.p.boundaries}) for v in views]
        self.all_marks = sorted({m for marks in self.marks for m in marks})
        self.full = False
        self.field_error: BaseException | None = None
        self._step_check = getattr(func, "callback_step_adjoint", None)
        self._accept = getattr(func, "callback_accept_step_adjoint", None)
        reject = getattr(func, "callback_reject_step_adjoint", None)
        if adaptive:  # fixed-step solvers take only callback_step
            self.callback_accept_step = self._on_accept
            if reject is not None:
                self.callback_reject_step = reject

    def start(self, t_hi: float, t_lo: float, state: tuple[torch.Tensor, ...]) -> None:
        """A new output interval ``[t_lo, t_hi]`` begins at ``t_hi`` with ``G = 0``."""
        self.t_lo = t_lo
        # torchdiffeq evaluates the first stage at t_hi itself, where a boundary's lookup gives the piece above,
        # which is not in force on the interval: evaluate just below it, as the solver does after a jump
        self.start_below = t_hi if t_hi in self.all_marks else None
        self.last = [(t_hi, state[2 + j]) for j in range(len(self.views))]
        self.readings: list[tuple[int, int, torch.Tensor]] = []  # (tensor j, piece l, gradient of the piece)

    def finish(self, t_lo: float, state: tuple[torch.Tensor, ...]) -> None:
        for j in range(len(self.views)):
            self._read(j, t_lo, state[2 + j])

    def _read(self, j: int, t: float, G: torch.Tensor) -> None:
        t_prev, G_prev = self.last[j]
        if t < t_prev:
            l = self.views[j].p.piece_at(torch.tensor(0.5 * (t + t_prev), dtype=torch.float64))
            self.readings.append((j, l, G - G_prev))
            self.last[j] = (t, G)

    def callback_step(self, t0, state, dt) -> None:
        if not self.full:
            t = float(t0)
            for j, marks in enumerate(self.marks):
                k = bisect.bisect_left(marks, t)
                if k < len(marks) and marks[k] == t:
                    self._read(j, t, state[2 + j])
        if self._step_check is not None:
            self._step_check(t0, state, dt)

    def _on_accept(self, t0, state, dt) -> None:
        if not self.full:
            hi = float(t0)
            # the step's end as the solver computes it, in its negated time; the last step may overshoot t_lo
            lo = max(-(-hi + float(dt)), self.t_lo)
            if bisect.bisect_right(self.all_marks, lo) < bisect.bisect_left(self.all_marks, hi):
                raise _Straddled
        if self._accept is not None:
            self._accept(t0, state, dt)

    def __call__(self, t: torch.Tensor, state: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        y, a = state[0], state[1]
        if self.start_below is not None and float(t) == self.start_below:
            t = torch.nextafter(t, t.new_tensor(-math.inf))
        with torch.enable_grad():
            y = y.detach().requires_grad_(True)
            wrt = [v.p.data for v in self.views] if self.full else [v.select(t) for v in self.views]
            try:
                f = self.func(t, y)
            except BaseException as exc:
                self.field_error = exc
                raise
            inputs = (y, *wrt, *self.others)
            vjps: tuple[torch.Tensor | None, ...]
            if f.requires_grad:
                vjps = torch.autograd.grad(f, inputs, -a, allow_unused=True)
            else:
                vjps = (None,) * len(inputs)
        vjps = tuple(torch.zeros_like(x) if v is None else v for x, v in zip(inputs, vjps))
        return (f.detach(), *vjps)


def _second_order(ctx: Any, cotangents: tuple, outs: tuple) -> tuple | str:
    """The adjoint's second derivative: the backward solve recomputed with a graph over whole tensors (not served
    for piecewise parameters, whose gradient states are read off between steps)."""
    cfg = ctx.cfg
    if cfg["pieces"]:
        return NOT_SERVED
    t, ys, *params = ctx.saved_tensors
    swap = param_swap(cfg["func"], [p for p in params if p.requires_grad])
    if swap is None:
        return NOT_SERVED
    t = t.detach()
    norm = _backward_norm(cfg)
    options = {**cfg["adjoint_options"], "norm": lambda state: norm(state[1:])}  # the state (τ, y, a, *g)

    def recompute(free: list[torch.Tensor], params: list[torch.Tensor]) -> tuple:
        ys, grad_ys = free
        wrt = [p for p in params if p.requires_grad]
        kw = dict(rtol=cfg["adjoint_rtol"], atol=cfg["adjoint_atol"], method=cfg["adjoint_method"], options=options)
        a, *g = adjoint_with_graph(cfg["func"], cfg["func"], t, ys, grad_ys, wrt, swap, **kw)
        it = iter(g)
        return (None, a, None, *(next(it) if p.requires_grad else None for p in params))

    return served("adjoint", outs, [ys, cotangents[0]], params, recompute)


class _PiecewiseAdjoint(torch.autograd.Function):
    """Forward: the library's own stepper without a graph (:mod:`solvers.steppers.fast_rk`, torchdiffeq's steps; through
    :func:`~solvers.steppers.rk_odeint.odeint_rk`, torchdiffeq's ``odeint`` for the methods only it has). Backward: the
    adjoint solve described in the module, on the same stepper."""

    @staticmethod
    def forward(ctx, cfg: dict, y0: torch.Tensor, t: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        method, kw = cfg["method"], dict(rtol=cfg["rtol"], atol=cfg["atol"], options=cfg["options"])
        with torch.no_grad():
            if fast_applies(method, False, y0, t, (), cfg["options"]):
                ys = odeint_fast(cfg["func"], y0, t, method=method, graph=False, **kw)
            else:
                ys = odeint_rk(cfg["func"], y0, t, method=method, graph=False, **kw)
        ctx.cfg = cfg
        ctx.save_for_backward(t, ys, *params)
        remember_inputs(ctx, y0, *params)
        return ys

    @staticmethod
    @first_order("adjoint", serve=_second_order)
    def backward(ctx, grad_ys: torch.Tensor):
        cfg, stats = ctx.cfg, ctx.cfg["stats"]
        t, ys, *params = ctx.saved_tensors
        pieces: list[PiecewiseParam] = cfg["pieces"]
        slot = cfg["slot"]  # params[k] is pieces[slot[k]], or a full tensor when slot[k] is None
        others = tuple(p for p, j in zip(params, slot) if j is None)
        views = [_PieceViews(p) for p in pieces]
        grads = [torch.zeros_like(v.detached) for v in views]
        dyn = _Backward(cfg["func"], views, others, cfg["adjoint_adaptive"])
        g_others = [torch.zeros_like(p) for p in others]
        a = grad_ys[-1]
        try:
            for i in range(len(t) - 1, 0, -1):
                state = (ys[i], a, *(torch.zeros_like(v.detached[0]) for v in views), *g_others)
                counts = (stats.nfe_backward, stats.steps_backward, stats.rejected_backward)
                try:
                    state = _interval(cfg, dyn, state, t, i)
                    for j, l, g in dyn.readings:
                        grads[j][l] += g
                except _Straddled:
                    # the abandoned attempt is not counted: the statistics are those of the solve that gives the
                    # gradients, step for step torchdiffeq's
                    stats.nfe_backward, stats.steps_backward, stats.rejected_backward = counts
                    state = (ys[i], a, *(torch.zeros_like(g) for g in grads), *g_others)
                    state = _interval(cfg, dyn, state, t, i, full=True)
                    for j, g in enumerate(state[2 : 2 + len(views)]):
                        grads[j] += g
                a = state[1] + grad_ys[i - 1]
                g_others = list(state[2 + len(views) :])
        finally:
            for p in pieces:
                p.set_views(None)
        it = iter(g_others)
        return (None, a, None, *(next(it) if j is None else grads[j] for j in slot))


def _interval(cfg: dict, dyn: _Backward, state: tuple, t: torch.Tensor, i: int, full: bool = False) -> tuple:
    """Solve the backward system from ``t[i]`` to ``t[i − 1]``; returns the state there."""
    stats = cfg["stats"]
    t_hi, t_lo = float(t[i]), float(t[i - 1])
    dyn.full = full
    for v in dyn.views:
        v.p.set_views(None if full else v)
    dyn.start(t_hi, t_lo, state)
    try:
        out = odeint_rk(
            dyn,
            state,
            t[i - 1 : i + 1].flip(0),
            rtol=cfg["adjoint_rtol"],
            atol=cfg["adjoint_atol"],
            method=cfg["adjoint_method"],
            options={**cfg["adjoint_options"], "norm": _backward_norm(cfg)},
            graph=False,
            land_on_jumps=bool(getattr(cfg["func"], "backward_jumps", None)),
        )
    except AssertionError as exc:
        if exc is dyn.field_error:
            raise
        reason = Reason.UNDERFLOW if "underflow" in str(exc) else Reason.OTHER
        raise SolverError(_failure(cfg, str(exc), t_lo, t_hi), nfe=stats.nfe_backward, reason=reason) from None
    state = tuple(s[1] for s in out)
    # one finiteness check per interval (adaptive solvers also assert it on every step)
    if not bool(torch.stack([torch.isfinite(s).all() for s in state]).all()):
        raise SolverError(_failure(cfg, "non-finite", t_lo, t_hi), nfe=stats.nfe_backward, reason=Reason.NONFINITE)
    if not full:
        dyn.finish(t_lo, state)
    return state


def _backward_norm(cfg: dict) -> Callable[[tuple[torch.Tensor, ...]], torch.Tensor]:
    norm = cfg["options"].get("norm")
    return _seminorm_of(norm) if isinstance(norm, StateNorm) and norm.sizes is not None else _seminorm


def _failure(cfg: dict, what: str, t_lo: float, t_hi: float) -> str:
    nfe = cfg["stats"].nfe_backward
    where = f"in the adjoint (backward) solve over [{t_lo:.6g}, {t_hi:.6g}] after {nfe} field evaluations"
    if "non-finite" in what:
        return (
            f"the state became non-finite (NaN/inf) {where}; lower the learning rate, tighten the tolerance, "
            "or check the inputs."
        )
    return (
        f"the solver stopped {where}: {what[:200]}. Loosen `adjoint_rtol`/`adjoint_atol`, raise `max_steps`, "
        f"or use float64. {BACKWARD_UNSTABLE}"
    )


def piecewise_adjoint(
    func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    y0: torch.Tensor,
    t: torch.Tensor,
    params: Sequence[torch.Tensor],
    pieces: Sequence[PiecewiseParam],
    *,
    rtol: float,
    atol: float,
    method: str,
    options: dict,
    adjoint_rtol: float,
    adjoint_atol: float,
    adjoint_method: str,
    adjoint_options: dict,
    stats: Any,
    adjoint_adaptive: bool,
) -> torch.Tensor:
    """``odeint(func, y0, t)`` whose backward pass is the seminorm adjoint with piecewise parameter states;
    ``method`` and ``adjoint_method`` are the library's method names (its own stepper solves both ways:
    :func:`~solvers.steppers.rk_odeint.odeint_rk`).

    ``params``: every tensor to differentiate (parameters, and inputs the field closes over); those that are the
    ``data`` of an entry of ``pieces`` get piece-by-piece gradients, the others full ones. ``adjoint_options``:
    the backward solve's torchdiffeq options (its ``norm`` is replaced by the seminorm); the backward solve must
    start a step on every piece boundary (see :func:`lands_on_boundaries`). ``stats`` receives ``nfe_backward``
    through ``func``'s counting and names it in errors. ``t`` must not require grad.
    """
    params, used, slot = piece_slots(params, pieces)
    cfg = dict(
        func=func,
        rtol=rtol,
        atol=atol,
        method=method,
        options=options,
        adjoint_rtol=adjoint_rtol,
        adjoint_atol=adjoint_atol,
        adjoint_method=adjoint_method,
        adjoint_options=adjoint_options,
        pieces=[pieces[j] for j in used],
        slot=slot,
        stats=stats,
        adjoint_adaptive=adjoint_adaptive,
    )
    return _PiecewiseAdjoint.apply(cfg, y0, t, *params)
